"""Checkpoint and resume: a killed run loses at most the batch in flight, a rerun finishes with
every id exactly once, and a rerun with other settings is refused."""

from __future__ import annotations

import json
import os
import signal

import pytest
from helpers import (
    assert_exactly_once,
    committed_items,
    corpus_rows,
    read_output,
    start_run,
    wait_for_items,
    write_parquet,
)

from cosybatch.config import RunConfig
from cosybatch.errors import ResumeMismatchError
from cosybatch.run.local import run


@pytest.mark.slow
def test_kill_9_then_rerun_completes_exactly_once(tmp_path):
    """A FLAC job at 16 kHz (the kill -9 tests of test_interruptions.py run WAV jobs): the partial
    shard's FLAC members are cut back and kept as WAV members are."""
    rows = corpus_rows(16)  # after 9 commits, when the kill comes, seconds of work are left
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    proc = start_run(corpus, out, "--audio-format", "flac", "--sample-rate", "16000")
    wait_for_items(out, proc, 9)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = committed_items(out)
    assert before < len(rows)
    assert list(out.glob("shard-*.tar.partial")) or list(out.glob("shard-*.tar"))

    result = run(RunConfig.from_options(corpus=corpus, out=out, shard_max_items=4, audio_format="flac",
                                        sample_rate=16000, progress="none"))
    assert result.status == "complete"
    # Committed work was not redone: this run did only what the killed one had not committed.
    assert result.stats["items_done"] == len(rows) - before
    items = assert_exactly_once(out, [r["id"] for r in rows])
    assert not list(out.glob("*.partial"))
    for item in items.values():
        assert item["meta"]["format"] == "flac" and item["sample_rate"] == 16000
        assert len(item["audio"]) == item["meta"]["num_samples"] > 0


def test_rerun_of_a_finished_job_does_nothing(tmp_path, tone):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(3))
    out = tmp_path / "out"
    run(tone(corpus, out))
    again = run(tone(corpus, out))
    assert again.stats["items_done"] == 0
    assert again.stats["job_totals"]["items_done"] == 3
    assert len(read_output(out)) == 3


def test_rerun_with_other_settings_is_refused_unless_restart(tmp_path, tone):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(2))
    out = tmp_path / "out"
    run(tone(corpus, out))
    with pytest.raises(ResumeMismatchError, match=r"base_hz was 220.0, now 300.0"):
        run(tone(corpus, out, engine_options={"base_hz": 300.0}))
    other = write_parquet(tmp_path / "other.parquet", corpus_rows(3))
    with pytest.raises(ResumeMismatchError, match=r"corpus\.name was 'c.parquet', now 'other.parquet'"):
        run(tone(other, out))
    # Settings that do not change the audio may change between runs.
    run(tone(corpus, out, workers=1, window=5))
    result = run(tone(other, out, restart=True))
    assert result.stats["items_done"] == 3
    assert len(read_output(out)) == 3


@pytest.mark.slow
def test_second_writer_is_refused(tmp_path):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(30))
    out = tmp_path / "out"
    proc = start_run(corpus, out)
    try:
        wait_for_items(out, proc, 1)
        from cosybatch.errors import UsageError

        with pytest.raises(UsageError, match="in use by another cosybatch run"):
            run(RunConfig.from_options(corpus=corpus, out=out, progress="none"))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The killed run's lock is gone with its process: the next run takes the folder over.
    result = run(RunConfig.from_options(corpus=corpus, out=out, progress="none", limit=2))
    assert result.status == "complete"
    os.sync()


def test_duplicate_failure_never_hides_the_first_row(tmp_path, tone):
    """The duplicate's failure can be committed before the first row's audio; a resume must still
    synthesise the first row (failures of duplicates are keyed by row number, not id)."""
    from cosybatch.store.checkpoint import DUPLICATE_ID, OutputDir

    rows = [{"id": "x", "text": "First."}, {"id": "y", "text": "Second."}, {"id": "x", "text": "Again."}]
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    # A run stopped by its failure limit right after committing the duplicate's failure.
    run(tone(corpus, out, max_failures="0"))
    state = OutputDir(out).resume_state()
    assert 2 in state.failed_rows and ("x" not in state.done_ids or "x" in read_output(out))
    result = run(tone(corpus, out))
    assert result.status == "complete"
    items = read_output(out)
    assert set(items) == {"x", "y"} and items["x"]["meta"]["text"] == "First."
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert [(f["id"], f["row"], f["reason"]) for f in failures] == [("x", 2, DUPLICATE_ID)]


def test_a_device_change_is_refused_with_what_differs(tmp_path, tone):
    """CPU and CUDA audio differ in the last bits: a job started on one device is not resumed on
    the other. (No GPU here: the record of a job started on CUDA is written as CUDA would.)"""
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(2))
    out = tmp_path / "out"
    run(tone(corpus, out, limit=1))
    job_file = out / ".cosybatch" / "job.json"
    record = json.loads(job_file.read_text())
    assert record["fingerprint"]["engine"]["device"] == "cpu"
    record["fingerprint"]["engine"]["device"] = "cuda"
    job_file.write_text(json.dumps(record))
    with pytest.raises(ResumeMismatchError, match=r"engine\.device was 'cuda', now 'cpu'"):
        run(tone(corpus, out))
