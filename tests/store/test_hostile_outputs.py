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
import tarfile
from pathlib import Path

import pytest
from helpers import cli, last_json, write_parquet

from cosybatch.config import RunConfig
from cosybatch.errors import DamagedOutputError, UsageError
from cosybatch.run.local import run
from cosybatch.store.checkpoint import write_atomic
from cosybatch.store.exports import export
from cosybatch.store.status import job_status

SHORT = ["Yes.", "Good morning.", "No.", "Why not?", "Fine.", "Hello there.", "Thanks.", "Go on."]


def rows(n: int, prefix: str = "id") -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": SHORT[i % len(SHORT)]} for i in range(n)]


def config(corpus: Path, out: Path, **kw) -> RunConfig:
    """Tone engine in process, batches of one, shards of 3 items."""
    return RunConfig.from_options(corpus=corpus, out=out, progress="none",
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


def rename_members(shard: Path, names: dict[str, str]) -> None:
    """Rewrite member names in place (old -> new), keeping every byte offset and the file's size."""
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tar:
        members = tar.getmembers()
    for member in members:
        if member.name in names:
            info = tarfile.TarInfo(names[member.name])
            info.size, info.mtime, info.mode = member.size, member.mtime, member.mode
            data[member.offset:member.offset + 512] = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    before = shard.stat().st_size
    shard.write_bytes(bytes(data))
    assert shard.stat().st_size == before


def first_key(shard: Path) -> str:
    with tarfile.open(shard) as tar:
        return tar.getmembers()[0].name.partition(".")[0]


# -- hole 1: a tar member name never chooses where a file is written ---------------------------

def test_a_member_renamed_to_an_absolute_path_is_damage_not_a_place_to_write(job, tmp_path):
    _corpus, out, _other = job
    target = tmp_path / "elsewhere"
    target.mkdir()
    assert "." not in str(target)  # readers split the key at the first dot
    shard = out / "shard-000001.tar"
    key = first_key(shard)
    rename_members(shard, {f"{key}.wav": f"{target}/X.wav", f"{key}.json": f"{target}/X.json"})

    status = job_status(out)  # the size is right: only the members' names tell
    assert status["status"] == "damaged"
    assert any("shard-000001.tar" in p and "X.wav" in p for p in status["problems"]), status

    proc = cli("export", out, "--to", "nemo,lhotse", "--copy")
    assert proc.returncode == 3, proc.stderr
    error = last_json(proc)["error"]
    assert "shard-000001.tar" in error and "X.wav" in error and "cosybatch run" in error
    assert not (target / "X.wav").exists() and not list(target.iterdir())
    for fmt in ("hf", "nemo", "lhotse"):
        with pytest.raises(DamagedOutputError, match=r"shard-000001\.tar"):
            export(out, fmt)
    assert not list(target.iterdir())


def test_copied_wavs_are_named_by_the_journal(job):
    _corpus, out, _other = job
    export(out, "nemo", copy=True)
    from cosybatch.store.checkpoint import OutputDir

    keys = {item["key"] for item in OutputDir(out).live_items()}
    assert {p.stem for p in (out / "exports" / "wavs").iterdir()} == keys
    entries = [json.loads(line) for line in (out / "exports/nemo/manifest.jsonl").read_text().splitlines()]
    assert all(not os.path.isabs(e["audio_filepath"]) and ".." in e["audio_filepath"] for e in entries)


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


def test_an_export_writes_through_no_planted_link(job, tmp_path):
    _corpus, out, _other = job
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "exports")
    with pytest.raises(UsageError, match="exports is a symbolic link"):
        export(out, "hf")
    proc = cli("export", out, "--to", "lhotse", "--copy")
    assert proc.returncode == 2 and "symbolic link" in last_json(proc)["error"]
    assert not list(elsewhere.iterdir())

    (out / "exports").unlink()
    export(out, "nemo", copy=True)
    wav = next((out / "exports" / "wavs").iterdir())
    victim = tmp_path / "victim.wav"
    victim.write_bytes(wav.read_bytes())  # a link to a file of the very same bytes and size
    wav.unlink()
    os.symlink(victim, wav)
    os.symlink(elsewhere, out / "exports" / ".lhotse.tmp-1")  # as if left by a killed export
    victim.write_bytes(b"x" * victim.stat().st_size)
    export(out, "lhotse", copy=True)
    assert victim.read_bytes() == b"x" * victim.stat().st_size
    assert wav.is_file() and not wav.is_symlink()
    assert not list(elsewhere.iterdir()) and elsewhere.is_dir()


# -- hole 3: another job's shard of the same size ----------------------------------------------

def pad_in_foreign_shard(out: Path, other: Path, name: str = "shard-000001.tar") -> None:
    target = out / name
    size = target.stat().st_size
    foreign = next(p for p in sorted(other.glob("shard-*.tar")) if p.stat().st_size <= size)
    target.write_bytes(foreign.read_bytes() + b"\0" * (size - foreign.stat().st_size))
    assert target.stat().st_size == size


def test_another_jobs_shard_padded_to_the_size_is_refused(job):
    _corpus, out, other = job
    pad_in_foreign_shard(out, other)
    status = job_status(out)
    assert status["status"] == "damaged" and any("shard-000001.tar" in p for p in status["problems"])
    proc = cli("export", out, "--to", "hf,lhotse,nemo")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "shard-000001.tar" in last_json(proc)["error"]
    assert not (out / "exports" / "hf").exists()
    for fmt in ("hf", "nemo", "lhotse"):
        with pytest.raises(DamagedOutputError, match="journal"):
            export(out, fmt, copy=fmt == "lhotse")


def test_a_changed_sample_is_refused_by_export(job):
    """The per-clip checksum: a flipped PCM byte keeps every name, id and size."""
    _corpus, out, _other = job
    shard = out / "shard-000002.tar"
    with tarfile.open(shard) as tar:
        wav = next(m for m in tar.getmembers() if m.name.endswith(".wav"))
    data = bytearray(shard.read_bytes())
    data[wav.offset_data + wav.size - 2] ^= 0x01
    shard.write_bytes(bytes(data))
    for fmt, copy in (("hf", False), ("nemo", False), ("lhotse", True)):
        with pytest.raises(DamagedOutputError, match="wav_sha256"):
            export(out, fmt, copy=copy)


# -- hole 4: one job across parts --------------------------------------------------------------

@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Part folders made once: 0/2 and 1/2 of a corpus, 0/3 of it, and 1/2 of another corpus."""
    base = tmp_path_factory.mktemp("parts")
    corpus = write_parquet(base / "c.parquet", rows(10))
    other = write_parquet(base / "d.parquet", rows(10, prefix="other"))
    made = {}
    for name, source, index, count in (("a", corpus, 0, 2), ("a", corpus, 1, 2), ("b", corpus, 0, 3),
                                       ("c", other, 1, 2)):
        cfg = config(source, base / name, shard_index=index, shard_count=count, shard_max_items=4)
        assert run(cfg).status == "complete"
        made[(name, index, count)] = base / name / f"part-{index:05d}-of-{count:05d}"
    return made


def root_of(parts, tmp_path: Path, *which) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    for key in which:
        shutil.copytree(parts[key], root / parts[key].name, symlinks=True)
    return root


def test_parts_of_different_worker_counts_are_refused_as_merge_refuses(parts, tmp_path):
    root = root_of(parts, tmp_path, ("a", 0, 2), ("a", 1, 2), ("b", 0, 3))
    merged = cli("merge", root)
    assert merged.returncode == 2
    for command in (("export", root, "--to", "hf"), ("status", root)):
        proc = cli(*command)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        error = last_json(proc)["error"]
        assert "mixes jobs split into different worker counts" in error and "part-00000-of-00003" in error
    assert not (root / "exports").exists()
    with pytest.raises(UsageError, match="cannot export"):
        export(root, "lhotse")


def test_parts_of_two_corpora_are_refused_as_merge_refuses(parts, tmp_path):
    root = root_of(parts, tmp_path, ("a", 0, 2), ("c", 1, 2))
    assert cli("merge", root).returncode == 2
    for fmt in ("hf", "nemo", "lhotse"):
        with pytest.raises(UsageError, match=r"not the workers of one job.*corpus"):
            export(root, fmt)
    with pytest.raises(UsageError, match="cannot show the status of"):
        job_status(root)
    assert not (root / "exports" / "hf").exists()


def test_one_jobs_parts_still_export(parts, tmp_path):
    root = root_of(parts, tmp_path, ("a", 0, 2), ("a", 1, 2))
    path = export(root, "hf")
    assert len(list((path / "data").glob("*.parquet"))) == len(list(root.glob("part-*/shard-*.tar")))
    assert job_status(root)["done"] == 10
