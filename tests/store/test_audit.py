"""`cosybatch qc OUT`: a folder made without the gate scored afterwards, the shards untouched, a
sharded job's root scored whole, and the same signals the run would have recorded."""

from __future__ import annotations

import hashlib
import json

import pyarrow.parquet as pq
from helpers import cli, corpus_rows, last_json, read_output, write_parquet

from cosybatch.config import RunConfig
from cosybatch.qc.asr import Transcriber, default_model_dir
from cosybatch.qc.audit import SIGNAL_COLUMNS, audit
from cosybatch.qc.gate import QCSettings
from cosybatch.run.local import run


def digests(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("shard-*.tar"))}


def test_an_old_folder_is_scored_without_touching_its_shards(tmp_path):
    rows = corpus_rows(6)
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    measured, plain = tmp_path / "measured", tmp_path / "plain"
    run(RunConfig.from_options(corpus=corpus, out=measured, progress="none"))
    run(RunConfig.from_options(corpus=corpus, out=plain, progress="none", qc="off"))  # as a folder from before the gate
    assert "qc" not in next(iter(read_output(plain).values()))["meta"]
    before = digests(plain)
    assert not (plain / "report.html").exists()  # --qc off writes no page
    summary = audit(plain, QCSettings(mode="asr", asr_rows="all"), Transcriber(default_model_dir()))
    assert digests(plain) == before
    page = (plain / "report.html").read_text()
    assert page.count("<circle") == 6 and page.count("<audio") == 6
    table = pq.read_table(plain / "qc.parquet").to_pylist()
    assert sorted(r["id"] for r in table) == sorted(r["id"] for r in rows)
    assert summary["clips"] == 6 and summary["transcribed"] == 6
    recorded = {i: item["meta"]["qc"]["signals"] for i, item in read_output(measured).items()}
    for r in table:
        assert r["qc_support"] is not None and json.loads(r["words"])  # every clip heard, its words placed
        assert r["qc_pass"] == (r["qc_support"] >= 3.0 and not r["qc_flags"] and r["reason"] is None)
        # The same clip, read back from its 16-bit WAV: the very samples the run judged, so the same signals.
        for name in ("lead_s", "tail_s", "gap_s", "speech_s", "peak_db", "rms_db", "flatness"):
            assert r[name] == recorded[r["id"]][name]
        assert set(SIGNAL_COLUMNS) <= set(r)


def test_the_audit_gives_the_verdicts_the_run_gave(tmp_path):
    """`cosybatch qc --asr` on a folder made with `--qc asr` judges each clip as the run did."""
    rows = corpus_rows(6)
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    run(RunConfig.from_options(corpus=corpus, out=out, progress="none", qc="asr"))
    made = {i: item["meta"]["qc"] for i, item in read_output(out).items()}
    proc = cli("qc", out, "--asr", "--json", "--no-report")
    assert proc.returncode == 0, proc.stderr
    for r in pq.read_table(out / "qc.parquet").to_pylist():
        qc = made[r["id"]]
        assert (r["qc_pass"], r["qc_support"], r["qc_flags"]) == \
            (qc["pass"], qc["asr"]["support"], ",".join(qc["flags"]))
        assert r["pace"] == qc["signals"]["pace"]  # the run's expectation, recorded, is the audit's too


def test_a_sharded_jobs_root_is_scored_whole_from_the_command_line(tmp_path):
    rows = corpus_rows(6)
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    root = tmp_path / "root"
    for i in range(2):
        run(RunConfig.from_options(corpus=corpus, out=root, shard_index=i, shard_count=2, progress="none"))
    proc = cli("qc", root, "--json", "--no-report")
    assert proc.returncode == 0, proc.stderr
    assert last_json(proc)["clips"] == 6
    table = pq.read_table(root / "qc.parquet").to_pylist()
    assert sorted(r["id"] for r in table) == sorted(r["id"] for r in rows)
    assert {r["shard"].split("/")[0] for r in table} == {"part-00000-of-00002", "part-00001-of-00002"}
    assert not (root / "report.html").exists()
