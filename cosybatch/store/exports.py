"""Dataset formats besides the WebDataset shards: Hugging Face `datasets` Parquet (Audio feature),
NeMo and Lhotse manifests, written from a finished output folder (one worker's, or a sharded job's
root holding part-* folders).

    OUT/exports/hf/data/train-00000-of-00003.parquet   audio {bytes, path} + id, text, duration, ..., qc_*
    OUT/exports/nemo/tarred_audio_manifest.json        NeMo tarred audio: audio_filepath KEY.wav, shard_id N
    OUT/exports/nemo/sharded_manifests/manifest_N.json the same, one file per shard
    OUT/exports/nemo/audio_N.tar                       links to the shards (NeMo finds shard N by this name)
    OUT/exports/lhotse/{recordings,supervisions}.jsonl.gz  each recording a byte range of a shard

The NeMo and Lhotse exports point into the tar shards and copy no audio: NeMo's tarred datasets
read the shards themselves (the KEY.json members beside each KEY.wav are not audio: NeMo's
webdataset reader groups them with the WAV and ignores them; its Lhotse reader needs
`skip_missing_manifest_entries`), and each Lhotse recording is a `command` source that reads the
WAV member's byte range out of its shard (`tail -c +OFFSET SHARD | head -c SIZE`), which
`load_audio()` runs as it runs any command source. Lhotse Shar cannot point at our shards: its
reader takes each tar's JSON member for a Lhotse manifest of the audio beside it, so Shar would be
a second copy of every clip. With `copy=True` (`cosybatch export --copy`) they copy the audio out
as loose files instead, for tools that need them:

    OUT/exports/wavs/KEY.wav                           plain WAV files, shared by both
    OUT/exports/nemo/manifest.jsonl                    audio_filepath relative to the manifest
    OUT/exports/lhotse/{recordings,supervisions}.jsonl.gz  absolute paths (Lhotse resolves from CWD);
                                                       a supervision per segment (KEY.json "segments")

An export first checks the folder as `cosybatch status` does (every shard has the size its journal
says): a folder that lost a shard after it finished is refused, never exported short. Each format
is written into `exports/.FMT.tmp-PID/` and renamed into place when whole, so a failed export
leaves the earlier one as it was and never half of a new one. (The WAV files under exports/wavs
are shared by NeMo and Lhotse and each is written whole, by rename, on its own.)
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import shutil
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import DamagedOutputError, UsageError
from .checkpoint import RAY_FAILURES_DIR, STATE_DIR, OutputDir, write_atomic
from .distributed import output_dirs
from .items import QC_COLUMNS, qc_columns

FORMATS = ("hf", "nemo", "lhotse")
COPYING = ("nemo", "lhotse")  # the formats that point into the shards, or copy the audio out with copy=True


def shards(root: Path) -> list[Path]:
    folders = output_dirs(root)
    if not folders:
        raise UsageError(f"{root} holds no cosybatch job to export (run the job first)")
    return [s for d in folders for s in sorted(d.glob("shard-*.tar"))]


def iter_shard(path: Path) -> Iterator[tuple[str, dict, bytes]]:
    """(key, metadata, wav bytes) for every item of one tar shard, in order. A shard that cannot
    be read to its end raises DamagedOutputError naming it."""
    pending: dict[str, dict] = {}
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                data = tar.extractfile(member).read()
                entry = pending.setdefault(key, {})
                entry[ext] = data
                if "wav" in entry and "json" in entry:
                    del pending[key]
                    yield key, json.loads(entry["json"]), entry["wav"]
    except (OSError, tarfile.TarError, ValueError, AttributeError) as exc:  # AttributeError: a non-file member
        raise _damaged(path, exc) from None
    if pending:
        raise _unpaired(path, len(pending))


def _damaged(path: Path, exc: Exception) -> DamagedOutputError:
    return DamagedOutputError(f"{path} is unreadable ({type(exc).__name__}: {exc}); nothing was exported. "
                              "`cosybatch verify` shows the damage; rerun the job's `cosybatch run` "
                              "to repair the folder, then export again")


def _unpaired(path: Path, count: int) -> DamagedOutputError:
    return DamagedOutputError(f"{path} holds {count} items without both their .wav and .json members; nothing "
                              "was exported. Rerun the job's `cosybatch run` to repair the folder, then export again")


def iter_members(path: Path) -> Iterator[tuple[str, dict, int, int]]:
    """(key, metadata, offset, size) for every item of one tar shard, in order: where its WAV
    member's bytes lie in the file, found from the tar headers without reading the audio. A shard
    that cannot be read to its end raises DamagedOutputError naming it."""
    pending: dict[str, dict] = {}
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                key, _, ext = member.name.partition(".")
                entry = pending.setdefault(key, {})
                if ext == "wav":
                    if not member.isfile():
                        raise ValueError(f"member {member.name} is not a plain file")
                    entry["wav"] = (member.offset_data, member.size)
                else:
                    entry[ext] = tar.extractfile(member).read()
                if "wav" in entry and "json" in entry:
                    del pending[key]
                    yield key, json.loads(entry["json"]), *entry["wav"]
    except (OSError, tarfile.TarError, ValueError, AttributeError) as exc:  # AttributeError: a non-file member
        raise _damaged(path, exc) from None
    if pending:
        raise _unpaired(path, len(pending))


def check_whole(root: Path) -> None:
    """Refuse a folder whose shards no longer have the sizes its journal says (the check a run
    makes at its end): an export of it would silently drop the lost items."""
    from .repair import check_sizes

    for folder in output_dirs(root):
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
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".{dest.name}.*-*"):  # left by an export that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    tmp.mkdir()
    try:
        write(tmp)
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def export(root: Path, fmt: str, require_complete: bool = True, copy: bool = False) -> Path:
    """Write one format. A run exporting its own output at the end passes require_complete=False.
    copy=True: the NeMo and Lhotse exports copy the audio out as loose WAV files (exports/wavs)
    instead of pointing into the shards; the Hugging Face export always holds the audio itself."""
    root = Path(root)
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    for folder in output_dirs(root) if require_complete else ():
        stats = folder / "stats.json"
        status = json.loads(stats.read_text()).get("status") if stats.exists() else None
        if status != "complete":
            raise UsageError(f"{folder} is not complete (status: {status or 'never finished'}); "
                             "finish the run (rerun it to resume) before exporting")
    check_whole(root)
    if fmt == "hf":
        return export_hf(root)
    return {"nemo": export_nemo, "lhotse": export_lhotse}[fmt](root, copy=copy)


def export_hf(root: Path) -> Path:
    """One Parquet file per tar shard, with the `huggingface` schema metadata that makes
    `datasets` see the audio column as an Audio feature."""

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
        for key, meta, wav in iter_shard(shard) if shard is not None else ():
            rows["audio"].append({"bytes": wav, "path": f"{key}.wav"})
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
            sample_rate = sample_rate or meta["sample_rate"]
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


def _extract_wavs(root: Path) -> list[tuple[Path, dict]]:
    """Write every item as exports/wavs/KEY.wav (skipping ones already there) -> [(path, meta)]."""
    wavs = root / "exports" / "wavs"
    wavs.mkdir(parents=True, exist_ok=True)
    out = []
    for shard in shards(root):
        for key, meta, wav in iter_shard(shard):
            path = wavs / f"{key}.wav"
            if not path.exists() or path.stat().st_size != len(wav):
                write_atomic(path, wav)
            out.append((path, meta))
    return out


def speaker_label(meta: dict) -> str:
    """The speaker of an item for NeMo and Lhotse: its voice, and the speaker of a multi-speaker
    voice a pool gave it (VOICE#SPEAKER)."""
    return meta["voice"] if meta.get("speaker") is None else f"{meta['voice']}#{meta['speaker']}"


def export_nemo(root: Path, copy: bool = False) -> Path:
    """NeMo's tarred audio dataset over the shards (its manifest's path), or with copy=True a
    manifest of loose WAV files (exports/nemo/manifest.jsonl)."""
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
    entries = [_nemo_entry(meta, os.path.relpath(path, dest)) for path, meta in _extract_wavs(root)]
    (tmp / "manifest.jsonl").write_bytes(_jsonl(entries))


def _write_nemo_tarred(root: Path, dest: Path, tmp: Path) -> None:
    """NeMo's tarred layout, as its convert_to_tarred_audio_dataset.py writes it, over our shards:
    every entry's audio_filepath is the WAV member's name in the tar (KEY.wav) and shard_id the
    shard's number N in the job (parts in order, then shards); audio_N.tar is a relative link to
    that shard, since NeMo's Lhotse reader finds a tar's shard id in its name (audio_N.tar)."""
    (tmp / "sharded_manifests").mkdir()
    everything = []
    for n, shard in enumerate(shards(root)):
        entries = [{**_nemo_entry(meta, f"{key}.wav"), "shard_id": n} for key, meta, _, _ in iter_members(shard)]
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
        for path, meta in _extract_wavs(root):
            yield path.stem, {"type": "file", "channels": [0], "source": str(path.resolve())}, meta
        return
    for shard in shards(root):
        for key, meta, offset, size in iter_members(shard):
            yield key, {"type": "command", "channels": [0], "source": tar_range_command(shard, offset, size)}, meta


def _write_lhotse(root: Path, dest: Path, copy: bool = False) -> None:
    recordings, supervisions = [], []
    for rec_id, source, meta in _lhotse_items(root, copy):
        recordings.append({
            "id": rec_id, "sources": [source],
            "sampling_rate": meta["sample_rate"], "num_samples": meta["num_samples"],
            "duration": meta["num_samples"] / meta["sample_rate"], "channel_ids": [0],
        })
        duration = meta["num_samples"] / meta["sample_rate"]
        custom = {"id": meta["id"], **({"instruct": meta["instruct"]} if "instruct" in meta else {}),
                  **({"prompt": meta["prompt"]} if "prompt" in meta else {}),
                  **({"qc": qc_columns(meta["qc"])} if isinstance(meta.get("qc"), dict) else {})}
        common = {"recording_id": rec_id, "channel": 0, "speaker": speaker_label(meta),
                  **({"language": meta["language"]} if "language" in meta else {})}
        segments = meta.get("segments") if isinstance(meta.get("segments"), list) else []
        if len(segments) < 2:  # one supervision for the whole clip
            supervisions.append({"id": rec_id, "start": 0.0, "duration": duration, "text": meta["text"], **common,
                                 "custom": custom})
            continue
        for i, seg in enumerate(segments):  # one per piece the row was spoken as (KEY.json "segments")
            start, end = max(0.0, seg["start"]), min(duration, seg["end"])
            supervisions.append({"id": f"{rec_id}-{i}", "start": start, "duration": end - start, "text": seg["text"],
                                 **common, "custom": {**custom, "segment": i}})
    for name, rows in (("recordings", recordings), ("supervisions", supervisions)):
        (dest / f"{name}.jsonl.gz").write_bytes(gzip.compress(_jsonl(rows), mtime=0))
