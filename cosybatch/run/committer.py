"""The writer side of a run: one thread that commits finished batches in plan order.

A batch's rows are rendered and appended to the open shard, the shard is fsynced, then one
fsynced journal line records the shard's new length and the items; failures get their own line.
A shard closes (end-of-archive blocks, fsync, rename) once it is full. Nothing else writes to the
shards or the journal while a run goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Optional

from ..config import RunConfig
from ..metrics import BatchHistogram
from ..stats import Progress, Stats, failure_summary
from ..store.checkpoint import FAILURES_FILE, Journal, ResumeState
from ..store.shards import ShardWriter
from .executor import Outcome, RowAssembler
from .finish import RowFinisher

log = logging.getLogger("cosybatch")

DONE = object()  # put on a queue: no more work


class Committer:
    def __init__(self, cfg: RunConfig, journal: Journal, state: ResumeState, stats: Stats, progress: Progress,
                 assembler: RowAssembler, finisher: RowFinisher, stop: threading.Event,
                 uncommitted: threading.Semaphore, after_commit: Callable[[], None]):
        self.cfg, self.journal, self.stats, self.progress = cfg, journal, stats, progress
        self.assembler, self.finisher, self.stop, self.uncommitted = assembler, finisher, stop, uncommitted
        self.after_commit = after_commit
        self.shard = ShardWriter(cfg.out, state.open_shard, state.open_offset, state.open_items) \
            if state.open_shard is not None else None
        self.next_shard = state.next_shard
        self.max_failed = cfg.failure_limit()[0]
        self.too_many_failures = False
        self.batch_seconds = BatchHistogram()
        self.error: Optional[BaseException] = None  # what ended the writer early, for the main thread

    def loop(self, results: queue.Queue, on_write_error: Callable[[OSError], BaseException]) -> None:
        """The writer thread: commit batches in plan order as they arrive, failures at once."""
        pending: dict[int, Outcome] = {}
        next_seq = 0
        try:
            while True:
                msg = results.get()
                if msg is DONE:
                    break
                kind, payload = msg
                if kind == "failed":
                    self.commit_failures(payload)
                    continue
                pending[payload.batch.seq] = payload
                while next_seq in pending:
                    self.commit_batch(pending.pop(next_seq))
                    self.uncommitted.release()
                    next_seq += 1
            # Interrupted: batches after a dropped one still hold finished rows worth keeping.
            for seq in sorted(pending):
                self.commit_batch(pending.pop(seq))
                self.uncommitted.release()
        except OSError as exc:
            # Nothing after the last commit counts; a rerun truncates it away.
            self.error = on_write_error(exc)
            self.stop.set()
        except BaseException as exc:
            self.error = exc
            self.stop.set()

    def commit_failures(self, failures: list[dict]) -> None:
        self.journal.append({"t": "failed", "ts": round(time.time(), 3), "items": failures})
        self.stats.items_failed += len(failures)
        self.progress.update(len(failures), 0.0)
        total_failed = self.stats.previous_items_failed + self.stats.items_failed
        if self.max_failed is not None and total_failed > self.max_failed and not self.too_many_failures:
            rows = self.stats.previous_items_done + self.stats.items_done + total_failed
            log.error("%s: stopping; see %s", failure_summary(total_failed, rows, self.cfg.max_failures),
                      self.cfg.out / FAILURES_FILE)
            self.too_many_failures = True
            self.stop.set()

    def account(self, outcome: Outcome) -> None:
        """A batch's work in the statistics (the run's batches and the quality gate's retakes)."""
        stats = self.stats
        stats.batches += 1
        stats.batch_sizes[len(outcome.batch.units)] += 1
        stats.real_frames += outcome.real_frames
        stats.padded_frames += outcome.padded_frames
        stats.oom_retries += outcome.oom_retries
        stats.stage_s["infer"] += outcome.infer_s
        self.batch_seconds.observe(outcome.infer_s)

    def commit_batch(self, outcome: Outcome) -> None:
        t = time.monotonic()
        stats = self.stats
        self.account(outcome)
        qc_s = self.finisher.seconds
        rendered, failures = self.finisher.finish(self.assembler.take(outcome))
        qc_s = self.finisher.seconds - qc_s
        stats.stage_s["qc"] += qc_s
        items = []
        mtime = int(time.time())
        for key, members, record in rendered:
            if self.shard is None:
                self.shard = ShardWriter(self.cfg.out, self.next_shard)
                self.next_shard += 1
            self.shard.add(key, members, mtime)
            items.append(record)
        if items:
            end = self.shard.commit()
            self.journal.append({"t": "items", "ts": round(time.time(), 3), "shard": self.shard.index,
                                 "end": end, "items": items})
            stats.items_done += len(items)
            audio_s = sum(i["duration_s"] for i in items)
            stats.audio_s += audio_s
            self.progress.update(len(items), audio_s)
        if failures:
            self.commit_failures(failures)
        if self.shard is not None and (self.shard.items >= self.cfg.shard_max_items
                                       or self.shard.offset >= self.cfg.shard_max_bytes):
            self.close_shard()
        stats.stage_s["write"] += time.monotonic() - t - qc_s
        self.after_commit()

    def close_shard(self) -> None:
        index, items = self.shard.index, self.shard.items
        self.shard.close()
        self.journal.append({"t": "closed", "shard": index, "items": items})
        self.shard = None

    def finish(self, interrupted: bool) -> None:
        """Close the open shard when the run is done; leave it for the resume when not."""
        if self.shard is not None and not interrupted:
            self.close_shard()
        elif self.shard is not None:
            self.shard.abandon()
        self.journal.close()
