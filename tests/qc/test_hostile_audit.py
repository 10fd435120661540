"""Issue 31, holes 2-4 for `cosybatch qc OUT`: it writes qc.parquet through no planted link, scores
only the clips its journal committed (another job's shard padded to the size, a renamed member
and a changed sample are refused), and refuses a root whose parts are not one job's, as merge does."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import write_parquet

from cosybatch.config import RunConfig
from cosybatch.qc.audit import audit
from cosybatch.qc.gate import QCSettings
from cosybatch.run.local import run


def rows(n: int, prefix: str = "id") -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": ["Yes.", "Good morning.", "Why not?"][i % 3]} for i in range(n)]


def config(corpus: Path, out: Path, **kw) -> RunConfig:
    return RunConfig(corpus=corpus, out=out, progress="none",
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
