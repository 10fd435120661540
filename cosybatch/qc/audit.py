"""`cosybatch qc OUT`: score a finished folder with the quality gate's signals (and ASR), writing
OUT/qc.parquet and OUT/report.html beside the manifest, without touching the shards; and the
audit page a run writes at its end, from its manifest.

The audit judges as `--qc gate` does (as `--qc asr` with --asr), by the same gate object: the
same signals, the pace against each voice's clips in shard order (and the expectation each clip's
run recorded), the same hearing and limits.

What the page reads back from the folder (the manifest, stats.json, the journal, the shards its
clips come from) is opened as store/readback.py says: never through a link at the name, never
waiting on a FIFO, only regular files, and a clip embedded only up to CLIP_CAP bytes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tarfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Optional

from ..store.audio import audio_member, decode
from ..store.checkpoint import MANIFEST_FILE, RUN_FILE, STATE_DIR, STATS_FILE, atomic_file
from ..store.distributed import output_dirs
from ..store.exports import iter_shard, shards
from ..store.items import qc_columns
from ..store.readback import NotReadable, open_regular, read_json
from ..store.tables import read_parquet
from .gate import QCSettings

log = logging.getLogger("cosybatch")

QC_FILE = "qc.parquet"
REPORT_FILE = "report.html"
CLIP_CAP = 16 << 20  # the largest WAV the page embeds (about 6 minutes at 22050 Hz); a larger one is named
JOURNAL_LINE_CAP = 16 << 20  # a longer journal line is skipped, not read whole
SIGNAL_COLUMNS = ("lead_s", "tail_s", "gap_s", "speech_s", "speech_share", "units", "s_per_unit", "peak_db",
                  "rms_db", "clipped", "flatness", "expected_s", "pace")


def audit(root: Path, settings: QCSettings, transcriber=None, seed: int = 0, report: bool = True) -> dict:
    """Score every clip under `root` (a job folder, one part, or a sharded job's root); write
    ROOT/qc.parquet (and ROOT/report.html). Returns the summary. The clips are judged by the run's
    own gate (`QualityGate.verdicts`), on the samples as written."""

    from .takes import Clip, QualityGate

    root = Path(root)
    paths = shards(root, "score")  # one job's parts, as merge requires, each shard with its journal's items
    gate = QualityGate(replace(settings, retries=0), seed, 0.0, transcriber)  # a finished clip has no retake
    rows: list[dict] = []
    for shard, expected in paths:
        clips: list[Clip] = []
        silences: list[float] = []
        for key, meta, data in iter_shard(shard, expected):  # the journal's key, id and checksum, checked
            audio, rate = decode(data)
            made = meta.get("qc") if isinstance(meta.get("qc"), dict) else {}
            voice = meta.get("voice") or ""
            row = {"id": meta["id"], "key": key, "shard": str(shard.relative_to(root)), "voice": voice,
                   "text": meta["text"], "duration_s": meta["duration"]}
            rows.append(row)
            clips.append(Clip(row, meta["id"], len(rows), meta["text"], voice, rate, audio=audio, raw=[audio],
                              lm=made.get("lm"), language=meta.get("language"),
                              expected_s=_positive((made.get("signals") or {}).get("expected_s"))))
            silences.append(_positive((meta.get("settings") or {}).get("sentence_silence")) or 0.0)
        # A job's clips share one --sentence-silence; clips of folders merged from other runs may not.
        for silence in sorted(set(silences)):
            group = [c for c, s in zip(clips, silences, strict=True) if s == silence]
            gate.sentence_silence = silence
            for clip, record in zip(group, gate.verdicts(group), strict=True):
                row = clip.ref
                row.update(qc_columns(record))
                row.update({name: record["signals"].get(name) for name in SIGNAL_COLUMNS})
                row["lm_stop"] = (record.get("lm") or {}).get("stop")
                row["reason"] = record.get("reason")
                asr = record.get("asr") or {}
                for name in ("worst", "beyond_s", "stretch_s"):
                    if asr.get(name) is not None:
                        row[f"qc_{name}"] = asr[name]
                if asr.get("words"):
                    row["words"] = json.dumps(asr["words"], ensure_ascii=False)
    _write_table(root / QC_FILE, rows)
    summary = _summary(rows, settings)
    summary["calibration"] = gate.calibration.report(settings.limits)
    if report:
        write_job_report(root, rows, summary, seed)
    return summary


def _positive(value) -> Optional[float]:
    """A positive finite number from a KEY.json field, or None."""
    return float(value) if _number(value) and value > 0 else None


def _write_table(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows) if rows else pa.table({"id": pa.array([], pa.string())})
    with atomic_file(path) as f:  # never through a link planted at .qc.parquet.tmp
        pq.write_table(table, f)


def _summary(rows: list[dict], settings: QCSettings) -> dict:
    flagged = [r for r in rows if r.get("qc_flags")]
    counts: dict = {}
    for r in flagged:
        for f in r["qc_flags"].split(","):
            counts[f] = counts.get(f, 0) + 1
    cers = [r["qc_cer"] for r in rows if r.get("qc_cer") is not None]
    supports = [r["qc_support"] for r in rows if r.get("qc_support") is not None]
    hours = round(sum(r["duration_s"] for r in rows) / 3600, 4)
    return {"mode": settings.mode, "clips": len(rows), "hours": hours,
            "passed": sum(1 for r in rows if r.get("qc_pass")),
            "failed": sum(1 for r in rows if r.get("qc_pass") is False),
            "flagged": len(flagged), "flags": dict(sorted(counts.items())), "transcribed": len(cers) + len(supports),
            "support_mean": round(sum(supports) / len(supports), 4) if supports else None,
            "cer_mean": round(sum(cers) / len(cers), 4) if cers else None}


# -- the audit page ------------------------------------------------------------------------------
def _clips(root: Path, rows: list[dict]):
    """id -> the audio member's bytes (any format: store/audio.py), read from the shard on demand."""
    where = {r["id"]: (r["shard"], r["key"]) for r in rows}

    def clip(item_id: str) -> bytes:
        shard, key = where[item_id]
        with open_regular(root / shard) as f, tarfile.open(fileobj=f) as tar:
            member = audio_member(tar, key)
            if member is None:
                raise NotReadable(f"{shard} holds no audio member of {key}")
            if not member.isfile():
                raise NotReadable(f"{member.name} in {shard} is not a file")
            if member.size > CLIP_CAP:
                raise NotReadable(f"{member.name} in {shard} is {member.size:,} bytes, more than the {CLIP_CAP:,} "
                                  "the page embeds")
            return tar.extractfile(member).read()

    return clip


def _throughput(root: Path) -> tuple[list[tuple[float, float]], Optional[tuple[float, float]]]:
    """The throughput plot's points and the run's rate, from the journal(s), run.json and stats.json.

    Points: (seconds since the job started, audio seconds committed by then). The start is the
    earliest part's run.json "started" (the last run's start: what a resumed job committed before
    it is the line's starting amount), else the first commit. Rate: (audio seconds, wall seconds)
    of the last run, from stats.json (a job folder's; for a sharded job's root, its parts' audio
    over the span from the first part's start to the last part's end); None when not recorded.
    Not from the first commit: a run whose first commit comes late would show many times its rate."""
    commits: list[tuple[float, float]] = []
    starts: list[float] = []
    ends: list[float] = []
    run_audio = 0.0
    for folder in output_dirs(root):
        started = read_json(folder / STATE_DIR / RUN_FILE).get("started")
        started = float(started) if _number(started) else None
        stats = read_json(folder / STATS_FILE)
        if started is not None:
            starts.append(started)
            if _number(stats.get("wall_seconds")) and _number(stats.get("audio_seconds")):
                ends.append(started + float(stats["wall_seconds"]))
                run_audio += float(stats["audio_seconds"])
        journal = folder / STATE_DIR / "journal.jsonl"
        if not os.path.lexists(journal):
            continue
        try:
            records = list(_journal_records(journal))
        except OSError as exc:  # NotReadable included: the page goes without the plot
            log.warning("throughput not plotted: %s", exc)
            continue
        for rec in records:
            if rec.get("t") == "items" and _number(rec.get("ts")):
                commits.append((float(rec["ts"]), sum(i.get("duration_s", 0.0) for i in rec.get("items", ()))))
    commits.sort()
    rate = None
    stats = read_json(root / STATS_FILE)
    if _number(stats.get("wall_seconds")) and _number(stats.get("audio_seconds")) and stats["wall_seconds"] > 0:
        rate = (float(stats["audio_seconds"]), float(stats["wall_seconds"]))
    elif starts and ends and len(ends) == len(starts) and max(ends) > min(starts):
        rate = (run_audio, max(ends) - min(starts))
    if not commits:
        return [], rate
    t0 = min(starts) if starts else commits[0][0]
    before = sum(audio for ts, audio in commits if ts < t0)  # a resumed job's earlier runs
    total, points = before, [(0.0, before)]
    for ts, audio in commits:
        if ts >= t0:
            total += audio
            points.append((ts - t0, total))
    return points, rate


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _journal_records(path: Path):
    """The journal's records (dicts), a line at a time; a line that is not JSON, or longer than
    JOURNAL_LINE_CAP, is skipped."""
    with open_regular(path) as f:
        while line := f.readline(JOURNAL_LINE_CAP + 1):
            if len(line) > JOURNAL_LINE_CAP:
                while line and not line.endswith(b"\n"):  # the rest of the long line
                    line = f.readline(JOURNAL_LINE_CAP + 1)
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield rec


def write_job_report(root: Path, rows: Optional[list[dict]] = None, summary: Optional[dict] = None,
                     seed: int = 0, clip: Optional[Callable[[str], bytes]] = None) -> Optional[Path]:
    """ROOT/report.html from `rows` (an audit's), or from the manifest's qc columns (a run's end).
    `clip`: id -> its audio member's bytes, where the shards are not in ROOT (a job in object
    storage); by default they are read from ROOT's shards. Returns its path, or None when the
    folder holds no measured clip."""
    from .report import write_report

    root = Path(root)
    if rows is None:
        manifest = root / MANIFEST_FILE
        if not os.path.lexists(manifest):
            return None
        with open_regular(manifest) as f:  # a link or a FIFO is refused (NotReadable), not read
            rows = read_parquet(f).to_pylist()
        if rows and "qc_flags" not in rows[0]:
            return None
        summary = summary or read_json(root / STATS_FILE).get("qc") or {}
    for r in rows:
        r["qc_flags"] = [f for f in (r.get("qc_flags") or "").split(",") if f] if isinstance(
            r.get("qc_flags"), (str, type(None))) else r["qc_flags"]
        r["units"] = r.get("units") or r.get("qc_units") or len([c for c in r.get("text", "") if c.isalnum()])
        r["qc_attempts"] = r.get("qc_attempts") or 1
        r["qc_score"] = r.get("qc_score") or 0.0
    path = root / REPORT_FILE
    points, rate = _throughput(root)
    write_report(path, rows, summary or {}, clip or _clips(root, rows), seed=seed, throughput=points, rate=rate,
                 title=f"cosybatch report: {root.name}")
    return path

