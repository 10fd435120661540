"""`cosybatch verify OUT`: read every shard whole and check it against the manifest.

Every id in the manifest must be in exactly one readable pair of an audio member (`KEY.wav`, or
`KEY.flac`, `KEY.opus`: store/audio.py) and `KEY.json`, in the shard the manifest
names, with audio of the format both record that decodes to the manifest's sample count and rate
and a `KEY.json` naming the same id; every item in a shard must be in the manifest. `run` does the cheap
part of this (file sizes and counts, `repair.check_sizes`) before it reports complete; this reads
every byte, so it also finds damage that keeps a file's size in what it parses (tar headers, WAV
headers, KEY.json) and, through each item's `wav_sha256` (in the manifest and KEY.json), a
flipped bit inside the PCM samples. Items written before cosybatch stored that checksum have none:
their audio is checked by its WAV header and sample count only, and the report says how many.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from ..errors import UsageError
from .audio import AUDIO_EXTS, DEFAULT_FORMAT, audio_of
from .audio import checksum as audio_checksum
from .checkpoint import MANIFEST_FILE
from .distributed import job_folders
from .tables import read_parquet


def verify(root: Path) -> dict:
    """{"ok", "items", "shards", "problems"} for a job folder or a sharded job's root."""
    folders = job_folders(Path(root), "verify")  # one job's parts, as merge requires
    if not folders:
        raise UsageError(f"{root} holds no cosybatch job (no .cosybatch folder, no part-* folders)")
    problems: list[str] = []
    items = shards = 0
    for folder in folders:
        prefix = "" if folder == Path(root) else f"{folder.name}/"
        found, folder_problems, count = _verify_folder(folder)
        problems += [prefix + p for p in folder_problems]
        items += found
        shards += count
    unchecked = sum(_unchecked(folder) for folder in folders)
    return {"root": str(root), "ok": not problems, "items": items, "shards": shards, "problems": problems,
            "items_without_checksum": unchecked}


def _unchecked(folder: Path) -> int:
    """Manifest rows with no wav_sha256 (written before it was stored)."""
    manifest = folder / MANIFEST_FILE
    if not manifest.exists():
        return 0
    table = read_parquet(manifest)
    if "wav_sha256" not in table.column_names:
        return table.num_rows
    return table.column("wav_sha256").null_count


def _verify_folder(folder: Path) -> tuple[int, list[str], int]:
    problems: list[str] = []
    manifest = folder / MANIFEST_FILE
    if not manifest.exists():
        return 0, [f"no {MANIFEST_FILE}: the run has not finished; rerun it to finish"], 0
    expected: dict[tuple[str, str], dict] = {}  # (shard, key) -> manifest row
    ids: set[str] = set()
    for row in read_parquet(manifest).to_pylist():
        if row["id"] in ids:
            problems.append(f"{MANIFEST_FILE} lists id {row['id']!r} twice")
        ids.add(row["id"])
        if (row["shard"], row["key"]) in expected:
            problems.append(f"{MANIFEST_FILE} lists key {row['key']!r} twice in {row['shard']}")
        expected[(row["shard"], row["key"])] = row
    on_disk = sorted(folder.glob("shard-*.tar"))
    for name in sorted({shard for shard, _ in expected} - {p.name for p in on_disk}):
        count = sum(1 for shard, _ in expected if shard == name)
        problems.append(f"{name} is missing ({count} items of the manifest are in it)")
    found = 0
    for path in on_disk:
        for _key, problem in _check_shard(path, expected):
            if problem is None:
                found += 1
            else:
                problems.append(f"{path.name}: {problem}")
    missing = [row for (shard, _), row in expected.items() if not row.get("_seen") and (folder / shard).exists()]
    problems += [f"{row['shard']}: id {row['id']!r} (key {row['key']!r}) is in the manifest but not in the shard"
                 for row in missing]
    return found, problems, len(on_disk)


def _check_shard(path: Path, expected: dict):
    """Yield (key, None) for each good item and (key, problem) for each problem of one shard."""
    import soundfile

    pending: dict[str, dict[str, bytes]] = {}
    names: set[str] = set()
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                if member.name in names:
                    yield member.name, f"member {member.name} appears twice"
                    continue
                names.add(member.name)
                key, _, ext = member.name.partition(".")
                if not member.isfile() or (ext != "json" and ext not in AUDIO_EXTS):
                    yield key, f"unexpected member {member.name!r}"
                    continue
                pending.setdefault(key, {})[ext] = tar.extractfile(member).read()
                entry = pending[key]
                if "json" not in entry or not any(e in AUDIO_EXTS for e in entry):
                    continue
                del pending[key]
                yield key, _check_item(path.name, key, entry, expected, soundfile)
            end = tar.offset
        # tarfile stops quietly at a damaged header: what follows the archive's end must be zeros.
        with open(path, "rb") as f:
            f.seek(end)
            while chunk := f.read(1 << 20):
                if chunk.strip(b"\0"):
                    raise tarfile.ReadError(f"a damaged member header at byte {end} hides the rest")
    except (tarfile.TarError, EOFError, OSError) as exc:
        yield "", f"unreadable past its last whole member ({exc}); delete the shard and rerun the job to " \
                  "synthesise its items again"
    for key, entry in pending.items():
        yield key, f"{key} has only its .{next(iter(entry))} member"


def _check_item(shard: str, key: str, entry: dict, expected: dict, soundfile) -> str | None:
    row = expected.get((shard, key))
    if row is None:
        return f"{key} is not in the manifest"
    row["_seen"] = True
    try:
        meta = json.loads(entry["json"])
    except ValueError:
        return f"{key}.json is not valid JSON"
    if not isinstance(meta, dict):
        return f"{key}.json is not an object"
    if meta.get("id") != row["id"]:
        return f"{key}.json names id {meta.get('id')!r}; the manifest says {row['id']!r}"
    try:
        ext, data = audio_of(entry)
    except ValueError as exc:
        return f"{key}: {exc}"
    if ext != meta.get("format", DEFAULT_FORMAT) or ext != (row.get("format") or DEFAULT_FORMAT):
        return (f"{key}.{ext}: KEY.json says format {meta.get('format', DEFAULT_FORMAT)!r}, the manifest "
                f"{row.get('format') or DEFAULT_FORMAT!r}")
    checksum = row.get("wav_sha256")
    if meta.get("wav_sha256") != checksum:
        return f"{key}.json says wav_sha256 {meta.get('wav_sha256')!r}; the manifest says {checksum!r}"
    if checksum is not None and audio_checksum(data) != checksum:
        return f"{key}.{ext} does not match its wav_sha256: its audio changed after it was written"
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception as exc:  # soundfile raises its own error types for undecodable audio
        return f"{key}.{ext} does not decode ({exc})"
    if info.frames != row["num_samples"] or info.samplerate != row["sample_rate"]:
        return (f"{key}.{ext} has {info.frames} samples at {info.samplerate} Hz; the manifest says "
                f"{row['num_samples']} at {row['sample_rate']} Hz")
    duration = meta.get("duration")
    if not isinstance(duration, (int, float)) or abs(duration - row["duration_s"]) > 1e-6:
        return f"{key}.json says {meta.get('duration')} s; the manifest says {row['duration_s']} s"
    return None


def describe(result: dict) -> str:
    unchecked = result.get("items_without_checksum", 0)
    note = (f"{unchecked} items were written before cosybatch stored a checksum of the audio: their "
            "WAV headers and sample counts were checked, not their samples") if unchecked else ""
    if result["ok"]:
        return f"{result['root']}: ok, {result['items']} items in {result['shards']} shards, all read whole" + \
            (f"; {note}" if note else "")
    lines = [f"{result['root']}: {len(result['problems'])} problems ({result['items']} good items "
             f"in {result['shards']} shards)"]
    return "\n".join(lines + [f"  {p}" for p in result["problems"]] + ([f"  note: {note}"] if note else []))
