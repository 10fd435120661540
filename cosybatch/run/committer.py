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
from ..store.checkpoint import Journal, ResumeState
from ..store.shards import ShardWriter
from .executor import Outcome
from .line import RowLine
from .runner import Committed

log = logging.getLogger("cosybatch")

DONE = object()  # put on a queue: no more work


class Committer:
    def __init__(self, cfg: RunConfig, journal: Journal, state: ResumeState, line: RowLine,
                 report: Callable[[Committed], None], stop: threading.Event, uncommitted: threading.Semaphore,
                 on_sealed: Optional[Callable[[int], None]] = None):
        self.cfg, self.journal, self.line, self.report = cfg, journal, line, report
        self.on_sealed = on_sealed  # a sealed shard's index, for the upload to object storage
        self.stop, self.uncommitted = stop, uncommitted
        self.shard = ShardWriter(cfg.output.folder, state.open_shard, state.open_offset, state.open_items) \
            if state.open_shard is not None else None
        self.next_shard = state.next_shard
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
        self._journal_failures(failures)
        self.report(Committed(failed=len(failures)))

    def _journal_failures(self, failures: list[dict]) -> None:
        self.journal.append({"t": "failed", "ts": round(time.time(), 3), "items": failures})

    def commit_batch(self, outcome: Outcome) -> None:
        """A synthesised batch through the rest of the line, then into the open shard and the journal."""
        t = time.monotonic()
        done = self.line.finish(outcome)
        items = []
        mtime = int(time.time())
        for key, members, record in done.items:
            if self.shard is None:
                self.shard = ShardWriter(self.cfg.output.folder, self.next_shard)
                self.next_shard += 1
            self.shard.add(key, members, mtime)
            items.append(record)
        if items:
            end = self.shard.commit()
            self.journal.append({"t": "items", "ts": round(time.time(), 3), "shard": self.shard.index,
                                 "end": end, "items": items})
        if done.failures:
            self._journal_failures(done.failures)
        if self.shard is not None and (self.shard.items >= self.cfg.output.shard_max_items
                                       or self.shard.offset >= self.cfg.output.shard_max_bytes):
            self.close_shard()
        self.report(Committed(items=len(items), audio_s=sum(i["duration_s"] for i in items),
                              failed=len(done.failures), batches=[o.work() for o in done.batches], qc=done.qc,
                              qc_s=done.qc_s, shape_s=done.shape_s,
                              write_s=time.monotonic() - t - done.qc_s - done.shape_s))

    def close_shard(self) -> None:
        index, items = self.shard.index, self.shard.items
        self.shard.close()
        self.journal.append({"t": "closed", "shard": index, "items": items})
        self.shard = None
        if self.on_sealed is not None:
            self.on_sealed(index)

    def finish(self, interrupted: bool) -> None:
        """Close the open shard when the run is done; leave it for the resume when not."""
        if self.shard is not None and not interrupted:
            self.close_shard()
        elif self.shard is not None:
            self.shard.abandon()
        self.journal.close()
