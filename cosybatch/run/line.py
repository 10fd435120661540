"""The row line: a corpus row's whole way to a shard item, written once. `cosybatch run`'s threads,
each `ray-run` actor, `run --plan-only` and the quality gate's retakes all go through it.

    admit    corpus row -> this job's row, or a failure record, or skip (done, another worker's)
    prepare  row -> its voice (own, pool, language) -> the engine's pieces as plan units
    windows  rows in file order -> failures and planned batches, one window at a time
    run      batch -> engine (out-of-memory split) -> the finished rows
    finish   finished rows -> clips -> quality gate (retakes made here again) -> shard items

Which thread runs which step is the runner's business: `run` reads and plans on its main
thread, synthesises on worker threads and finishes on its writer thread; a `ray-run` actor does
all of it for one chunk at a time.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from ..config import RunConfig
from ..corpus import BadRow, Row
from ..engines import RowRejected
from ..errors import CorpusError
from ..plan import Batch, Unit
from ..qc.gate import QCCounts
from ..qc.takes import Clip, QualityGate, Settled
from ..store.checkpoint import DUPLICATE_ID
from ..store.distributed import shard_of
from ..store.items import render_item, source_hash
from .executor import (
    BatchPolicy,
    ClipRejected,
    EngineSet,
    Outcome,
    PendingRow,
    RowAssembler,
    assemble_audio,
    expected_seconds,
    row_extra,
    run_batch,
    segment_times,
)
from .shaping import Shaped, shape, shift_segments

log = logging.getLogger("cosybatch")

FIRST_WINDOW_ROWS = 64  # the first window is small so audio starts flowing at once
FAILURE_FLUSH = 256  # failure records handed on together
SHAPERS = min(8, os.cpu_count() or 1)  # threads of the clips' last stage (`RowLine._clips`)


class Admission:
    """Which rows of the corpus this run still has to make: within --limit, in this worker's part
    (--shard), not done by an earlier run; bad rows, duplicate ids (the first row wins) and
    over-long texts become failure records. One instance per run, fed rows in file order."""

    def __init__(self, cfg: RunConfig, done_ids: Iterable = (), failed_rows: Iterable = (),
                 committed: Optional[dict] = None):
        self.limit = cfg.input.limit
        self.shard = None if cfg.output.shard_count is None else (cfg.output.shard_index, cfg.output.shard_count)
        self.max_chars = cfg.input.max_chars
        self.done_ids = set(done_ids)
        self.failed_rows = set(failed_rows)
        self.seen = set(self.done_ids)
        # After a corpus change: committed id -> source_hash of the row it was made from.
        self.committed = committed
        self.changed: list[dict] = []
        self.still_there: set = set()

    def past_limit(self, row: Union[Row, BadRow]) -> bool:
        return self.limit is not None and row.index >= self.limit

    def others(self, row: Union[Row, BadRow]) -> bool:
        """Whether the row is another --shard worker's."""
        if self.shard is None:
            return False
        key = row.id if row.id is not None else f"#row{row.index}"
        return shard_of(key, self.shard[1]) != self.shard[0]

    def done(self, row: Union[Row, BadRow]) -> bool:
        return row.index in self.failed_rows or (row.id is not None and row.id in self.done_ids)

    def admit(self, row: Union[Row, BadRow]) -> Union[Row, dict, None]:
        """The row to synthesise, a failure record for it, or None (another worker's, or done)."""
        if self.others(row):
            return None
        if self.done(row):
            if self.committed is not None and row.id in self.committed and row.id not in self.still_there:
                self.still_there.add(row.id)
                old = self.committed[row.id]
                if old is not None and (isinstance(row, BadRow) or old != source_hash(row)):
                    self.changed.append({"id": row.id, "row": row.index, "change": "changed",
                                         "detail": "the row's text, voice or prompt differs from the committed "
                                                   "audio's; the committed audio was kept"})
            return None
        if isinstance(row, BadRow):
            if row.id is not None:
                self.seen.add(row.id)
            return {"id": row.id, "row": row.index, "reason": row.reason}
        if row.id in self.seen:
            return {"id": row.id, "row": row.index, "reason": DUPLICATE_ID}
        self.seen.add(row.id)
        if len(row.text) > self.max_chars:
            return {"id": row.id, "row": row.index, "reason":
                    f"text is {len(row.text)} characters, over --max-chars {self.max_chars}; "
                    "split the row or raise the limit"}
        return row


@dataclass
class Reading:
    """How reading the corpus went, for the runner and the job's end."""

    read_all: bool = False  # every row up to the end or --limit was read
    whole_corpus: bool = False  # to its end, not stopped by --limit, with no unreadable part
    corpus_error: Optional[CorpusError] = None  # a part of the file that could not be read
    read_s: float = 0.0
    prepare_s: float = 0.0


@dataclass
class Finished:
    """What a batch (with its retakes) leaves for the committer and the job's statistics."""

    items: list = field(default_factory=list)  # (shard key, tar members, manifest record), file order
    failures: list[dict] = field(default_factory=list)
    batches: list[Outcome] = field(default_factory=list)  # every batch the engine ran, retakes included
    qc: Optional[QCCounts] = None
    qc_s: float = 0.0
    shape_s: float = 0.0  # in the clip's last stage (run/shaping.py), retakes included


class RowLine:
    """The line for one run (or one ray-run actor): engines, batch policy and quality gate."""

    def __init__(self, cfg: RunConfig, engines: EngineSet, policy: BatchPolicy, gate: Optional[QualityGate]):
        self.cfg = cfg
        self.engines = engines
        self.policy = policy
        self.gate = gate
        self.assembler = RowAssembler()
        self.shape_s = 0.0  # since the last `finish` returned

    # -- admission and planning ----------------------------------------------------------------
    def prepare(self, row: Row, assembler: Optional[RowAssembler] = None, attempt: int = 0,
                entry=None) -> Union[list[Unit], dict]:
        """The row's plan units (its pieces, prepared by its voice's engine), or its failure record."""
        try:
            group, prepared, entry = self.engines.prepare(row, attempt, entry)
        except RowRejected as exc:
            return {"id": row.id, "row": row.index, "reason": str(exc)}
        expected = None
        if self.gate is not None and self.gate.active:
            engine = self.engines.by_voice[group]
            expected = expected_seconds(engine, prepared.pieces, self.cfg.output.sentence_silence_s)
        return (assembler or self.assembler).add(row, prepared, group, entry, expected)

    def windows(self, rows: Iterable, admission: Admission, stopped: Callable[[], bool],
                reading: Reading) -> Iterator[tuple[str, list]]:
        """Rows in file order -> ("failed", records) and ("batches", planned batches), one window
        at a time (the first small, so audio flows at once, then up to --window rows)."""
        window_rows, rows_in_window, seq = FIRST_WINDOW_ROWS, 0, 0
        units: list[Unit] = []
        failures: list[dict] = []
        it = iter(rows)
        while not stopped():
            t = time.monotonic()
            try:
                row = next(it, None)
            except CorpusError as exc:  # raised after every readable row was yielded
                reading.corpus_error = exc
                row = None
            reading.read_s += time.monotonic() - t
            if row is None or admission.past_limit(row):
                reading.read_all = True
                reading.whole_corpus = row is None and reading.corpus_error is None
                break
            admitted = admission.admit(row)
            if admitted is None:
                if isinstance(row, Row) and not admission.others(row) and row.id in admission.done_ids \
                        and row.index not in admission.failed_rows:
                    self.engines.observe(row)  # balanced voice pools replay what the committed rows counted
                continue
            if isinstance(admitted, dict):
                failures.append(admitted)
                continue
            t = time.monotonic()
            prepared = self.prepare(row)
            reading.prepare_s += time.monotonic() - t
            if isinstance(prepared, dict):
                failures.append(prepared)
                continue
            units += prepared
            rows_in_window += 1
            if rows_in_window >= window_rows:
                batches = self.policy.plan(units, first_seq=seq)
                seq += len(batches)
                yield "batches", batches
                units, rows_in_window = [], 0
                window_rows = min(window_rows * 4, self.cfg.batching.window)
            if len(failures) >= FAILURE_FLUSH:
                yield "failed", failures
                failures = []
        if reading.read_all and units:
            yield "batches", self.policy.plan(units, first_seq=seq)
        if failures:
            yield "failed", failures

    def release(self, batch: Batch) -> None:
        """Let a planned batch's rows go without running it (`--plan-only`)."""
        self.assembler.take(Outcome(batch, [np.zeros(0, dtype=np.float32)] * len(batch.units)))

    # -- synthesis and finishing --------------------------------------------------------------
    def run(self, batch: Batch) -> Outcome:
        """One batch through its voice's engine (thread-safe: `run --workers N` calls it at once)."""
        return run_batch(self.engines.by_voice[batch.group], batch, self.policy.guard)

    def finish(self, outcome: Outcome) -> Finished:
        """A synthesised batch's finished rows through the quality gate into shard items."""
        done = Finished(batches=[outcome])
        settled = self.gate.settle(self._clips(self.assembler.take(outcome)),
                                   lambda clips, attempt: self._remake(clips, attempt, done))
        for s in settled:
            if s.failure is not None:
                done.failures.append(s.failure)
            else:
                done.items.append(self._render(s))
        done.qc = self.gate.take_counts()
        done.qc_s = self.gate.seconds
        self.gate.seconds = 0.0
        done.shape_s, self.shape_s = self.shape_s, 0.0
        return done

    def make(self, rows: list[Row]) -> Finished:
        """Rows prepared, planned, synthesised and finished in one go (a `ray-run` chunk)."""
        done = Finished()
        units: list[Unit] = []
        for row in rows:
            prepared = self.prepare(row)
            if isinstance(prepared, dict):
                done.failures.append(prepared)
            else:
                units += prepared
        for batch in self.policy.plan(units):
            part = self.finish(self.run(batch))
            done.items += part.items
            done.failures += part.failures
            done.batches += part.batches
            done.qc_s += part.qc_s
            done.shape_s += part.shape_s
            done.qc = part.qc if done.qc is None else _merged(done.qc, part.qc)
        return done

    def _remake(self, clips: list[Clip], attempt: int, done: Finished) -> dict[int, Clip]:
        """The quality gate's retake: the rows prepared with `attempt` (in the voice their first take
        had), synthesised with the run's batch policy, as clips."""
        assembler = RowAssembler()
        units: list[Unit] = []
        for clip in clips:
            first: PendingRow = clip.ref
            prepared = self.prepare(first.row, assembler, attempt, first.entry)
            if isinstance(prepared, dict):
                log.warning("row %d (%r) could not be prepared for take %d: %s", first.row.index, first.row.id,
                            attempt + 1, prepared["reason"])
                continue
            units += prepared
        remade: dict[int, Clip] = {}
        for batch in self.policy.plan(units):
            outcome = self.run(batch)
            done.batches.append(outcome)
            for pending in assembler.take(outcome):
                remade[pending.row.index] = self._clip(pending)
        return remade

    def _clips(self, finished: list[PendingRow]) -> list[Clip]:
        """A batch's finished rows as clips, their last stage (resampling, level, encoding: Opus
        encodes at about 40x real time on one core here, as fast as Piper speaks) on SHAPERS
        threads (soundfile, soxr and numpy let go of the GIL while they work), so it keeps up with
        a fast engine where the machine has the cores."""
        if len(finished) < 2:
            return [self._clip(p) for p in finished]
        t = time.monotonic()
        clips = list(_shapers().map(lambda p: self._clip(p, timed=False), finished))
        self.shape_s += time.monotonic() - t
        return clips

    def _clip(self, p: PendingRow, timed: bool = True) -> Clip:
        """A finished row's take: its pieces joined (or why they cannot be)."""
        engine = self.engines.by_voice[p.voice]
        clip = Clip(p, p.row.id, p.row.index, p.text, p.label or engine.voice_name, engine.sample_rate,
                    lm=_merge_lm(p.lm), raw=p.parts,
                    language=getattr(engine, "language", None) or p.row.language or text_language(p.text),
                    expected_s=p.expected_s)
        if p.error:
            clip.error = p.error
            return clip
        try:
            joined = assemble_audio(p.parts, engine.sample_rate, self.cfg)
        except ClipRejected as exc:
            clip.error, clip.dead = str(exc), True
            return clip
        # The gate judges the samples as committed: what `cosybatch qc` and every reader decode.
        t = time.monotonic()
        p.shaped = shape(joined, engine.sample_rate, self.cfg.output)
        if timed:
            self.shape_s += time.monotonic() - t
        clip.audio, clip.sample_rate = p.shaped.audio, p.shaped.rate
        return clip

    def _render(self, settled: Settled) -> tuple[str, dict, dict]:
        p: PendingRow = settled.clip.ref
        engine = self.engines.by_voice[p.voice]
        shaped: Shaped = p.shaped
        segments = shift_segments(segment_times(p.parts, p.texts, engine.sample_rate, self.cfg), shaped.cut_s,
                                  shaped.member.num_samples / shaped.rate)
        return render_item(p.row, p.text, shaped.member, engine, self.cfg, p.label, p.instruct,
                           qc=settled.qc, extra=row_extra(p), segments=segments)


_SHAPERS_LOCK = threading.Lock()
_SHAPERS_POOL: Optional[ThreadPoolExecutor] = None


def _shapers() -> ThreadPoolExecutor:
    """The process's threads for the clips' last stage, made on first use and shared by every line
    (each ray-run chunk makes a line of its own)."""
    global _SHAPERS_POOL
    with _SHAPERS_LOCK:
        if _SHAPERS_POOL is None:
            _SHAPERS_POOL = ThreadPoolExecutor(SHAPERS, thread_name_prefix="cosybatch-shape")
        return _SHAPERS_POOL


def open_gate(cfg: RunConfig, engines: EngineSet, transcriber=None,
              on_retry: Optional[Callable[[int], None]] = None) -> QualityGate:
    """The run's quality gate, for its engines (their default voice's language, whether they can
    make a row again with new seeds)."""
    gate = QualityGate(cfg.qc_settings(), cfg.engine.seed, cfg.output.sentence_silence_s, transcriber,
                       can_retake=takes_attempt(engines.cls), engine_name=engines.cls.name, on_retry=on_retry)
    default = next(iter(engines.by_voice.values()), None)
    if default is not None:
        gate.announce(getattr(default, "language", None))
    return gate


def takes_attempt(engine_cls) -> bool:
    """Whether the engine's `prepare` accepts ``attempt`` (can make a row again with new seeds)."""
    try:
        return "attempt" in inspect.signature(engine_cls.prepare).parameters
    except (TypeError, ValueError):
        return False


def _merged(a: QCCounts, b: QCCounts) -> QCCounts:
    a.merge(b.raw())
    return a


def _merge_lm(parts: Optional[list]) -> Optional[dict]:
    """A row's LM signals from its pieces': the worst stop, the longest token run, summed tokens."""
    if not parts or all(x is None for x in parts):
        return None
    parts = [x for x in parts if x]
    rank = {"eos": 0, "length_cap": 1, "nonfinite": 2}
    stop = max((x.get("stop", "eos") for x in parts), key=lambda s: rank.get(s, 0))
    return {"stop": stop, "tokens": sum(x.get("tokens", 0) for x in parts),
            "token_run": max(x.get("token_run", 0) for x in parts),
            "repeat_4gram": max(x.get("repeat_4gram", 0.0) for x in parts)}


def text_language(text: str) -> Optional[str]:
    """A guess from the script when the engine does not say: "zh", "ja", "ko", or None (Latin and others)."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return None
    counts = {"ja": 0, "ko": 0, "zh": 0}
    for c in letters:
        o = ord(c)
        if 0x3040 <= o <= 0x30FF:
            counts["ja"] += 1
        elif 0xAC00 <= o <= 0xD7AF or 0x1100 <= o <= 0x11FF:
            counts["ko"] += 1
        elif 0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF:
            counts["zh"] += 1
    best = max(counts, key=counts.get)
    if counts[best] * 2 < len(letters):
        return None
    return "ja" if counts["ja"] else best
