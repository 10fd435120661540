"""Issue 31, holes 1-4: nothing found in an output folder makes `export`, `status` or the files a
run writes reach outside the folder or present clips that are not the job's.

- keys come from the journal, never from tar member names (a member renamed in place to an
  absolute path is a damaged shard, never a place to write);
- every file is written as a new regular file inside OUT (a link planted at `.NAME.tmp`, at the
  final name, at OUT/exports or at a copied WAV is replaced or refused, never written through);
- another job's shard padded to the size of one of ours is refused, as `run` quarantines it;
- a root whose parts are not one job's is refused by export and status as merge refuses it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import write_parquet

from cosybatch.config import RunConfig
from cosybatch.run.local import run
from cosybatch.store.checkpoint import write_atomic

SHORT = ["Yes.", "Good morning.", "No.", "Why not?", "Fine.", "Hello there.", "Thanks.", "Go on."]


def rows(n: int, prefix: str = "id") -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": SHORT[i % len(SHORT)]} for i in range(n)]


def config(corpus: Path, out: Path, **kw) -> RunConfig:
    """Tone engine in process, batches of one, shards of 3 items."""
    return RunConfig(corpus=corpus, out=out, progress="none",
                     **{"engine": "tone", "batch_size": 1, "shard_max_items": 3, **kw})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One finished 12-row job (4 shards of 3) and another job's finished folder, made once."""
    base = tmp_path_factory.mktemp("made")
    corpus = write_parquet(base / "c.parquet", rows(12))
    assert run(config(corpus, base / "out")).status == "complete"
    other = write_parquet(base / "other.parquet", [{"id": f"x{i}", "text": "No."} for i in range(6)])
    assert run(config(other, base / "other")).status == "complete"
    return corpus, base / "out", base / "other"


@pytest.fixture
def job(made, tmp_path):
    """(corpus, a copy of the finished job's folder, the other job's folder)."""
    corpus, out, other = made
    copy = tmp_path / "out"
    shutil.copytree(out, copy, symlinks=True)
    return corpus, copy, other


# -- hole 2: no write through a planted link ---------------------------------------------------

def test_write_atomic_replaces_a_link_at_its_temporary_and_final_names(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    folder = tmp_path / "out"
    folder.mkdir()
    os.symlink(victim, folder / ".stats.json.tmp")
    write_atomic(folder / "stats.json", b"{}")
    assert victim.read_bytes() == b"precious"
    assert not (folder / "stats.json").is_symlink() and (folder / "stats.json").read_bytes() == b"{}"
    assert not os.path.lexists(folder / ".stats.json.tmp")

    os.symlink(victim, folder / "README.md")  # a link at the final name is replaced, not written through
    write_atomic(folder / "README.md", b"card")
    assert victim.read_bytes() == b"precious"
    assert not (folder / "README.md").is_symlink() and (folder / "README.md").read_bytes() == b"card"


def test_a_rerun_writes_through_no_link_planted_in_its_folder(job, tmp_path):
    corpus, out, _other = job
    victims = {}
    for name in ("stats.json", "README.md", "manifest.parquet", "failures.jsonl"):
        victim = tmp_path / f"victim-{name}"
        victim.write_bytes(b"precious " + name.encode())
        os.symlink(victim, out / f".{name}.tmp")
        victims[name] = victim
    (out / "failures.jsonl").write_text("")  # written again only when it exists
    result = run(config(corpus, out))
    assert result.status == "complete"
    for name, victim in victims.items():
        assert victim.read_bytes() == b"precious " + name.encode(), name
        final = out / name
        assert final.is_file() and not final.is_symlink(), name
        assert not os.path.lexists(out / f".{name}.tmp"), name
    assert json.loads((out / "stats.json").read_text())["status"] == "complete"
    assert "cosybatch" in (out / "README.md").read_text()
