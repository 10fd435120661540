"""Throughput statistics and progress reporting."""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger("cosybatch")


@dataclass(frozen=True)
class BatchWork:
    """What one batch cost the engine: the figures stats.json sums (sent from ray-run's actors too)."""

    size: int  # units in the batch
    real_frames: int = 0
    padded_frames: int = 0
    infer_s: float = 0.0
    oom_retries: int = 0  # splits in halves after running out of (GPU) memory


@dataclass
class Stats:
    """Counters for one invocation; `previous_*` carry what earlier runs of the job did."""

    started: float = field(default_factory=time.monotonic)
    items_done: int = 0
    items_failed: int = 0
    audio_s: float = 0.0
    batches: int = 0
    batch_sizes: Counter = field(default_factory=Counter)
    real_frames: int = 0
    padded_frames: int = 0
    oom_retries: int = 0  # batches split in halves after running out of (GPU) memory
    # shape: the clips' last stage (run/shaping.py: rate, trimmed ends, level, encoding)
    stage_s: dict = field(default_factory=lambda: dict.fromkeys(
        ("load", "read", "prepare", "infer", "shape", "qc", "write"), 0.0))
    qc: Optional[dict] = None  # the quality gate's summary (cosybatch.qc.gate.QCCounts.summary)
    previous_items_done: int = 0
    previous_items_failed: int = 0
    previous_audio_s: float = 0.0

    def add_batch(self, work: BatchWork) -> None:
        """One batch the engine ran (the run's own and the quality gate's retakes alike)."""
        self.batches += 1
        self.batch_sizes[work.size] += 1
        self.real_frames += work.real_frames
        self.padded_frames += work.padded_frames
        self.oom_retries += work.oom_retries
        self.stage_s["infer"] += work.infer_s

    def wall_s(self) -> float:
        return time.monotonic() - self.started

    def to_dict(self, **extra) -> dict:
        wall = self.wall_s()
        sizes = sorted(self.batch_sizes.elements())
        return {
            "items_done": self.items_done,
            "items_failed": self.items_failed,
            "audio_seconds": round(self.audio_s, 3),
            "wall_seconds": round(wall, 3),
            "audio_seconds_per_wall_second": round(self.audio_s / wall, 3) if wall > 0 else None,
            "items_per_second": round(self.items_done / wall, 3) if wall > 0 else None,
            # Share of computed output frames that were padding (0 = none).
            "padding_ratio": round(1 - self.real_frames / self.padded_frames, 4) if self.padded_frames else 0.0,
            "batches": self.batches,
            "batch_size_mean": round(sum(sizes) / len(sizes), 2) if sizes else 0,
            "batch_size_max": sizes[-1] if sizes else 0,
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "oom_retries": self.oom_retries,
            # infer is summed over workers, so it can exceed wall time when workers overlap.
            "stage_seconds": {k: round(v, 3) for k, v in self.stage_s.items()},
            "job_totals": {
                "items_done": self.previous_items_done + self.items_done,
                "items_failed": self.previous_items_failed + self.items_failed,
                "audio_seconds": round(self.previous_audio_s + self.audio_s, 3),
            },
            **({"qc": self.qc} if self.qc is not None else {}),
            **extra,
        }


class Progress:
    """A tqdm bar on a terminal; plain periodic log lines otherwise (cron, Airflow, CI)."""

    def __init__(self, total: Optional[int], initial: int, mode: str = "auto", every_s: float = 30.0):
        if mode == "auto":
            # A bar only for a person at a terminal; any redirection (cron, Airflow, `| tee`) gets
            # plain log lines that read well in a file.
            mode = "bar" if sys.stdout.isatty() and sys.stderr.isatty() else "log"
        self.mode = mode
        self.total = total
        self.initial = initial
        self.count = initial
        self.retakes = 0  # rows the quality gate had made again
        self.audio_s = 0.0
        self.every_s = every_s
        self.started = time.monotonic()
        self._last_log = self.started
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="item", dynamic_ncols=True, file=sys.stderr)

    def update(self, items: int, audio_s: float) -> None:
        self.count += items
        self.audio_s += audio_s
        now = time.monotonic()
        rate = self.audio_s / max(now - self.started, 1e-9)
        if self._bar is not None:
            self._bar.update(items)
            retakes = f", {self.retakes} retakes" if self.retakes else ""
            self._bar.set_postfix_str(f"{rate:.1f} audio-s/s{retakes}", refresh=False)
        elif self.mode == "log" and now - self._last_log >= self.every_s:
            self._last_log = now
            self.log_line(rate)

    def log_line(self, rate: float) -> None:
        elapsed = time.monotonic() - self.started
        done = f"{self.count}/{self.total}" if self.total else str(self.count)
        eta = ""
        if self.total and self.count:
            per_item = elapsed / max(self.count - self.initial, 1)
            eta = f", eta {max(self.total - self.count, 0) * per_item:.0f}s"
        retakes = f", {self.retakes} qc retakes" if self.retakes else ""
        log.info("progress: %s items, %.1f audio-s/s%s%s", done, rate, retakes, eta)

    def retake(self, rows: int) -> None:
        """The quality gate makes `rows` rows again (shown beside the rate)."""
        self.retakes += rows

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def failure_summary(failed: int, rows: int, limit: Optional[str]) -> str:
    """'2 of 45 rows failed (4.4%), more than 2%': the share and the limit as given."""
    share = 100 * failed / max(rows, 1)
    return f"{failed} of {rows} rows failed ({share:.1f}%), more than {(limit or '').strip()} (--max-failures)"
