"""Shards across workers (cosybatch/store/distributed.py): each worker's part is a job of its own,
`merge` joins them with the job's totals, `status` reads them all, a bad --shard says what is
wrong, and merge compares the parts and checks each one before it joins them (issue 23, case 3)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from helpers import ROOT, cli, corpus_rows, numbered_rows, read_output, write_jsonl, write_parquet

from cosybatch.config import RunConfig
from cosybatch.errors import UsageError
from cosybatch.run.local import run
from cosybatch.store.distributed import merge


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
    run(RunConfig.from_options(corpus=corpus, out=tmp_path / "out", shard_index=0, shard_count=2, progress="none"))
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
        assert run(RunConfig.from_options(corpus=corpus, out=out, shard_index=index, shard_count=2,
                                          progress="none")).exit_code == 0
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


# -- merge compares the parts and checks each one (issue 23, case 3) -------------------------------
def sharded(tone, tmp_path, n: int = 12, per_part: dict | None = None):
    """A 2-part job; per_part[i] overrides part i's settings (another corpus, another seed)."""
    corpus = write_jsonl(tmp_path / "c.jsonl", numbered_rows(n))
    out = tmp_path / "out"
    for index in range(2):
        settings = {"corpus": corpus, **(per_part or {}).get(index, {})}
        cfg = tone(settings.pop("corpus"), out, shard_index=index, shard_count=2, shard_max_items=2, **settings)
        assert run(cfg).status == "complete"
    return corpus, out


def test_merge_refuses_a_part_made_from_another_corpus(tone, tmp_path):
    other = write_jsonl(tmp_path / "other.jsonl", numbered_rows(12, prefix="x"))
    _, out = sharded(tone, tmp_path, per_part={1: {"corpus": other}})
    for partial in (False, True):
        with pytest.raises(UsageError, match=r"part-00001-of-00002 differs from part-00000-of-00002 in corpus\."):
            merge(out, allow_partial=partial)
    assert not (out / "manifest.parquet").exists()


def test_merge_refuses_a_part_with_other_settings(tone, tmp_path):
    _, out = sharded(tone, tmp_path, per_part={1: {"seed": 7}})
    with pytest.raises(UsageError, match=r"part-00001-of-00002 differs .* in seed \(seed: part-00000-of-00002 has 0"):
        merge(out)


def test_merge_refuses_a_part_that_lost_a_shard_after_it_finished(tone, tmp_path):
    _, out = sharded(tone, tmp_path)
    (out / "part-00001-of-00002" / "shard-000000.tar").unlink()
    with pytest.raises(UsageError, match=r"part-00001-of-00002 is damaged .*shard-000000.tar is missing"):
        merge(out)
    result = merge(out, allow_partial=True)
    assert result["parts_merged"] == 1 and "part-00001-of-00002 is damaged" in result["problems"][0]
    stats = json.loads((out / "stats.json").read_text())
    part0 = json.loads((out / "part-00000-of-00002" / "stats.json").read_text())
    assert (stats["status"], stats["items"]) == ("partial", part0["job_totals"]["items_done"])


def test_merge_refuses_a_part_whose_lock_is_held(tone, tmp_path):
    _, out = sharded(tone, tmp_path)
    with open(out / "part-00000-of-00002" / ".cosybatch" / "lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a run of that part holds it
        with pytest.raises(UsageError, match=r"part-00000-of-00002 is being written by a run now"):
            merge(out)
        assert merge(out, allow_partial=True)["parts_merged"] == 1
    assert merge(out)["parts_merged"] == 2


def test_merge_reports_parts_and_writes_the_totals(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"r{i}", "text": f"Row {i}."} for i in range(9)]
                         + [{"id": "bad", "text": "..."}])
    for index in range(2):
        cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "out", engine="tone", progress="none",
                        shard_index=index, shard_count=2)
        assert run(cfg).status == "complete"
    result = merge(tmp_path / "out")
    assert "count" not in result
    assert (result["parts"], result["parts_found"], result["parts_merged"]) == (2, 2, 2)
    assert (result["items"], result["failed"]) == (9, 1)
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["status"] == "complete" and stats["items"] == 9 and stats["failed"] == 1
    parts_audio = sum(json.loads((p / "stats.json").read_text())["audio_seconds"]
                      for p in (tmp_path / "out").glob("part-*"))
    assert abs(stats["audio_seconds"] - parts_audio) < 0.01
