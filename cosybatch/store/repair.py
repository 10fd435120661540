"""What a rerun checks before it resumes, and how it repairs an output folder that was damaged.

The journal says which ids are committed in which shard and how many bytes of members each shard
holds. Before a run goes on, the files must agree with it:

- a shard the journal counts on is missing: its ids are recorded as lost and synthesised again;
- a shard is shorter than the journal says (truncated): every item whose members are still whole
  is kept, the rest are recorded as lost and synthesised again, and a finished shard gets its
  end-of-archive blocks back;
- a finished shard holds items the journal does not know (the journal lost its last lines, or
  was cut at a damaged line): they are recorded again from the shard's own `KEY.json`, so audio
  that exists is never synthesised a second time, but only when the caller's `admit` accepts
  them (the id is in this corpus, made from the same row with the job's settings);
- a shard's bytes are not the ones the journal wrote (another shard copied over it, two shards
  swapped): every member the repair keeps is read first, its tar header, name and `KEY.json` id
  must be the ones the journal put at that offset, so the first member that is not counts as
  lost from there on and foreign bytes are never kept;
- a shard the journal never wrote (another job's, dropped in): what `admit` refuses is moved to
  `.cosybatch/quarantine/` and reported (`quarantined` in stats.json).

Reading the kept members costs two header reads and one small `KEY.json` read per item, not
the audio: a resume stays cheap. The audio's checksum (`wav_sha256`) is compared where the repair
re-records a member from the shard's own bytes; `cosybatch verify` compares every one.

Each repair is one journal record written before the file is touched (`lost`, or `items` marked
`recovered`), so a crash in the middle of a repair leaves a folder the next rerun repairs the same
way. Only bytes that were fsynced are ever recovered: a finished shard is fsynced before it gets
its final name, and an open shard's committed members before their journal line.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .audio import DEFAULT_FORMAT, audio_of
from .audio import checksum as audio_checksum
from .checkpoint import (
    DAMAGED_DIR,
    EOA_BYTES,
    MANIFEST_FILE,
    QUARANTINE_DIR,
    STATE_DIR,
    Journal,
    Ledger,
    OutputDir,
    shard_indices,
)
from .shards import TAR_BLOCK, fsync_dir, item_key, shard_name

log = logging.getLogger("cosybatch")

# meta (an item's KEY.json) -> None to adopt it, or why it is not this job's
Admit = Callable[[dict], Optional[str]]


@dataclass
class RepairReport:
    """What `repair` did: one line per repair, the journal replayed afterwards, and the files (or
    copies of them) moved to .cosybatch/quarantine/ with why."""

    notes: list[str]
    ledger: Ledger
    quarantined: list[dict] = field(default_factory=list)  # {"file", "reason"}


def repair(out: OutputDir, journal: Journal, admit: Optional[Admit] = None) -> RepairReport:
    """Make the shards and the journal agree (none of `notes` when all is well). `admit` decides
    whether an item the journal does not list may be adopted from its KEY.json; without it every
    such item is adopted whose id is not committed elsewhere."""
    notes = [f"{journal.dropped}; what finished shards still hold is recovered below"] if journal.dropped else []
    quarantined: list[dict] = []
    ledger = Ledger.replay(out.journal_path)
    batches = _batches_by_shard(out)
    stored = out.stored()  # in the job's object store, uploaded whole and size-checked before their commit
    for index in sorted(set(ledger.shards) | set(shard_indices(out.root))):
        if index in stored:
            continue
        shard = ledger.shards.get(index)
        final = out.root / shard_name(index)
        partial = final.with_name(final.name + ".partial")
        if final.exists():
            note = _check_finished(out, journal, ledger, index, final, batches.get(index, []), admit, quarantined)
        elif shard is not None and ledger.items_in(index):
            if not shard.closed and partial.exists():
                note = _check_open(out, journal, ledger, index, partial, batches.get(index, []))
            else:
                missing = final if shard.closed else partial
                note = _lose(journal, ledger, index, out, size=0, why=f"{missing.name} is missing")
            if note and not shard.closed:
                _retire(out, journal, index, partial)
        else:
            note = None
        if note:
            log.warning("repaired %s: %s", out.root, note)
            notes.append(note)
            ledger = Ledger.replay(out.journal_path)
            batches = _batches_by_shard(out)
    for q in quarantined:
        log.warning("moved aside %s: %s", q["file"], q["reason"])
    return RepairReport(notes, ledger, quarantined)


def _check_finished(out: OutputDir, journal: Journal, ledger: Ledger, index: int, final: Path, batches: list,
                    admit: Optional[Admit], quarantined: list) -> Optional[str]:
    shard = ledger.shards.get(index)
    size = final.stat().st_size
    expected = (shard.end if shard else 0) + EOA_BYTES
    # Only what the journal says sits at each offset is kept: read every member's header and id.
    good, mismatch = _matching_prefix(final, batches, min(size, shard.end if shard else 0))
    if shard is not None and size == expected and good == shard.end and _ends_archive(final, shard.end):
        if not shard.closed:  # killed between the rename and its journal line: the shard is whole
            journal.append({"t": "closed", "shard": index, "items": ledger.items_in(index)})
        return None
    # The journal and the file disagree: keep what is whole (and ours) in the file, record it, cut the rest.
    limit = size if shard is None or good == shard.end else good
    base, beyond = _boundary(out, ledger, index, limit)
    recovered, new_end, refused = _scan_items(final, base, limit, lambda i: i in ledger.live and i not in beyond,
                                              admit)
    _record(journal, index, base, beyond, recovered, new_end, why=f"{final.name} did not match the journal")
    foreign = mismatch or refused
    aside = None
    if new_end == 0:
        aside = out.state / (QUARANTINE_DIR if foreign else DAMAGED_DIR) / f"{final.name}.{int(time.time())}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        os.replace(final, aside)
        fsync_dir(out.root)
    else:
        if foreign:  # the bytes cut off are someone else's: keep a copy for whoever looks
            aside = out.state / QUARANTINE_DIR / f"{final.name}.{int(time.time())}"
            aside.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(final, aside)
        _end_archive_at(final, new_end)
    if foreign:
        quarantined.append({"file": f"{STATE_DIR}/{QUARANTINE_DIR}/{aside.name}", "shard": final.name,
                            "reason": foreign})
    if shard is not None or new_end:
        journal.append({"t": "closed", "shard": index, "items": len(recovered) + _kept(ledger, index, beyond)})
    kept = {r["id"] for r in recovered}
    lost = [i for i in beyond if i not in kept]
    what = [f"{len(recovered)} whole items in it that the journal did not list were recorded from their "
            "KEY.json"] if recovered else []
    if lost:
        what.append(f"{len(lost)} items no longer in it will be synthesised again ({_some(lost)})")
    if foreign:
        what.append(foreign)
    if new_end == 0:
        what.append(f"nothing in it was usable: it was moved to {STATE_DIR}/{aside.parent.name}/{aside.name}")
    elif foreign:
        what.append(f"a copy of it as it was is in {STATE_DIR}/{QUARANTINE_DIR}/{aside.name}")
    elif new_end + EOA_BYTES != size:
        what.append(f"it now ends after its last whole item ({new_end + EOA_BYTES} B)")
    return f"{final.name} was {size} B where the journal expects {expected} B: " + "; ".join(what)


def _check_open(out: OutputDir, journal: Journal, ledger: Ledger, index: int, partial: Path,
                batches: list) -> Optional[str]:
    size = partial.stat().st_size
    shard = ledger.shards[index]
    good, mismatch = _matching_prefix(partial, batches, min(size, shard.end))
    if good == shard.end:
        return None  # whatever lies past the committed end was never committed; it is cut on resume
    why = f"{partial.name}: {mismatch}" if mismatch else f"{partial.name} is {size} B, shorter than its " \
                                                         f"committed {shard.end} B"
    return _lose(journal, ledger, index, out, good, why=why, path=partial)


def _retire(out: OutputDir, journal: Journal, index: int, partial: Path) -> None:
    """Finish an open shard that lost items, at its new end: nothing is ever appended to a shard
    after a loss, so its file and its journal lines can never disagree again."""
    end = Ledger.replay(out.journal_path).shards[index].end
    final = out.root / shard_name(index)
    if end == 0:
        partial.unlink(missing_ok=True)
    else:
        _end_archive_at(partial, end)
        os.replace(partial, final)
    fsync_dir(out.root)
    journal.append({"t": "closed", "shard": index, "items": Ledger.replay(out.journal_path).items_in(index)})


def _end_archive_at(path: Path, end: int) -> None:
    """Cut a shard after its last whole member and end the tar there, durably."""
    with open(path, "r+b") as f:
        f.truncate(end)
        f.seek(end)
        f.write(b"\0" * EOA_BYTES)
        f.flush()
        os.fsync(f.fileno())


def _lose(journal: Journal, ledger: Ledger, index: int, out: OutputDir, size: int, why: str,
          path: Optional[Path] = None) -> str:
    """The shard holds only its first `size` bytes: keep the whole items in them, lose the rest."""
    base, beyond = _boundary(out, ledger, index, size)
    recovered: list = []
    new_end = base
    if path is not None:
        recovered, new_end, _ = _scan_items(path, base, size, lambda i: i in ledger.live and i not in beyond)
    _record(journal, index, base, beyond, recovered, new_end, why)
    kept = {r["id"] for r in recovered}
    lost = [i for i in beyond if i not in kept]
    note = f"{why}: {len(lost)} items will be synthesised again ({_some(lost)})"
    return note + (f"; {len(kept)} whole items in it were kept" if kept else "")


def _record(journal: Journal, index: int, base: int, beyond: list, recovered: list, new_end: int, why: str) -> None:
    if beyond:
        journal.append({"t": "lost", "ts": round(time.time(), 3), "shard": index, "end": base, "ids": beyond,
                        "reason": why})
    if recovered:
        journal.append({"t": "items", "ts": round(time.time(), 3), "shard": index, "end": new_end,
                        "items": recovered, "recovered": True})


def _kept(ledger: Ledger, index: int, beyond: list) -> int:
    gone = set(beyond)
    return sum(1 for i, (_, s, _) in ledger.live.items() if s == index and i not in gone)


def _some(ids: list, n: int = 3) -> str:
    shown = ", ".join(repr(i) for i in ids[:n])
    return shown + (f" and {len(ids) - n} more" if len(ids) > n else "")


def _batches_by_shard(out: OutputDir) -> dict[int, list[tuple[int, int, list]]]:
    """shard -> its committed batches in file order: (end, journal line, item records). A `lost`
    record drops the batches past its end. One read of the journal for every shard."""
    batches: dict[int, list[tuple[int, int, list]]] = {}
    for line, rec in enumerate(Journal.read(out.journal_path)):
        if rec.get("t") == "items":
            batches.setdefault(rec["shard"], []).append((rec["end"], line, rec["items"]))
        elif rec.get("t") == "lost":
            batches[rec["shard"]] = [b for b in batches.get(rec["shard"], []) if b[0] <= rec["end"]]
    return batches


def _boundary(out: OutputDir, ledger: Ledger, index: int, size: int) -> tuple[int, list]:
    """(end of the last committed batch of this shard that fits in `size` bytes, the live ids of
    the batches after it)."""
    base, beyond = 0, []
    for end, line, items in _batches_by_shard(out).get(index, []):
        if end <= size:
            base = max(base, end)
        else:
            beyond += [i["id"] for i in items if ledger.live.get(i["id"], (None,))[0] == line]
    return base, beyond


def _member_at(block: bytes) -> Optional[tuple[str, int]]:
    """(name, size) of the regular-file member whose ustar header is `block`, as ShardWriter writes
    them (no name prefix), or None for anything else: a damaged header (checksum), another kind of
    member, end-of-archive zeros. tarfile's parser does the same checks ten times slower, and a
    resume runs this twice per committed item."""
    if len(block) < TAR_BLOCK or block[257:263] != b"ustar\x00" or block[156:157] not in (b"0", b"\x00") or block[345]:
        return None
    try:
        checksum = int(block[148:156].rstrip(b"\x00 ") or b"0", 8)
        size = int(block[124:136].rstrip(b"\x00 ") or b"0", 8)
    except ValueError:
        return None
    if checksum != 256 + sum(block[:148]) + sum(block[156:TAR_BLOCK]):
        return None
    return block[:100].split(b"\x00", 1)[0].decode("utf-8", "replace"), size


def _matching_prefix(path: Path, batches: list, limit: int) -> tuple[int, Optional[str]]:
    """How many bytes from the start of the shard hold exactly the members the journal wrote there
    (each item's audio member, KEY.wav or its format's, then KEY.json, by header, name and the id in
    KEY.json), up to `limit`;
    and, when a member is not the journal's, what was found instead. Reads headers and KEY.json,
    never the audio: two reads per item."""
    pos = 0
    with open(path, "rb", buffering=0) as f:
        for _end, _line, items in batches:
            for item in items:
                at = pos
                if pos + 2 * TAR_BLOCK > limit:
                    return at, None  # the file is shorter: not foreign, only cut
                f.seek(pos)
                audio = _member_at(f.read(TAR_BLOCK))
                audio_name = f"{item['key']}.{item.get('format') or DEFAULT_FORMAT}"
                if audio is None or audio[0] != audio_name:
                    return at, _not_ours(pos, audio, audio_name)
                pos += TAR_BLOCK + -(-audio[1] // TAR_BLOCK) * TAR_BLOCK
                if pos + TAR_BLOCK > limit:
                    return at, None
                f.seek(pos)
                head = f.read(8 * TAR_BLOCK)  # the header and, nearly always, all of KEY.json
                meta_member = _member_at(head[:TAR_BLOCK])
                if meta_member is None or meta_member[0] != f"{item['key']}.json":
                    return at, _not_ours(pos, meta_member, f"{item['key']}.json")
                size, json_at = meta_member[1], pos + TAR_BLOCK
                data = head[TAR_BLOCK:TAR_BLOCK + size]
                if len(data) < size:
                    data += f.read(size - len(data))
                pos += TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK
                if pos > limit:
                    return at, None
                try:
                    meta = json.loads(data)
                except ValueError:
                    meta = None
                if not isinstance(meta, dict) or meta.get("id") != item["id"] or \
                        meta.get("wav_sha256") != item.get("wav_sha256"):
                    return at, f"{item['key']}.json at byte {json_at} is not the item the journal wrote there " \
                               f"(id {item['id']!r})"
    return pos, None


def _not_ours(pos: int, found: Optional[tuple[str, int]], want: str) -> str:
    what = "a damaged or foreign header" if found is None else repr(found[0])
    return f"byte {pos} holds {what} where the journal wrote {want!r}: not this shard's bytes"


def _ends_archive(path: Path, end: int) -> bool:
    with open(path, "rb") as f:
        f.seek(end)
        return not f.read(EOA_BYTES).strip(b"\0")


def _scan_items(path: Path, start: int, limit: int, taken: Callable[[str], bool],
                admit: Optional[Admit] = None) -> tuple[list[dict], int, Optional[str]]:
    """Whole items (the audio member then KEY.json, as ShardWriter writes them) from byte `start` up to
    `limit`, as journal item records, the offset after the last one, and why a whole item was
    refused (None when the scan stopped at a torn member or the end). Stops at the first thing
    that is not a whole cosybatch item: a torn or foreign member, end-of-archive, audio that does
    not match its `wav_sha256`, an id already committed elsewhere (`taken`) or one `admit` refuses."""
    records: list[dict] = []
    refused: Optional[str] = None
    end = pos = start
    pending: dict[str, dict[str, tuple[int, int]]] = {}
    with open(path, "rb") as f:
        while pos + TAR_BLOCK <= limit:
            f.seek(pos)
            block = f.read(TAR_BLOCK)
            try:
                info = tarfile.TarInfo.frombuf(block, "utf-8", "strict")
            except (tarfile.HeaderError, ValueError):
                break  # end-of-archive zeros or a damaged header
            data_at = pos + TAR_BLOCK
            pos = data_at + -(-info.size // TAR_BLOCK) * TAR_BLOCK
            if not info.isfile() or pos > limit:
                break
            key, _, ext = info.name.partition(".")
            if pending and key not in pending:
                break  # a member of another item before this one was whole
            members = pending.setdefault(key, {})
            members[ext] = (data_at, info.size)
            try:
                audio = audio_of(members)
            except ValueError:
                break  # two audio members: not an item the writer made
            if audio is None or "json" not in members:
                continue
            f.seek(members["json"][0])
            meta_bytes = f.read(members["json"][1])
            f.seek(audio[1][0])
            record, refused = _item_record(key, meta_bytes, audio[0], f.read(audio[1][1]), admit)
            if record is not None and (taken(record["id"]) or any(r["id"] == record["id"] for r in records)):
                refused = f"{key} holds id {record['id']!r}, which is committed already"
            if refused or record is None:
                break
            records.append(record)
            end = pos
            pending = {}
    return records, end, refused


def _item_record(key: str, meta_bytes: bytes, ext: str, audio: bytes,
                 admit: Optional[Admit]) -> tuple[Optional[dict], Optional[str]]:
    """(a journal item record from an item's KEY.json, None) or (None, why it is not one of ours)."""
    try:
        meta = json.loads(meta_bytes)
        record = {"id": meta["id"], "key": key, "row": int(meta["row"]), "text": meta["text"],
                  "voice": meta["voice"], "duration_s": float(meta["duration"]),
                  "num_samples": int(meta["num_samples"]), "sample_rate": int(meta["sample_rate"])}
        for name in ("instruct", "speaker", "prompt", "language", "source", "wav_sha256"):
            if isinstance(meta.get(name), str):
                record[name] = meta[name]
        if meta.get("format", DEFAULT_FORMAT) != DEFAULT_FORMAT:
            record["format"] = meta["format"]
        if isinstance((meta.get("loudness") or {}).get("lufs"), (int, float)):
            record["loudness_lufs"] = float(meta["loudness"]["lufs"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, f"{key}.json is not a cosybatch item's"
    whole = len(audio) >= 44 + 2 * record["num_samples"] if ext == "wav" else len(audio) > 0
    if not isinstance(record["id"], str) or item_key(record["id"]) != key or not whole \
            or ext != meta.get("format", DEFAULT_FORMAT):
        return None, f"{key} is not a whole cosybatch item"
    if "wav_sha256" in record and audio_checksum(audio) != record["wav_sha256"]:
        return None, f"{key}.{ext} does not match its wav_sha256: the audio changed after it was written"
    if admit is not None and (why := admit(meta)):
        return None, f"{key} (id {record['id']!r}) is not this job's: {why}"
    return record, None


def check_sizes(out: OutputDir, ledger: Optional[Ledger] = None) -> list[str]:
    """The cheap part of `cosybatch verify` for a finished job: every shard the journal counts on
    exists with exactly the length the journal says, no shard is left open or unknown, and the
    manifest lists every committed item once. Reads file sizes and the manifest's metadata only."""
    ledger = ledger or Ledger.replay(out.journal_path)
    problems = []
    on_disk = shard_indices(out.root)
    stored = out.stored()  # shards in the job's object store (objects.py), not here
    for index, shard in sorted(ledger.shards.items()):
        final = out.root / shard_name(index)
        items = ledger.items_in(index)
        if not shard.closed and (items or shard.end):
            problems.append(f"{final.name} was never finished ({items} items committed to its .partial)")
        elif not final.exists():
            if index not in stored:  # read again after a miss: an upload records its shard before the copy goes
                stored = out.stored()
            if index in stored:
                if stored[index] != shard.end + EOA_BYTES:
                    problems.append(f"{final.name} is {stored[index]} B in the store; the journal says "
                                    f"{shard.end + EOA_BYTES} B")
            elif items or shard.end:
                problems.append(f"{final.name} is missing; the journal has {items} items in it")
        elif final.stat().st_size != shard.end + EOA_BYTES:
            problems.append(f"{final.name} is {final.stat().st_size} B; the journal says {shard.end + EOA_BYTES} B")
    problems += [f"{path.name} is not in the journal" for index, path in sorted(on_disk.items())
                 if index not in ledger.shards]
    manifest = out.root / MANIFEST_FILE
    if manifest.exists():
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(manifest).metadata.num_rows
        if rows != len(ledger.live):
            problems.append(f"{MANIFEST_FILE} lists {rows} items; the journal has {len(ledger.live)}")
    else:
        problems.append(f"{MANIFEST_FILE} is missing")
    return problems


def check_members(out: OutputDir, ledger: Optional[Ledger] = None) -> list[str]:
    """What a rerun's repair reads before it keeps a finished shard, without repairing: every
    member where the journal wrote it has the journal's name, and its KEY.json the journal's id
    and wav_sha256. A shard of the right size whose members were renamed in place, or another
    job's shard padded to the size, is found here; the size check alone keeps it. Two reads per
    item, never the audio (`cosybatch verify` compares the audio with its checksum)."""
    ledger = ledger or Ledger.replay(out.journal_path)
    problems = []
    batches = _batches_by_shard(out)
    for index, shard in sorted(ledger.shards.items()):
        final = out.root / shard_name(index)
        if not shard.closed or not final.is_file():
            continue  # check_sizes says so
        _good, mismatch = _matching_prefix(final, batches.get(index, []), shard.end)
        if mismatch:
            problems.append(f"{final.name}: {mismatch}")
    return problems
