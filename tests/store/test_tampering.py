"""Exactly once against tampering (issue 23): a repair reads the members it keeps and keeps only
the journal's, adopts a foreign shard's items only when they are this job's, and every clip's
audio carries a checksum that `verify` (and a repair that re-reads a member) compares."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import assert_exactly_once, journal, read_output, write_parquet

from cosybatch.config import RunConfig
from cosybatch.run import line
from cosybatch.run.local import run
from cosybatch.store.verify import describe
from cosybatch.store.verify import verify as verify_output

SHORT = ["Yes.", "Good morning.", "No.", "Why not?", "Fine.", "Hello there.", "Thanks.", "Go on."]


def rows(n: int, prefix: str = "id") -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": SHORT[i % len(SHORT)]} for i in range(n)]


def config(corpus: Path, out: Path, **kw) -> RunConfig:
    """Tone engine in process, batches of one, shards of 3 items."""
    return RunConfig.from_options(corpus=corpus, out=out, progress="none",
                     **{"engine": "tone", "batch_size": 1, "shard_max_items": 3, **kw})


@pytest.fixture
def finished(tmp_path):
    """A finished 12-row job: 4 shards of 3 items."""
    data = rows(12)
    corpus = write_parquet(tmp_path / "c.parquet", data)
    out = tmp_path / "out"
    assert run(config(corpus, out)).status == "complete"
    return corpus, out, [r["id"] for r in data]


# -- case 1: a finished shard replaced by other bytes -----------------------------------------

def test_a_shard_copied_over_another_is_made_again(finished):
    corpus, out, ids = finished
    shutil.copyfile(out / "shard-000002.tar", out / "shard-000001.tar")
    result = run(config(corpus, out))
    assert result.status == "complete" and result.exit_code == 0
    assert result.stats["items_done"] == 3  # shard 1's ids, made again; shard 2's bytes were not kept twice
    assert any("not this shard's bytes" in r for r in result.stats["repairs"]), result.stats["repairs"]
    assert_exactly_once(out, ids)


def test_two_swapped_shards_are_both_made_again(finished):
    corpus, out, ids = finished
    a, b, tmp = out / "shard-000000.tar", out / "shard-000003.tar", out / "swap"
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)
    result = run(config(corpus, out))
    assert result.status == "complete" and result.stats["items_done"] == 6
    assert_exactly_once(out, ids)


def test_same_size_foreign_bytes_are_caught_by_their_headers(finished):
    """A shard of exactly the journal's length whose members are someone else's: the size check
    alone would keep it."""
    corpus, out, ids = finished
    shard = out / "shard-000000.tar"
    with tarfile.open(shard) as tar:
        first = tar.getmembers()[0]
    data = bytearray(shard.read_bytes())
    info = tarfile.TarInfo("xx" + first.name[2:])  # another key, same length
    info.size, info.mtime, info.mode = first.size, first.mtime, first.mode
    data[0:512] = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    shard.write_bytes(bytes(data))
    result = run(config(corpus, out))
    assert result.status == "complete" and result.stats["items_done"] == 3
    assert_exactly_once(out, ids)


def test_an_open_shard_replaced_by_other_bytes_is_made_again(finished):
    """The open .partial's committed bytes are checked the same way before the run appends to it."""
    corpus, out, ids = finished
    path = out / ".cosybatch" / "journal.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    assert json.loads(lines[-1]) == {"t": "closed", "shard": 3, "items": 3}
    path.write_bytes(b"".join(lines[:-1]))  # shard 3 is open again, as a killed run leaves it
    partial = out / "shard-000003.tar.partial"
    os.replace(out / "shard-000003.tar", partial)
    foreign = (out / "shard-000000.tar").read_bytes()
    partial.write_bytes(foreign + b"\0" * max(0, partial.stat().st_size - len(foreign)))
    result = run(config(corpus, out))
    assert result.status == "complete" and result.stats["items_done"] == 3
    assert any("not this shard's bytes" in r for r in result.stats["repairs"]), result.stats["repairs"]
    assert_exactly_once(out, ids)


# -- case 2: a foreign shard dropped in -------------------------------------------------------

def test_another_jobs_shard_is_quarantined(finished, tmp_path, caplog):
    corpus, out, ids = finished
    other_corpus = write_parquet(tmp_path / "other.parquet", rows(3, prefix="other"))
    other = tmp_path / "other"
    assert run(config(other_corpus, other)).status == "complete"
    shutil.copyfile(other / "shard-000000.tar", out / "shard-000009.tar")
    result = run(config(corpus, out))
    assert result.status == "complete" and result.exit_code == 0
    assert result.stats["job_totals"]["items_done"] == 12
    [q] = result.stats["quarantined"]
    assert q["shard"] == "shard-000009.tar" and "not in this corpus" in q["reason"]
    assert (out / q["file"]).exists() and not (out / "shard-000009.tar").exists()
    assert f"moved aside {q['file']}: " in caplog.text  # said on stderr
    stats = json.loads((out / "stats.json").read_text())
    assert stats["quarantined"] == result.stats["quarantined"]
    assert_exactly_once(out, ids)


def _lose_last_shard_and_drop_in(finished, tmp_path, **other_settings):
    """Delete the job's last shard (ids 9-11 are lost) and drop in, unlisted, the last shard of a
    job on the same corpus made with `other_settings`."""
    corpus, out, _ids = finished
    other = tmp_path / "other"
    assert run(config(corpus, other, **other_settings)).status == "complete"
    (out / "shard-000003.tar").unlink()
    shutil.copyfile(other / "shard-000003.tar", out / "shard-000009.tar")
    return run(config(corpus, out))


def test_a_dropped_in_shard_of_this_job_is_adopted(finished, tmp_path):
    _corpus, out, ids = finished
    result = _lose_last_shard_and_drop_in(finished, tmp_path)
    assert result.status == "complete" and result.stats["items_done"] == 0  # nothing made again
    assert "quarantined" not in result.stats
    assert_exactly_once(out, ids)


def test_a_dropped_in_shard_made_with_other_settings_is_quarantined(finished, tmp_path):
    _corpus, out, ids = finished
    result = _lose_last_shard_and_drop_in(finished, tmp_path, seed=7)
    assert result.status == "complete" and result.stats["items_done"] == 3
    [q] = result.stats["quarantined"]
    assert "other settings" in q["reason"]
    assert_exactly_once(out, ids)
    assert all(item["meta"]["seed"] == 0 for item in read_output(out).values())


# -- case 6: a checksum of every clip ---------------------------------------------------------

def _flip_a_sample_bit(shard: Path) -> str:
    with tarfile.open(shard) as tar:
        wav = next(m for m in tar.getmembers() if m.name.endswith(".wav"))
    with open(shard, "r+b") as f:
        f.seek(wav.offset_data + 44 + 10)  # inside the PCM samples, past the WAV header
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    return wav.name.split(".")[0]


def test_every_clip_carries_its_checksum(finished):
    _corpus, out, _ids = finished
    items = read_output(out)
    manifest = {r["id"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    entries = {i["id"]: i for r in journal(out) if r["t"] == "items" for i in r["items"]}
    for item_id, item in items.items():
        with tarfile.open(out / item["shard"]) as tar:
            wav = tar.extractfile(f"{item['key']}.wav").read()
        digest = hashlib.sha256(wav).hexdigest()
        assert item["meta"]["wav_sha256"] == manifest[item_id]["wav_sha256"] == entries[item_id]["wav_sha256"] == digest


def test_a_flipped_bit_inside_the_samples_fails_verify(finished):
    _corpus, out, _ids = finished
    key = _flip_a_sample_bit(out / "shard-000001.tar")
    result = verify_output(out)
    assert not result["ok"]
    assert result["problems"] == [f"shard-000001.tar: {key}.wav does not match its wav_sha256: its audio "
                                  "changed after it was written"]


def test_a_repair_does_not_re_record_a_member_whose_audio_changed(finished):
    """The journal lost its last line: the repair re-records the shard's items from their KEY.json,
    except one whose audio no longer matches its checksum, which is made again."""
    corpus, out, ids = finished
    path = out / ".cosybatch" / "journal.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    last_items = max(i for i, line in enumerate(lines) if json.loads(line)["t"] == "items")
    path.write_bytes(b"".join(lines[:last_items]))  # item id11 (and shard 3's close) forgotten
    shard = out / "shard-000003.tar"
    with tarfile.open(shard) as tar:
        wav = [m for m in tar.getmembers() if m.name.endswith(".wav")][-1]
    with open(shard, "r+b") as f:
        f.seek(wav.offset_data + 60)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x80]))
    result = run(config(corpus, out))
    assert result.status == "complete" and result.stats["items_done"] == 1
    assert_exactly_once(out, ids)


def test_a_folder_written_before_checksums_resumes_and_verifies(tmp_path, monkeypatch):
    """Journal entries, KEY.json and manifest without wav_sha256 (as cosybatch wrote them before):
    the folder resumes, verify passes and says which items it could not check sample by sample."""
    data = rows(12)
    corpus = write_parquet(tmp_path / "c.parquet", data)
    out = tmp_path / "out"
    render_item = line.render_item

    def without_checksum(*args, **kw):
        key, members, record = render_item(*args, **kw)
        meta = json.loads(members["json"])
        del meta["wav_sha256"], meta["source"], record["wav_sha256"]
        return key, {**members, "json": json.dumps(meta, ensure_ascii=False).encode()}, record

    monkeypatch.setattr(line, "render_item", without_checksum)
    assert run(config(corpus, out)).status == "complete"
    monkeypatch.undo()
    (out / "shard-000001.tar").unlink()  # the resume repairs an old folder: ids 3-5 made again, with checksums
    result = run(config(corpus, out))
    assert result.status == "complete" and result.stats["items_done"] == 3
    assert_exactly_once(out, [r["id"] for r in data])
    report = verify_output(out)
    assert report["items_without_checksum"] == 9
    assert "9 items were written before cosybatch stored a checksum" in describe(report)
