"""The reading side of a run, on the main thread: the corpus in file order, minus what is done
and what belongs to other workers; rows prepared by the engine and cut into units; each window
planned into batches and queued, never more uncommitted batches than the run allows."""

from __future__ import annotations

import queue
import threading
import time
from typing import Optional

from ..config import RunConfig
from ..corpus import Corpus, Row
from ..engines import RowRejected
from ..errors import CorpusError
from ..plan import Unit
from ..stats import Stats
from ..store.distributed import shard_of
from .executor import BatchPolicy, EngineSet, RowAssembler

FIRST_WINDOW_ROWS = 64  # the first window is small so audio starts flowing at once


class Producer:
    def __init__(self, cfg: RunConfig, corpus: Corpus, gate, engines: EngineSet, assembler: RowAssembler,
                 policy: BatchPolicy, stats: Stats, stop: threading.Event, uncommitted: threading.Semaphore):
        self.cfg, self.corpus, self.gate, self.engines = cfg, corpus, gate, engines
        self.assembler, self.policy, self.stats = assembler, policy, stats
        self.stop, self.uncommitted = stop, uncommitted
        self.exhausted = False  # every row was read and every batch queued
        self.read_whole_corpus = False  # to its end, not stopped by --limit
        self.corpus_error: Optional[CorpusError] = None  # a part of the file that could not be read

    def run(self, work: queue.Queue, results: queue.Queue) -> None:
        cfg = self.cfg
        window_rows = FIRST_WINDOW_ROWS
        units: list[Unit] = []
        failures: list[dict] = []
        rows_in_window = 0
        seq = 0
        it = iter(self.corpus)
        read_s = prep_s = 0.0
        read_all = False
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                row = next(it, None)
            except CorpusError as exc:  # raised after every readable row was yielded
                self.corpus_error = exc
                row = None
            read_s += time.monotonic() - t
            if row is None or (cfg.limit is not None and row.index >= cfg.limit):
                read_all = True
                self.read_whole_corpus = row is None and self.corpus_error is None
                break
            if cfg.shard_count is not None and shard_of(row.id if row.id is not None else f"#row{row.index}",
                                                        cfg.shard_count) != cfg.shard_index:
                continue  # another worker's row
            admitted = self.gate.admit(row)
            if admitted is None:
                if isinstance(row, Row) and row.id in self.gate.done_ids and row.index not in self.gate.failed_rows:
                    self.engines.observe(row)  # balanced voice pools replay what the committed rows counted
                continue
            if isinstance(admitted, dict):
                failures.append(admitted)
                continue
            t = time.monotonic()
            try:
                group, prepared, entry = self.engines.prepare(row)
            except RowRejected as exc:
                failures.append({"id": row.id, "row": row.index, "reason": str(exc)})
                prep_s += time.monotonic() - t
                continue
            prep_s += time.monotonic() - t
            units.extend(self.assembler.add(row, prepared, group, entry))
            rows_in_window += 1
            if rows_in_window >= window_rows:
                seq, _ = self._dispatch(units, seq, work)
                units, rows_in_window = [], 0
                window_rows = min(window_rows * 4, cfg.window)
            if len(failures) >= 256:
                results.put(("failed", failures))
                failures = []
        if read_all:
            self.exhausted = self._dispatch(units, seq, work)[1] if units else True
        if failures:
            results.put(("failed", failures))
        self.stats.stage_s["read"] += read_s
        self.stats.stage_s["prepare"] += prep_s

    def _dispatch(self, units: list[Unit], seq: int, work: queue.Queue) -> tuple[int, bool]:
        """Plan a window and queue its batches; returns (next seq, whether all were queued)."""
        batches = self.policy.plan(units, first_seq=seq)
        for batch in batches:
            while not self.uncommitted.acquire(timeout=0.2):
                if self.stop.is_set():
                    return seq + len(batches), False
            while True:
                if self.stop.is_set():
                    self.uncommitted.release()
                    return seq + len(batches), False
                try:
                    work.put(batch, timeout=0.2)
                    break
                except queue.Full:
                    continue
        return seq + len(batches), True
