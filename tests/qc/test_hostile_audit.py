"""Issue 31, holes 2-4 for `cosybatch qc OUT`: it writes qc.parquet through no planted link, scores
only the clips its journal committed (another job's shard padded to the size, a renamed member
and a changed sample are refused), and refuses a root whose parts are not one job's, as merge does."""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import cli, last_json, write_parquet

from cosybatch.config import RunConfig
from cosybatch.errors import DamagedOutputError, UsageError
from cosybatch.qc.audit import audit
from cosybatch.qc.gate import QCSettings
from cosybatch.run.local import run


def rows(n: int, prefix: str = "id") -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": ["Yes.", "Good morning.", "Why not?"][i % 3]} for i in range(n)]


def config(corpus: Path, out: Path, **kw) -> RunConfig:
    return RunConfig.from_options(corpus=corpus, out=out, progress="none",
                     **{"engine": "tone", "batch_size": 1, "shard_max_items": 3, **kw})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A finished 6-row job (2 shards of 3), another job's folder, and a part 0/3 of the first
    corpus beside parts 0/2 and 1/2 of it, made once."""
    base = tmp_path_factory.mktemp("made")
    corpus = write_parquet(base / "c.parquet", rows(6))
    assert run(config(corpus, base / "out")).status == "complete"
    other = write_parquet(base / "o.parquet", [{"id": f"x{i}", "text": "No."} for i in range(3)])
    assert run(config(other, base / "other")).status == "complete"
    for index, count in ((0, 2), (1, 2), (0, 3)):
        assert run(config(corpus, base / "parts", shard_index=index, shard_count=count)).status == "complete"
    return base


@pytest.fixture
def out(made, tmp_path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(made / "out", copy, symlinks=True)
    return copy


def test_qc_writes_its_table_through_no_planted_link(out, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, out / ".qc.parquet.tmp")
    os.symlink(victim, out / "qc.parquet")
    summary = audit(out, QCSettings("gate"), report=False)
    assert summary["clips"] == 6
    assert victim.read_bytes() == b"precious"
    assert (out / "qc.parquet").is_file() and not (out / "qc.parquet").is_symlink()
    assert not os.path.lexists(out / ".qc.parquet.tmp")
    assert pq.read_table(out / "qc.parquet").num_rows == 6


def test_qc_refuses_another_jobs_shard_of_the_same_size(out, made):
    target = out / "shard-000001.tar"
    size = target.stat().st_size
    foreign = (made / "other" / "shard-000000.tar").read_bytes()
    assert len(foreign) <= size
    target.write_bytes(foreign + b"\0" * (size - len(foreign)))
    proc = cli("qc", out, "--no-report")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "shard-000001.tar" in last_json(proc)["error"] and "cosybatch run" in last_json(proc)["error"]
    assert not (out / "qc.parquet").exists()


def test_qc_refuses_a_renamed_member_and_a_changed_sample(out, tmp_path):
    shard = out / "shard-000000.tar"
    original = shard.read_bytes()
    with tarfile.open(shard) as tar:
        wav, meta = tar.getmembers()[:2]
    data = bytearray(original)
    for member, name in ((wav, f"{tmp_path}/X.wav"), (meta, f"{tmp_path}/X.json")):
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = member.size, member.mtime, member.mode
        data[member.offset:member.offset + 512] = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    shard.write_bytes(bytes(data))
    with pytest.raises(DamagedOutputError, match=r"X\.wav"):
        audit(out, QCSettings("gate"), report=False)

    data = bytearray(original)
    data[wav.offset_data + wav.size - 2] ^= 0x01  # one sample: names, ids and sizes unchanged
    shard.write_bytes(bytes(data))
    with pytest.raises(DamagedOutputError, match="wav_sha256"):
        audit(out, QCSettings("gate"), report=False)
    assert not (out / "qc.parquet").exists() and not list(tmp_path.glob("X.*"))


def test_qc_refuses_parts_of_different_worker_counts(made, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(made / "parts", root, symlinks=True)
    proc = cli("qc", root, "--no-report")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "mixes jobs split into different worker counts" in last_json(proc)["error"]
    with pytest.raises(UsageError, match="cannot score"):
        audit(root, QCSettings("gate"), report=False)
    shutil.rmtree(root / "part-00000-of-00003")  # one job's parts: scored whole
    assert audit(root, QCSettings("gate"), report=False)["clips"] == 6
