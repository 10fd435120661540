"""Issue 23, cases 3, 4, 9, 10: merge and export check what they read (job settings, corpus,
worker count, locks, shard sizes) and never leave half a dataset; status reads a damaged
run.json; verify through a closed pipe keeps its code; the cache clears dead builders' files."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, write_jsonl

from cosybatch.cache import cached_file
from cosybatch.errors import DamagedOutputError, UsageError
from cosybatch.run.local import run
from cosybatch.store.distributed import merge
from cosybatch.store.exports import export
from cosybatch.store.status import describe, job_status


def rows(n: int, prefix: str = "r") -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": f"Row {i} says something."} for i in range(n)]


def finished(tone, tmp_path, n: int = 8, **settings):
    corpus = write_jsonl(tmp_path / "c.jsonl", rows(n))
    out = tmp_path / "out"
    assert run(tone(corpus, out, shard_max_items=2, **settings)).status == "complete"
    return corpus, out


# -- 9. status on a run.json with wrong types ------------------------------------------------------
@pytest.mark.parametrize("run_json", ['{"started": "yesterday", "total_rows": "ten"}', '[1, 2]',
                                      '{"total_rows": 5, "total_is_estimate": "yes"}'])
def test_status_reads_the_journal_when_run_json_has_wrong_types(tone, tmp_path, run_json):
    _, out = finished(tone, tmp_path)
    (out / ".cosybatch" / "run.json").write_text(run_json)
    status = job_status(out)
    assert (status["status"], status["done"]) == ("complete", 8)
    assert any("run.json is unreadable" in w for w in status["warnings"])
    assert "run.json is unreadable" in describe(status)


# -- 3. merge compares the parts and checks each one ------------------------------------------------
def sharded(tone, tmp_path, n: int = 12, per_part: dict | None = None):
    """A 2-part job; per_part[i] overrides part i's settings (another corpus, another seed)."""
    corpus = write_jsonl(tmp_path / "c.jsonl", rows(n))
    out = tmp_path / "out"
    for index in range(2):
        settings = {"corpus": corpus, **(per_part or {}).get(index, {})}
        cfg = tone(settings.pop("corpus"), out, shard_index=index, shard_count=2, shard_max_items=2, **settings)
        assert run(cfg).status == "complete"
    return corpus, out


def test_merge_refuses_a_part_made_from_another_corpus(tone, tmp_path):
    other = write_jsonl(tmp_path / "other.jsonl", rows(12, prefix="x"))
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


# -- 4. export checks the folder first and never leaves half an export -----------------------------
@pytest.mark.parametrize("fmt", ["hf", "nemo", "lhotse"])
def test_export_refuses_a_folder_that_lost_a_shard(tone, tmp_path, fmt):
    _, out = finished(tone, tmp_path)
    (out / "shard-000001.tar").unlink()
    with pytest.raises(DamagedOutputError, match=r"shard-000001.tar is missing.*Rerun the job's `cosybatch run`"):
        export(out, fmt)
    assert not (out / "exports" / fmt).exists()
    assert DamagedOutputError.exit_code == 3


@pytest.mark.parametrize("fmt", ["hf", "nemo", "lhotse"])
def test_an_unreadable_shard_leaves_the_earlier_export_whole(tone, tmp_path, fmt):
    _, out = finished(tone, tmp_path)
    export(out, fmt)
    before = export_files(out / "exports" / fmt)
    shard = out / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[:512] = b"\xff" * 512  # the same size, so only reading it finds the damage
    shard.write_bytes(bytes(data))
    with pytest.raises(DamagedOutputError, match=r"shard-000001.tar is unreadable"):
        export(out, fmt)
    after = export_files(out / "exports" / fmt)
    assert after == before
    assert [p.name for p in (out / "exports").iterdir() if p.name.startswith(".")] == []


def export_files(folder: Path) -> dict:
    """Each file of an export, and where each of its links points (NeMo's audio_N.tar link to the shards)."""
    return {p.relative_to(folder): os.readlink(p) if p.is_symlink() else p.read_bytes()
            for p in folder.rglob("*") if p.is_symlink() or p.is_file()}


def test_an_unreadable_shard_leaves_no_export(tone, tmp_path):
    _, out = finished(tone, tmp_path)
    shard = out / "shard-000001.tar"
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    with pytest.raises(DamagedOutputError):
        export(out, "hf")
    assert not (out / "exports" / "hf").exists()


# -- 10. verify through a closed pipe; the cache's temporaries of dead builders --------------------
@pytest.mark.slow
def test_verify_into_a_closed_pipe_exits_with_its_own_code(tone, tmp_path):
    _, out = finished(tone, tmp_path)
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    (damaged / "shard-000001.tar").write_bytes(b"\0" * (damaged / "shard-000001.tar").stat().st_size)
    for folder, code in ((out, 0), (damaged, 3)):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before a byte is written, as `| head` may be
        try:
            proc = subprocess.run([sys.executable, "-m", "cosybatch", "verify", str(folder)], stdout=write,
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
        finally:
            os.close(write)
        assert proc.returncode == code, proc.stderr
        assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_a_cache_build_removes_temporaries_of_builders_that_died(tmp_path):
    stale = tmp_path / ".k123-abc_x9yz.tmp"
    stale.write_bytes(b"half an ONNX file")  # as a builder killed with -9 leaves it
    others = [tmp_path / ".k123-other-abc_x9yz.tmp", tmp_path / ".k1234-abcdefgh.tmp"]  # other keys' files
    for path in others:
        path.write_bytes(b"not ours")
    path = cached_file(tmp_path, "k123", lambda tmp: tmp.write_bytes(b"built"))
    assert path.read_bytes() == b"built" and not stale.exists()
    assert all(p.exists() for p in others)
    stale.write_bytes(b"again")
    assert cached_file(tmp_path, "k123", lambda tmp: pytest.fail("rebuilt")) == path  # found: still cleaned
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".k123-")) == [others[0].name]
