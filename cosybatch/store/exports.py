"""Dataset formats besides the WebDataset shards: Hugging Face `datasets` Parquet (Audio feature),
NeMo and Lhotse manifests and Lhotse Shar, written from a finished output folder (one worker's, or
a sharded job's root holding part-* folders). Every one reads every audio format the shards hold
(store/audio.py: an item's audio member is KEY.wav, KEY.flac or KEY.opus, by the format
its KEY.json records) and hands on the member's own bytes, never re-encoded, except Shar, which
stores a WAV member as FLAC (shar.py says why).

    OUT/exports/hf/data/train-00000-of-00003.parquet   audio {bytes, path} + id, text, duration, ..., qc_*
    OUT/exports/nemo/tarred_audio_manifest.json        NeMo tarred audio: audio_filepath KEY.flac, shard_id N
    OUT/exports/nemo/sharded_manifests/manifest_N.json the same, one file per shard
    OUT/exports/nemo/audio_N.tar                       links to the shards (NeMo finds shard N by this name)
    OUT/exports/lhotse/{recordings,supervisions}.jsonl.gz  each recording a byte range of a shard
    OUT/exports/shar/{cuts.N.jsonl.gz,recording.N.tar} Lhotse Shar, a copy of the audio (shar.py)

The Hugging Face `Audio` feature's `sampling_rate` is the items' rate as written (after
--sample-rate), never the engine's: `datasets` resamples to it when it decodes.

The NeMo and Lhotse exports point into the tar shards and copy no audio: NeMo's tarred datasets
read the shards themselves (the KEY.json members beside each audio member are not audio: NeMo's
webdataset reader groups them with the audio by key and ignores them; its Lhotse reader needs
`skip_missing_manifest_entries`), and each Lhotse recording is a `command` source that reads the
audio member's byte range out of its shard (`tail -c +OFFSET SHARD | head -c SIZE`), which
`load_audio()` runs as it runs any command source and decodes from the bytes (soundfile reads all
four formats from memory, so the source needs no format of its own). Lhotse Shar cannot point at
our shards: its reader takes each tar's JSON member for a Lhotse manifest of the audio beside it,
so `export --to shar` writes a second copy of every clip in Shar's own tars. With `copy=True`
(`cosybatch export --copy`) NeMo and Lhotse copy the audio out as loose files instead, for tools
that need them:

    OUT/exports/wavs/KEY.wav (KEY.flac, ...)           the audio members as they are, shared by both
    OUT/exports/nemo/manifest.jsonl                    audio_filepath relative to the manifest
    OUT/exports/lhotse/{recordings,supervisions}.jsonl.gz  absolute paths (Lhotse resolves from CWD);
                                                       a supervision per segment (KEY.json "segments")

The loose files' folder keeps its name `wavs` whatever the format (as KEY.json keeps `wav_sha256`):
the manifests are what tools read, and with one folder a re-export finds the files an earlier
`--copy` wrote and writes none twice, where a new name would leave a whole stale copy of the
audio beside the new one; a file's extension says its format.

An export first checks the folder as `cosybatch status` does (every shard has the size its journal
says): a folder that lost a shard after it finished is refused, never exported short. Each format
is written into `exports/.FMT.tmp-PID/` and renamed into place when whole, so a failed export
leaves the earlier one as it was and never half of a new one. (The loose files under exports/wavs
are shared by NeMo and Lhotse and each is written whole, by rename, on its own.)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shlex
import shutil
import stat
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

from ..errors import DamagedOutputError, UsageError
from .audio import AUDIO_EXTS, DEFAULT_FORMAT, audio_of
from .audio import checksum as audio_checksum
from .checkpoint import MANIFEST_FILE, RAY_FAILURES_DIR, STATE_DIR, OutputDir, write_atomic
from .distributed import job_folders
from .items import QC_COLUMNS, qc_columns
from .shar import write_shar
from .shards import item_key
from .tables import read_parquet

FORMATS = ("hf", "nemo", "lhotse", "shar")
COPYING = ("nemo", "lhotse")  # the formats that point into the shards, or copy the audio out with copy=True
LOOSE_DIR = "wavs"  # exports/wavs: the loose audio files of copy=True, in any format (the module's docstring)


Expected = Optional[dict[str, dict]]  # key -> the journal's (or manifest's) item record, for one shard


def shards(root: Path, verb: str = "export") -> list[tuple[Path, Expected]]:
    """Every finished shard of the job under `root` (parts in order, then shards) with the items
    its journal says it holds, by key. A root's parts must be one job's, as `merge` requires. A
    shard the journal does not know, or a journal shard with items that is not there, is damage."""
    folders = job_folders(root, verb)
    if not folders:
        raise UsageError(f"{root} holds no cosybatch job to {verb} (run the job first)")
    found = []
    for folder in folders:
        expected = expected_items(folder)
        on_disk = sorted(folder.glob("shard-*.tar"))
        if expected is not None:
            for path in on_disk:
                if path.name not in expected:
                    raise _not_the_journals(path, "its journal never wrote this shard")
            for name in sorted(set(expected) - {p.name for p in on_disk}):
                if expected[name]:
                    raise _not_the_journals(folder / name, f"it is missing; its journal has {len(expected[name])} "
                                                           "items in it")
        found += [(path, expected.get(path.name) if expected is not None else None) for path in on_disk]
    return found


def expected_items(folder: Path) -> Optional[dict[str, dict[str, dict]]]:
    """shard name -> key -> item record: what the folder's journal committed (a ray-run folder,
    which keeps no journal: its manifest), or None when there is neither. Keys for files written
    out of a shard come from here, never from a tar member's name."""
    found: dict[str, dict[str, dict]] = {}
    if (folder / STATE_DIR / RAY_FAILURES_DIR).is_dir():
        manifest = folder / MANIFEST_FILE
        if not manifest.is_file():
            return None
        records = read_parquet(manifest).to_pylist()
    else:
        records = OutputDir(folder).live_items()
    for record in records:
        found.setdefault(record["shard"], {})[record["key"]] = record
    return found


class _ShardCheck:
    """What `run` checks before it keeps a member, for a reader of one shard: each member is the
    audio member (KEY.wav, KEY.flac, ...) or KEY.json of an item the journal put in this shard
    (the key is the journal's, and so never a path), its KEY.json names the journal's id, its audio matches the recorded
    wav_sha256, and every item the journal put there is found, once."""

    def __init__(self, path: Path, expected: Expected):
        self.path, self.expected, self.seen = path, expected, set()

    def member(self, member: tarfile.TarInfo) -> tuple[str, str]:
        key, _, ext = member.name.partition(".")
        if (ext != "json" and ext not in AUDIO_EXTS) or not member.isfile():
            raise _not_the_journals(self.path, f"member {member.name!r} is not an item's audio or KEY.json")
        if self.expected is not None and key not in self.expected:
            raise _not_the_journals(self.path, f"member {member.name!r} is not an item its journal wrote there")
        return key, ext

    def item(self, key: str, meta, ext: str, digest: str) -> dict:
        if not isinstance(meta, dict) or not isinstance(meta.get("id"), str):
            raise _not_the_journals(self.path, f"{key}.json is not a cosybatch item's")
        if meta.get("format", DEFAULT_FORMAT) != ext:
            raise _not_the_journals(self.path, f"{key}.{ext} is not the {meta.get('format', DEFAULT_FORMAT)!r} "
                                               "audio its KEY.json records")
        want = self.expected[key] if self.expected is not None else {"id": meta["id"],
                                                                     "wav_sha256": meta.get("wav_sha256")}
        if meta["id"] != want["id"] or item_key(meta["id"]) != key:
            raise _not_the_journals(self.path, f"{key}.json names id {meta['id']!r}; the journal wrote "
                                               f"{want['id']!r} there (another job's item, or a renamed member)")
        checksum = want.get("wav_sha256")
        if meta.get("wav_sha256") != checksum or (checksum is not None and digest != checksum):
            raise _not_the_journals(self.path, f"{key}.{ext} does not match the wav_sha256 its journal recorded: "
                                               "its audio changed after it was written",
                                    f"Delete {self.path.name} and rerun the job's `cosybatch run` command (same "
                                    "arguments) to make its items again")
        if key in self.seen:
            raise _not_the_journals(self.path, f"item {key} appears twice")
        self.seen.add(key)
        return meta

    def end(self) -> None:
        missing = sorted(set(self.expected or ()) - self.seen)
        if missing:
            raise _not_the_journals(self.path, f"{len(missing)} items its journal wrote there are not in it "
                                               f"({', '.join(missing[:3])})")


def iter_shard(path: Path, expected: Expected = None) -> Iterator[tuple[str, dict, bytes]]:
    """(key, metadata, audio bytes) for every item of one tar shard, in order (the audio member's
    format is metadata["format"], "wav" when absent: `member_name`), each checked against
    `expected` (the journal's items for this shard; without it, against the item's own KEY.json:
    its key must be its id's and its audio must match its wav_sha256). A shard that cannot be read
    to its end, or holds anything else, raises DamagedOutputError naming it."""
    pending: dict[str, dict] = {}
    check = _ShardCheck(path, expected)
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                key, ext = check.member(member)
                data = tar.extractfile(member).read()
                entry = pending.setdefault(key, {})
                entry[ext] = data
                audio = audio_of(entry)
                if audio is not None and "json" in entry:
                    del pending[key]
                    meta = check.item(key, json.loads(entry["json"]), audio[0], audio_checksum(audio[1]))
                    yield key, meta, audio[1]
    except (OSError, tarfile.TarError, ValueError, AttributeError) as exc:  # AttributeError: a non-file member
        raise _damaged(path, exc) from None
    if pending:
        raise _unpaired(path, len(pending))
    check.end()


def member_name(key: str, meta: dict) -> str:
    """The audio member's name of an item: KEY.EXT by the format its KEY.json records."""
    return f"{key}.{meta.get('format', DEFAULT_FORMAT)}"


def _damaged(path: Path, exc: Exception) -> DamagedOutputError:
    return DamagedOutputError(f"{path} is unreadable ({type(exc).__name__}: {exc}); nothing was exported. "
                              "`cosybatch verify` shows the damage; rerun the job's `cosybatch run` "
                              "to repair the folder, then export again")


REPAIR = ("Rerun the job's `cosybatch run` command (same arguments): it repairs the folder, makes those items "
          "again and moves foreign bytes to .cosybatch/quarantine/")


def _not_the_journals(path: Path, why: str, fix: str = REPAIR) -> DamagedOutputError:
    return DamagedOutputError(f"{path} does not hold what its job's journal says: {why}. Nothing was written "
                              f"from it. {fix}; then try again (`cosybatch verify` lists the damage)")


def _unpaired(path: Path, count: int) -> DamagedOutputError:
    return DamagedOutputError(f"{path} holds {count} items without both their audio and .json members; nothing "
                              "was exported. Rerun the job's `cosybatch run` to repair the folder, then export again")


def iter_members(path: Path, expected: Expected = None) -> Iterator[tuple[str, dict, int, int]]:
    """(key, metadata, offset, size) for every item of one tar shard, in order: where its audio
    member's bytes lie in the file, found from the tar headers, each item checked as `iter_shard`
    checks it (the audio is read once, to compare its checksum, never held). A shard that cannot
    be read to its end, or holds anything else, raises DamagedOutputError naming it."""
    pending: dict[str, dict] = {}
    check = _ShardCheck(path, expected)
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                key, ext = check.member(member)
                entry = pending.setdefault(key, {})
                if ext in AUDIO_EXTS:
                    digest = hashlib.sha256()
                    source = tar.extractfile(member)
                    while chunk := source.read(1 << 20):
                        digest.update(chunk)
                    entry[ext] = (member.offset_data, member.size, digest.hexdigest())
                else:
                    entry[ext] = tar.extractfile(member).read()
                audio = audio_of(entry)
                if audio is not None and "json" in entry:
                    del pending[key]
                    offset, size, checksum = audio[1]
                    yield key, check.item(key, json.loads(entry["json"]), audio[0], checksum), offset, size
    except (OSError, tarfile.TarError, ValueError, AttributeError) as exc:  # AttributeError: a non-file member
        raise _damaged(path, exc) from None
    if pending:
        raise _unpaired(path, len(pending))
    check.end()


def check_whole(root: Path) -> None:
    """Refuse a folder whose shards no longer have the sizes its journal says (the check a run
    makes at its end): an export of it would silently drop the lost items."""
    from .repair import check_sizes

    for folder in job_folders(root, "export"):
        if (folder / STATE_DIR / RAY_FAILURES_DIR).is_dir():
            continue  # a ray-run folder keeps no journal to check against
        problems = check_sizes(OutputDir(folder))
        if problems:
            raise DamagedOutputError(f"{folder} is damaged since it finished: " + "; ".join(problems)
                                     + ". Nothing was exported. Rerun the job's `cosybatch run` (same "
                                     "arguments) to repair it, then export again")


def write_into_place(dest: Path, write: Callable[[Path], None]) -> None:
    """Run write(tmp) on a fresh folder beside `dest`, then swap it in: `dest` is always either
    the earlier export or the new one, whole."""
    real_folder(dest.parent)
    for stale in dest.parent.glob(f".{dest.name}.*-*"):  # left by an export that was killed (or planted)
        _remove(stale)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    tmp.mkdir()  # a new folder: fails on anything already there, a link included
    try:
        write(tmp)
        if os.path.lexists(dest):
            os.replace(dest, old)  # a link at dest is moved aside itself, never followed
        os.replace(tmp, dest)
    finally:
        _remove(tmp)
        _remove(old)


def real_folder(path: Path) -> Path:
    """Make `path` (OUT/exports, OUT/exports/wavs) a folder if it is not there; refuse one that is
    a symbolic link or not a folder, so no export writes anywhere but inside OUT."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        what = "a symbolic link" if path.is_symlink() else "not a folder"
        raise UsageError(f"{path} is {what}; cosybatch writes exports only into a folder of its own inside "
                         "the output folder. Remove it (move the link's target aside if you want it kept), "
                         "then export again")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _remove(path: Path) -> None:
    """Delete a folder of ours, or whatever else lies at its name (a link itself, never its target)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def export(root: Path, fmt: str, require_complete: bool = True, copy: bool = False) -> Path:
    """Write one format. A run exporting its own output at the end passes require_complete=False.
    copy=True: the NeMo and Lhotse exports copy the audio members out as loose files (exports/wavs,
    KEY.wav or KEY.flac, ... by format) instead of pointing into the shards; the Hugging Face and
    Shar exports always hold the audio themselves."""
    root = Path(root)
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    folders = job_folders(root, "export")  # one job's parts, as merge requires
    real_folder(root / "exports")
    for folder in folders if require_complete else ():
        stats = folder / "stats.json"
        status = json.loads(stats.read_text()).get("status") if stats.exists() else None
        if status != "complete":
            raise UsageError(f"{folder} is not complete (status: {status or 'never finished'}); "
                             "finish the run (rerun it to resume) before exporting")
    check_whole(root)
    if fmt == "hf":
        return export_hf(root)
    if fmt == "shar":
        return export_shar(root)
    return {"nemo": export_nemo, "lhotse": export_lhotse}[fmt](root, copy=copy)


def export_hf(root: Path) -> Path:
    """One Parquet file per tar shard, with the `huggingface` schema metadata that makes
    `datasets` see the audio column as an Audio feature: each row's audio member as it is (any
    format; `datasets` decodes it from the bytes), at the items' sample rate."""

    final = root / "exports" / "hf"
    write_into_place(final, lambda tmp: _write_hf(root, tmp / "data"))
    return final


def _write_hf(root: Path, dest: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    dest.mkdir(parents=True)
    paths = shards(root)
    sample_rate = None
    # Every file gets an instruct column when the job's manifest has one (some row had an instruction).
    manifest = root / "manifest.parquet"
    names = pq.read_schema(manifest).names if manifest.exists() else []
    with_instruct = "instruct" in names
    optional = [name for name in ("speaker", "prompt", "language") if name in names]  # voice pools, languages
    with_qc = "qc_flags" in names  # the quality gate's columns, when it measured the clips
    # A worker whose shard of the corpus is empty still gets one (empty) file, so it loads.
    for n, shard in enumerate(paths or [None]):
        rows = {"audio": [], "id": [], "text": [], "duration": [], "sampling_rate": [], "voice": []}
        if with_instruct:
            rows["instruct"] = []
        rows.update({name: [] for name in optional})
        if with_qc:
            rows.update({name: [] for name, _ in QC_COLUMNS})
        for key, meta, audio in iter_shard(*shard) if shard is not None else ():
            rows["audio"].append({"bytes": audio, "path": member_name(key, meta)})
            rows["id"].append(meta["id"])
            rows["text"].append(meta["text"])
            rows["duration"].append(meta["duration"])
            rows["sampling_rate"].append(meta["sample_rate"])
            rows["voice"].append(meta["voice"])
            if with_instruct:
                rows["instruct"].append(meta.get("instruct"))
            for name in optional:
                rows[name].append(meta.get(name))
            if with_qc:
                columns = qc_columns(meta["qc"]) if isinstance(meta.get("qc"), dict) else {}
                for name, _ in QC_COLUMNS:
                    rows[name].append(columns.get(name))
            sample_rate = sample_rate or meta["sample_rate"]  # as written: after --sample-rate
        features = {
            "audio": {"_type": "Audio", "sampling_rate": sample_rate},
            "id": {"dtype": "string", "_type": "Value"},
            "text": {"dtype": "string", "_type": "Value"},
            "duration": {"dtype": "float64", "_type": "Value"},
            "sampling_rate": {"dtype": "int32", "_type": "Value"},
            "voice": {"dtype": "string", "_type": "Value"},
        }
        fields = [("audio", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("id", pa.string()),
                  ("text", pa.string()), ("duration", pa.float64()), ("sampling_rate", pa.int32()),
                  ("voice", pa.string())]
        if with_instruct:
            features["instruct"] = {"dtype": "string", "_type": "Value"}
            fields.append(("instruct", pa.string()))
        for name in optional:
            features[name] = {"dtype": "string", "_type": "Value"}
            fields.append((name, pa.string()))
        if with_qc:
            for name, kind in QC_COLUMNS:
                features[name] = {"dtype": {"bool_": "bool"}.get(kind, kind), "_type": "Value"}
                fields.append((name, getattr(pa, kind)()))
        schema = pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": features}})})
        table = pa.table(rows, schema=schema)
        pq.write_table(table, dest / f"train-{n:05d}-of-{max(len(paths), 1):05d}.parquet")


def _extract_audio(root: Path) -> list[tuple[Path, dict]]:
    """Write every item's audio member as exports/wavs/KEY.EXT (KEY.wav, KEY.flac, ...: its own bytes;
    skipping ones already there) -> [(path, meta)]."""
    loose = real_folder(real_folder(root / "exports") / LOOSE_DIR)
    out = []
    for shard, expected in shards(root):
        for key, meta, audio in iter_shard(shard, expected):  # the key is the journal's, checked, never a path
            path = loose / member_name(key, meta)
            if not _holds(path, audio):
                write_atomic(path, audio)
            out.append((path, meta))
    return out


def _holds(path: Path, data: bytes) -> bool:
    """Is `path` a regular file (not a link) holding exactly `data`?"""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode) or os.lstat(path).st_size != len(data):
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        return f.read(len(data) + 1) == data


def speaker_label(meta: dict) -> str:
    """The speaker of an item for NeMo and Lhotse: its voice, and the speaker of a multi-speaker
    voice a pool gave it (VOICE#SPEAKER)."""
    return meta["voice"] if meta.get("speaker") is None else f"{meta['voice']}#{meta['speaker']}"


def export_nemo(root: Path, copy: bool = False) -> Path:
    """NeMo's tarred audio dataset over the shards (its manifest's path), or with copy=True a
    manifest of loose audio files (exports/nemo/manifest.jsonl)."""
    dest = root / "exports" / "nemo"
    if copy:
        write_into_place(dest, lambda tmp: _write_nemo(root, dest, tmp))
        return dest / "manifest.jsonl"
    write_into_place(dest, lambda tmp: _write_nemo_tarred(root, dest, tmp))
    return dest / NEMO_TARRED_MANIFEST


NEMO_TARRED_MANIFEST = "tarred_audio_manifest.json"  # the names NeMo's convert_to_tarred_audio_dataset.py writes


def _nemo_entry(meta: dict, audio_filepath: str) -> dict:
    entry = {"audio_filepath": audio_filepath, "duration": meta["duration"], "text": meta["text"],
             "speaker": speaker_label(meta), "id": meta["id"]}
    if "instruct" in meta:
        entry["instruct"] = meta["instruct"]
    if "language" in meta:
        entry["lang"] = meta["language"]  # NeMo's key (its multilingual tokenizers read it)
    if isinstance(meta.get("qc"), dict):  # flat, as NeMo's manifest filters read fields
        entry.update(qc_columns(meta["qc"]))
    return entry


def _jsonl(entries: list[dict]) -> bytes:
    return "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode()


def _write_nemo(root: Path, dest: Path, tmp: Path) -> None:
    entries = [_nemo_entry(meta, os.path.relpath(path, dest)) for path, meta in _extract_audio(root)]
    (tmp / "manifest.jsonl").write_bytes(_jsonl(entries))


def _write_nemo_tarred(root: Path, dest: Path, tmp: Path) -> None:
    """NeMo's tarred layout, as its convert_to_tarred_audio_dataset.py writes it, over our shards:
    every entry's audio_filepath is the audio member's name in the tar (KEY.flac) and shard_id the
    shard's number N in the job (parts in order, then shards); audio_N.tar is a relative link to
    that shard, since NeMo's Lhotse reader finds a tar's shard id in its name (audio_N.tar)."""
    (tmp / "sharded_manifests").mkdir()
    everything = []
    for n, (shard, expected) in enumerate(shards(root)):
        entries = [{**_nemo_entry(meta, member_name(key, meta)), "shard_id": n}
                   for key, meta, _, _ in iter_members(shard, expected)]
        (tmp / "sharded_manifests" / f"manifest_{n}.json").write_bytes(_jsonl(entries))
        os.symlink(os.path.relpath(shard, dest), tmp / f"audio_{n}.tar")
        everything += entries
    (tmp / NEMO_TARRED_MANIFEST).write_bytes(_jsonl(everything))


def export_lhotse(root: Path, copy: bool = False) -> Path:
    dest = root / "exports" / "lhotse"
    write_into_place(dest, lambda tmp: _write_lhotse(root, tmp, copy))
    return dest


def tar_range_command(shard: Path, offset: int, size: int) -> str:
    """A shell command that writes `size` bytes of `shard` from byte `offset` (0-based) to stdout:
    POSIX tail and head, so a Lhotse `command` source reads one tar member with nothing of ours."""
    return f"tail -c +{offset + 1} {shlex.quote(str(Path(shard).resolve()))} | head -c {size}"


def _lhotse_items(root: Path, copy: bool) -> Iterator[tuple[str, dict, dict]]:
    """(recording id, its audio source, the item's metadata) for every item."""
    if copy:
        for path, meta in _extract_audio(root):
            yield path.stem, {"type": "file", "channels": [0], "source": str(path.resolve())}, meta
        return
    for shard, expected in shards(root):
        for key, meta, offset, size in iter_members(shard, expected):
            yield key, {"type": "command", "channels": [0], "source": tar_range_command(shard, offset, size)}, meta


def _write_lhotse(root: Path, dest: Path, copy: bool = False) -> None:
    recordings, supervisions = [], []
    for rec_id, source, meta in _lhotse_items(root, copy):
        recordings.append({
            "id": rec_id, "sources": [source],
            "sampling_rate": meta["sample_rate"], "num_samples": meta["num_samples"],
            "duration": meta["num_samples"] / meta["sample_rate"], "channel_ids": [0],
        })
        supervisions += lhotse_supervisions(rec_id, meta)
    for name, rows in (("recordings", recordings), ("supervisions", supervisions)):
        (dest / f"{name}.jsonl.gz").write_bytes(gzip.compress(_jsonl(rows), mtime=0))


def lhotse_supervisions(rec_id: str, meta: dict) -> list[dict]:
    """An item's Lhotse supervisions (the Lhotse and Shar exports): one for the whole clip, or one per
    piece the row was spoken as (KEY.json "segments", ids REC-0, REC-1, ...), with the speaker, the
    language, and the item's id, instruction, prompt and quality columns in `custom`."""
    duration = meta["num_samples"] / meta["sample_rate"]
    custom = {"id": meta["id"], **({"instruct": meta["instruct"]} if "instruct" in meta else {}),
              **({"prompt": meta["prompt"]} if "prompt" in meta else {}),
              **({"qc": qc_columns(meta["qc"])} if isinstance(meta.get("qc"), dict) else {})}
    common = {"recording_id": rec_id, "channel": 0, "speaker": speaker_label(meta),
              **({"language": meta["language"]} if "language" in meta else {})}
    segments = meta.get("segments") if isinstance(meta.get("segments"), list) else []
    if len(segments) < 2:  # one supervision for the whole clip
        return [{"id": rec_id, "start": 0.0, "duration": duration, "text": meta["text"], **common, "custom": custom}]
    found = []
    for i, seg in enumerate(segments):  # one per piece the row was spoken as (KEY.json "segments")
        start, end = max(0.0, seg["start"]), min(duration, seg["end"])
        found.append({"id": f"{rec_id}-{i}", "start": start, "duration": end - start, "text": seg["text"],
                      **common, "custom": {**custom, "segment": i}})
    return found


def export_shar(root: Path) -> Path:
    """Lhotse Shar under exports/shar (shar.py): a shard of cuts and one of audio per shard of the
    job, in order, each item's audio read from its shard and checked as every export checks it."""
    dest = root / "exports" / "shar"
    write_into_place(dest, lambda tmp: write_shar(tmp, (_shar_items(shard, expected)
                                                        for shard, expected in shards(root))))
    return dest


def _shar_items(shard: Path, expected: Expected) -> Iterator[tuple[str, dict, bytes, list[dict]]]:
    for key, meta, audio in iter_shard(shard, expected):
        yield key, meta, audio, lhotse_supervisions(key, meta)
