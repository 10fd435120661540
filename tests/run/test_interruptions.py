"""What production does to a long unattended run: kill -9 at any moment, preemption signals,
time-boxed slots and a full disk. Each ends resumable; the rerun finishes every id once."""

from __future__ import annotations

import errno
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    assert_complete,
    committed_items,
    corpus_rows,
    numbered_rows,
    read_output,
    start_run,
    wait_for_items,
    write_parquet,
)

from cosybatch.config import RunConfig
from cosybatch.errors import OutputError, UsageError
from cosybatch.run.local import run
from cosybatch.store.shards import ShardWriter


@pytest.mark.slow
def test_kill_9_at_random_moments(tmp_path):
    rows = corpus_rows(24)  # 4 kills after 1-4 commits each: at most 16 rows
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    rng = random.Random(1234)
    done_per_run = []
    for _ in range(4):
        before = committed_items(out) if out.exists() else 0
        proc = start_run(corpus, out)
        # Wait for this run's commits (a busy machine may take seconds to load the model), then
        # kill at a random moment of the batches that follow: mid-inference, mid-write, mid-commit.
        wait_for_items(out, proc, min(before + rng.randint(1, 4), len(rows)))
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done_per_run.append(committed_items(out) - before)
    result = run(RunConfig.from_options(corpus=corpus, out=out, shard_max_items=4, progress="none"))
    assert result.status == "complete"
    assert_complete(out, rows)
    # Committed work is never redone: the runs' commits add up to the corpus exactly.
    assert sum(done_per_run) + result.stats["items_done"] == len(rows)
    assert sum(done_per_run) > 0


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_end_cleanly_with_exit_4(tmp_path, sig):
    rows = corpus_rows(12)  # after 2 commits, when the signal comes, seconds of work are left
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    proc = start_run(corpus, out)
    wait_for_items(out, proc, 2)
    t0 = time.monotonic()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 10  # the batch in flight is finished and committed, no more
    assert proc.returncode == 4, stderr
    assert "Traceback" not in stderr and "rerun the same command to resume" in stderr
    assert json.loads(stdout.splitlines()[-1])["status"] == "interrupted"
    run(RunConfig.from_options(corpus=corpus, out=out, shard_max_items=4, progress="none"))
    assert_complete(out, rows)


@pytest.mark.slow
@pytest.mark.parametrize("module", ["typer", "onnxruntime"])
def test_sigterm_during_start_up_exits_4(tmp_path, module):
    """SIGTERM while the command is still importing its modules (typer: the CLI; onnxruntime:
    the engine, while a run holds the output folder) ends with the documented exit 4."""
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(5))
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "cosybatch", "run", str(corpus), "--out",
                             str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # -X importtime reports each module as its import finishes
        seen.append(line)
        if line.split("|")[-1].strip() == module:
            break
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 4, "".join(seen[-5:]) + stderr
    assert "Traceback" not in stderr
    assert json.loads(stdout.splitlines()[-1])["status"] in {"typer": {"error"}, "onnxruntime": {"interrupted"}}[module]


@pytest.mark.slow
def test_max_runtime_ends_resumable(tmp_path):
    # 400 rows, even of four words, take many times 3 s: the limit always stops the run, whether it
    # stops during the model load (a busy machine) or after some commits (64 of these rows take
    # about 10 s here). Four-word rows, not the example sentences (five times longer), keep the
    # resume over the first window cheap.
    rows = numbered_rows(400)
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out),
                           "--max-runtime", "3s"], capture_output=True, text=True, timeout=300)
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 4, proc.stderr
    assert "interrupted by --max-runtime" in proc.stderr
    assert committed_items(out) < len(rows)
    # The first window is 64 rows: resuming over those finishes whatever the stopped run began.
    run(RunConfig.from_options(corpus=corpus, out=out, progress="none", limit=64))
    assert_complete(out, rows[:64])


def test_disk_full_fault_keeps_committed_work_and_resumes(tmp_path, monkeypatch, tone):
    rows = corpus_rows(12)
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    real_add = ShardWriter.add
    calls = {"n": 0}

    def add_then_fail(self, key, members, mtime):
        calls["n"] += 1
        if calls["n"] == 6:
            # Half an item reaches the disk, then the disk is full.
            self._file.write(b"\\0" * 700)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_add(self, key, members, mtime)

    monkeypatch.setattr(ShardWriter, "add", add_then_fail)
    with pytest.raises(OutputError, match=r"No space left on device.*rerun the same command to resume"):
        run(tone(corpus, out, shard_max_items=4, batch_size=1))  # a batch commits whole: batches of one
    assert committed_items(out) == 5
    monkeypatch.setattr(ShardWriter, "add", real_add)
    result = run(tone(corpus, out, shard_max_items=4, batch_size=1))
    assert result.stats["items_done"] == 7
    assert_complete(out, rows)


def _can_mount_tmpfs(path: Path) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_real_full_disk_then_more_space(tmp_path):
    mnt = tmp_path / "small"
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs here (needs root); the fault-injection test covers this path")
    try:
        rows = corpus_rows(15)  # ~3 MB of audio into a 1.5 MB disk
        corpus = write_parquet(tmp_path / "c.parquet", rows)
        out = mnt / "out"
        proc = subprocess.run([sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out),
                               "--shard-max-items", "4"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 4, proc.stderr
        assert "No space left on device" in proc.stderr and "Traceback" not in proc.stderr
        assert 0 < committed_items(out) < len(rows)
        read_output(out)  # what was committed and closed is whole
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        result = run(RunConfig.from_options(corpus=corpus, out=out, shard_max_items=4, progress="none"))
        assert result.status == "complete"
        assert_complete(out, rows)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


@pytest.mark.slow
def test_a_disk_full_at_start_is_resumable_too(tmp_path):
    mnt = tmp_path / "small"
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs here (needs root); the injected fault below covers this path")
    try:
        corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(2))
        out = mnt / "out"
        run(RunConfig.from_options(corpus=corpus, out=out, progress="none", limit=1))
        filler = mnt / "filler"
        # Fill the disk to the last byte. Unbuffered: a buffered writer would keep the block the
        # disk refused and raise again when it is closed.
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        proc = subprocess.run([sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 4, proc.stderr
        assert "No space left on device" in proc.stderr and "Traceback" not in proc.stderr
        filler.unlink()
        assert run(RunConfig.from_options(corpus=corpus, out=out, progress="none")).status == "complete"
        assert_complete(out, corpus_rows(2))
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_an_injected_disk_full_at_lock_time_is_resumable(tmp_path, monkeypatch, tone):
    from cosybatch.store.checkpoint import OutputDir

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(OutputDir, "lock", full)
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(1))
    with pytest.raises(OutputError, match=r"No space left on device.*rerun the same command to resume"):
        run(tone(corpus, tmp_path / "out"))


def test_unwritable_output_is_a_usage_error(tmp_path, tone):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(1))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="choose a writable --out"):
        run(tone(corpus, blocker / "out"))
