"""Dataset formats besides the WebDataset shards: Hugging Face `datasets` Parquet (Audio feature),
a NeMo manifest and Lhotse manifests, written from a finished output folder (one worker's, or a
sharded job's root holding part-* folders).

    OUT/exports/hf/data/train-00000-of-00003.parquet   audio {bytes, path} + id, text, duration, ..., qc_*
    OUT/exports/wavs/KEY.wav                           plain WAV files, for NeMo and Lhotse
    OUT/exports/nemo/manifest.jsonl                    audio_filepath relative to the manifest
    OUT/exports/lhotse/{recordings,supervisions}.jsonl.gz  absolute paths (Lhotse resolves from CWD)

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
import shutil
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import DamagedOutputError, UsageError
from ..qc.gate import QC_COLUMNS, qc_columns
from .checkpoint import RAY_FAILURES_DIR, STATE_DIR, OutputDir, write_atomic
from .distributed import output_dirs

FORMATS = ("hf", "nemo", "lhotse")


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
        raise DamagedOutputError(f"{path} is unreadable ({type(exc).__name__}: {exc}); nothing was exported. "
                                 "`cosybatch verify` shows the damage; rerun the job's `cosybatch run` "
                                 "to repair the folder, then export again") from None
    if pending:
        raise DamagedOutputError(f"{path} holds {len(pending)} items without both their .wav and .json "
                                 "members; nothing was exported. Rerun the job's `cosybatch run` to repair "
                                 "the folder, then export again")


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


def export(root: Path, fmt: str, require_complete: bool = True) -> Path:
    """Write one format. A run exporting its own output at the end passes require_complete=False."""
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
    return {"hf": export_hf, "nemo": export_nemo, "lhotse": export_lhotse}[fmt](root)


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


def export_nemo(root: Path) -> Path:
    dest = root / "exports" / "nemo"
    write_into_place(dest, lambda tmp: _write_nemo(root, dest, tmp))
    return dest / "manifest.jsonl"


def _write_nemo(root: Path, dest: Path, tmp: Path) -> None:
    lines = []
    for path, meta in _extract_wavs(root):
        entry = {"audio_filepath": os.path.relpath(path, dest), "duration": meta["duration"],
                 "text": meta["text"], "speaker": speaker_label(meta), "id": meta["id"]}
        if "instruct" in meta:
            entry["instruct"] = meta["instruct"]
        if "language" in meta:
            entry["lang"] = meta["language"]  # NeMo's key (its multilingual tokenizers read it)
        if isinstance(meta.get("qc"), dict):  # flat, as NeMo's manifest filters read fields
            entry.update(qc_columns(meta["qc"]))
        lines.append(json.dumps(entry, ensure_ascii=False))
    (tmp / "manifest.jsonl").write_bytes("".join(line + "\n" for line in lines).encode())


def export_lhotse(root: Path) -> Path:
    dest = root / "exports" / "lhotse"
    write_into_place(dest, lambda tmp: _write_lhotse(root, tmp))
    return dest


def _write_lhotse(root: Path, dest: Path) -> None:
    recordings, supervisions = [], []
    for path, meta in _extract_wavs(root):
        rec_id = path.stem
        recordings.append({
            "id": rec_id,
            "sources": [{"type": "file", "channels": [0], "source": str(path.resolve())}],
            "sampling_rate": meta["sample_rate"], "num_samples": meta["num_samples"],
            "duration": meta["num_samples"] / meta["sample_rate"], "channel_ids": [0],
        })
        supervisions.append({
            "id": rec_id, "recording_id": rec_id, "start": 0.0,
            "duration": meta["num_samples"] / meta["sample_rate"], "channel": 0, "text": meta["text"],
            "speaker": speaker_label(meta), **({"language": meta["language"]} if "language" in meta else {}),
            "custom": {"id": meta["id"], **({"instruct": meta["instruct"]} if "instruct" in meta else {}),
                       **({"prompt": meta["prompt"]} if "prompt" in meta else {}),
                       **({"qc": qc_columns(meta["qc"])} if isinstance(meta.get("qc"), dict) else {})},
        })
    for name, rows in (("recordings", recordings), ("supervisions", supervisions)):
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
        (dest / f"{name}.jsonl.gz").write_bytes(gzip.compress(data, mtime=0))
