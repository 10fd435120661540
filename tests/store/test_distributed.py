"""Shards across workers: each worker's part is a job of its own, `merge` joins them, `status` reads
them all, and a bad --shard says what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from helpers import ROOT, cli, corpus_rows, read_output, write_parquet

from cosybatch.config import RunConfig
from cosybatch.run.local import run


@pytest.mark.slow
def test_three_workers_cover_every_id_once_and_merge(tmp_path):
    rows = [{"id": f"id-{i}", "text": t} for i, t in enumerate(["Yes.", "No.", "Maybe so.", "Hello there.",
                                                                 "Good night.", "See you soon."] * 4)]
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out),
                               "--shard", f"{i}/3", "--progress", "none", "--workers", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    # The third worker takes its index from the environment, as a Kubernetes Indexed Job pod does.
    procs.append(subprocess.Popen([sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out),
                                   "--shard", "3", "--progress", "none", "--workers", "1"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "JOB_COMPLETION_INDEX": "2"}))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    parts = sorted(out.glob("part-*"))
    assert [p.name for p in parts] == [f"part-0000{i}-of-00003" for i in range(3)]
    seen: list[str] = []
    for part in parts:
        ids = list(read_output(part))  # self-contained: its own shards, manifest, stats
        assert ids and (part / "manifest.parquet").exists() and (part / "stats.json").exists()
        seen += ids
    assert sorted(seen) == sorted(r["id"] for r in rows)  # union is the corpus, disjoint

    merged = json.loads(cli("merge", str(out)).stdout)
    assert merged["items"] == len(rows) and merged["problems"] == []
    manifest = pq.read_table(out / "manifest.parquet").to_pylist()
    assert sorted(m["id"] for m in manifest) == sorted(r["id"] for r in rows)
    assert all((out / m["shard"]).exists() for m in manifest)
    status = json.loads(cli("status", str(out), "--json").stdout)
    assert status["status"] == "complete" and status["done"] == len(rows) and len(status["parts"]) == 3


@pytest.mark.slow
def test_merge_refuses_missing_parts(tmp_path):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(3))
    run(RunConfig(corpus=corpus, out=tmp_path / "out", shard_index=0, shard_count=2, progress="none"))
    proc = cli("merge", str(tmp_path / "out"))
    assert proc.returncode == 2 and "parts [1] of 2 are missing" in proc.stderr
    status = json.loads(cli("status", str(tmp_path / "out"), "--json").stdout)
    assert status["status"] == "partial" and status["missing_parts"] == [1]
    assert json.loads(cli("merge", str(tmp_path / "out"), "--partial").stdout)["problems"]


# -- status of a sharded job, --shard 0/0 --------------------------------------------------------


@pytest.mark.slow
def test_a_finished_part_reports_its_real_total(tmp_path):
    from cosybatch.store.distributed import shard_of

    ids = [f"id-{i}" for i in range(40)]
    part0 = [i for i in ids if shard_of(i, 2) == 0][:3]
    part1 = [i for i in ids if shard_of(i, 2) == 1][:1]
    lines = (ROOT / "examples" / "sentences.txt").read_text().splitlines()
    corpus = write_parquet(tmp_path / "c.parquet", [{"id": i, "text": lines[n]} for n, i in enumerate(part0 + part1)])
    out = tmp_path / "out"
    for index in (0, 1):  # 4 rows over 2 workers: each was estimated at 2
        assert run(RunConfig(corpus=corpus, out=out, shard_index=index, shard_count=2, progress="none")).exit_code == 0
    status = json.loads(cli("status", str(out), "--json").stdout)
    assert [(p["done"], p["total"], p["total_is_estimate"]) for p in status["parts"]] == [(3, 3, False), (1, 1, False)]
    assert (status["status"], status["done"], status["total"], status["total_is_estimate"]) == ("complete", 4, 4, False)
    assert "complete, 4/4 done" in cli("status", str(out)).stdout


@pytest.mark.parametrize(("spec", "message"), [
    ("0/0", "the worker count N must be at least 1"),
    ("3/0", "the worker count N must be at least 1"),
    ("0", "the worker count N must be at least 1"),
    ("2/2", "the worker index I must be in 0..1"),
    ("-1/4", "the worker index I must be in 0..3"),
])
def test_a_shard_out_of_range_says_what_is_wrong(spec, message):
    from cosybatch.errors import UsageError
    from cosybatch.store.distributed import parse_shard

    with pytest.raises(UsageError, match=message):
        parse_shard(spec, env={})


@pytest.mark.slow
def test_shard_zero_of_zero_on_the_command_line():
    proc = cli("run", "examples/corpus.parquet", "--shard", "0/0", "--check")
    assert proc.returncode == 2
    assert "the worker count N must be at least 1" in proc.stderr and "0..-1" not in proc.stderr
