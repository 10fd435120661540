"""`cosybatch run --plan-only`: how a run will go, before it runs. The corpus is read and every row
prepared as the run would (the engine is opened: for Piper the voice's ONNX session, for CosyVoice
the whole model), the rows are admitted and planned into batches by the run's own row line
(line.py: `RowLine.windows`) and batch policy, and nothing is synthesised or written.

It says the rows, the rows that would fail before synthesis (and why, for the first few), the
pieces, the predicted audio (each piece's `Engine.estimate_seconds`, plus --sentence-silence
between a row's pieces; "unknown" when the engine gives no estimate), the batches, and, with a
throughput figure (``--rate``, or the ``audio_seconds_per_wall_second`` of a complete earlier run of
the same engine, voice and device in the same output root: its load once, then the audio at
its rate without the load), the predicted wall time. The disk
size is predicted from the audio: 16-bit PCM mono WAV members in tar shards.

The plan is that of a fresh start: a rerun over a folder that already holds committed rows does
only the rest.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from ..config import AUDIO_BITRATES, OutputConfig, RunConfig
from ..corpus import Row
from ..store.audio import coded_rate
from ..store.checkpoint import STATS_FILE
from .executor import BatchPolicy, EngineSet, expected_seconds
from .line import Admission, Reading, RowLine
from .preflight import check, open_corpus, part_config

# What a tar shard adds to an item's WAV samples: the WAV header, a 512-byte tar header per member
# (KEY.wav and KEY.json), members padded to 512 bytes, and the KEY.json itself (about 1 KiB with
# the settings, up to 2 KiB with the quality signals and segments).
WAV_HEADER_BYTES = 44
TAR_BLOCK = 512
JSON_MEMBER_BYTES = 2 * TAR_BLOCK + 2048  # its header, and the JSON padded to 512s
# The other formats' audio bytes, measured on the main job (docs/figures.md, "Audio formats and rates"): FLAC
# 0.496 of 16-bit PCM at 22050 Hz and 0.560 at 16000 Hz (the larger is taken); Opus 15.1 MB per
# audio hour at 32 kbit/s, 1.05 times its bitrate with Ogg's pages.
FLAC_OF_PCM = 0.56
OPUS_OF_BITRATE = 1.05
FAILURE_EXAMPLES = 5


class _Estimating(EngineSet):
    """The run's engines, summing each prepared row's predicted seconds."""

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.rows = 0
        self.pieces = 0
        self.seconds: Optional[float] = 0.0  # None once a piece has no estimate
        self.samples: Optional[int] = 0

    def prepare(self, row: Row, attempt: int = 0, entry=None):
        group, prepared, entry = super().prepare(row, attempt, entry)
        engine = self.by_voice[group]
        self.rows += 1
        self.pieces += len(prepared.pieces)
        if self.seconds is not None:
            clip = expected_seconds(engine, prepared.pieces, self.cfg.output.sentence_silence_s)
            if clip is None:
                self.seconds = self.samples = None
            else:
                self.seconds += clip
                rate = coded_rate(self.cfg.output.audio_format, self.cfg.output.sample_rate or engine.sample_rate)
                self.samples += round(clip * rate)
        return group, prepared, entry


def plan_only(cfg: RunConfig, rate: Optional[float] = None) -> dict:
    """`run --check`'s result plus "plan": what a run of `cfg` would do (module docstring)."""
    t0 = time.monotonic()
    checked = check(cfg)
    cfg = part_config(cfg)
    corpus = open_corpus(cfg)
    engines = _Estimating(cfg)
    t = time.monotonic()
    default = engines.get(cfg.engine.voice, from_row=False)
    open_s = time.monotonic() - t
    policy = BatchPolicy.for_engine(cfg, default)
    line = RowLine(cfg, engines, policy, gate=None)  # nothing is synthesised, so nothing is judged
    reading = Reading()
    failed, examples, batches, units = 0, [], 0, 0
    for kind, payload in line.windows(corpus, Admission(cfg), lambda: False, reading):
        if kind == "failed":
            failed += len(payload)
            examples += payload[:max(0, FAILURE_EXAMPLES - len(examples))]
            continue
        for batch in payload:  # counted, then let go: a huge corpus is planned in the memory of one window
            batches += 1
            units += len(batch.units)
            line.release(batch)
    plan: dict = {
        "rows": engines.rows + failed,
        "rows_to_synthesise": engines.rows,
        "rows_failing": failed,
        **({"failing_examples": examples} if examples else {}),
        "pieces": engines.pieces,
        "batches": batches,
        "batch_size_limit": policy.batch_size,
        "batch_budget": policy.batch_budget,
        "batch_size_mean": round(units / batches, 2) if batches else 0,
        "engine": default.name, "voice": default.voice_name, "device": default.device,
    }
    if reading.corpus_error is not None:
        plan["corpus_error"] = str(reading.corpus_error)
    if engines.seconds is None:
        plan.update(audio_seconds="unknown", audio_hours="unknown", disk_bytes="unknown")
    else:
        plan.update(audio_seconds=round(engines.seconds, 1), audio_hours=round(engines.seconds / 3600, 4),
                    disk_bytes=disk_bytes(engines.samples, engines.rows, cfg.output.shard_max_items,
                                          cfg.output, engines.seconds))
    found = {"audio_seconds_per_wall_second": rate, "from": "--rate"} if rate else earlier_rate(cfg, default)
    if found is not None:
        plan["rate"] = found
        if engines.seconds is not None:
            steady = found.get("steady_audio_seconds_per_wall_second")
            wall = (found["load_seconds"] + engines.seconds / steady if steady
                    else engines.seconds / found["audio_seconds_per_wall_second"])
            plan.update(wall_seconds=round(wall, 1), wall_hours=round(wall / 3600, 4))
    else:
        plan["rate"] = None
        plan["wall_seconds"] = "unknown: give --rate AUDIO_S_PER_S, or run a sample first into the same output root"
    plan["seconds"] = {"open_engine": round(open_s, 3), "read": round(reading.read_s, 3),
                       "prepare": round(reading.prepare_s, 3), "total": round(time.monotonic() - t0, 3)}
    return {**checked, "plan": plan}


def disk_bytes(samples: int, items: int, per_shard: int, output: Optional[OutputConfig] = None,
               seconds: float = 0.0) -> int:
    """The shards' size for `items` clips of `samples` samples (`seconds`) in all: their audio members
    (16-bit PCM WAV, or FLAC or Opus by the measured ratios above; each padded to 512 bytes, behind
    its tar header) and their KEY.json, and each shard's end."""
    fmt = output.audio_format if output is not None else "wav"
    audio = 2 * samples
    if fmt == "flac":
        audio = round(FLAC_OF_PCM * audio)
    elif fmt == "opus":
        audio = round(OPUS_OF_BITRATE * (output.bitrate or AUDIO_BITRATES["opus"]) * 1000 / 8 * seconds)
    wav = audio + items * (WAV_HEADER_BYTES + TAR_BLOCK + TAR_BLOCK // 2)  # half a block of padding, on average
    shards = max(1, -(-items // max(1, per_shard)))
    return wav + items * JSON_MEMBER_BYTES + shards * 20 * TAR_BLOCK  # tarfile pads each shard to 10 KiB records


def earlier_rate(cfg: RunConfig, engine) -> Optional[dict]:
    """The rate of the latest complete earlier run of this engine, voice and device in the output
    root (the --out folder, its siblings, and their part-* folders), or None."""
    root = cfg.output.folder.parent if cfg.output.shard_count is None else cfg.output.folder.parent.parent
    paths = {cfg.output.folder / STATS_FILE, *root.glob(f"*/{STATS_FILE}"), *root.glob(f"*/part-*/{STATS_FILE}")}
    best = None
    for path in sorted(paths):
        stats = _read(path)
        rate = stats.get("audio_seconds_per_wall_second")
        if (stats.get("status") != "complete" or not isinstance(rate, (int, float)) or rate <= 0
                or not stats.get("items_done")
                or (stats.get("engine"), stats.get("voice"), stats.get("device"))
                != (engine.name, engine.voice_name, engine.device)):
            continue
        when = stats.get("last_success_timestamp_seconds") or 0
        if best is None or when > best[0]:
            found = {"audio_seconds_per_wall_second": rate, "from": str(path.parent),
                     "audio_seconds": stats.get("audio_seconds"), "workers": stats.get("workers")}
            # The run's rate counts its model load: a small sample run's understates a big job's.
            # Without the load, the job's wall time is one load plus its audio at the rest's rate.
            load, wall, audio = (stats.get(k) for k in ("cold_start_seconds", "wall_seconds", "audio_seconds"))
            if all(isinstance(v, (int, float)) for v in (load, wall, audio)) and 0 <= load < wall and audio > 0:
                found.update(load_seconds=load, steady_audio_seconds_per_wall_second=round(audio / (wall - load), 3))
            best = (when, found)
    return best[1] if best else None


def _read(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
