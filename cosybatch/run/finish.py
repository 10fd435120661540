"""A batch's finished rows, through the quality gate, into shard items and failures. `run` finishes
rows on its writer thread, `ray-run` in each actor: both here, the same way.

Each row is measured (cosybatch.qc.signals), transcribed when the gate wants it (cosybatch.qc.asr)
and judged (cosybatch.qc.gate). With ``--qc gate`` or ``asr``, a row that fails is prepared again
with the next attempt folded into its seeds and synthesised again, at once, with the same batch
policy, up to ``--qc-retries`` times. Nothing of a row is committed before its last take, so a
kill at any attempt loses only the batch in flight, as without the gate; a rerun makes the same
takes again (the seeds depend on the attempt only).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..config import RunConfig
from ..engines import RowRejected
from ..qc.gate import PaceHistory, QCCounts, Verdict, assess, judge, wants_asr
from ..qc.signals import measure
from .executor import (
    BatchPolicy,
    ClipRejected,
    EngineSet,
    Outcome,
    PendingRow,
    RowAssembler,
    assemble_audio,
    render_item,
    row_extra,
    run_batch,
    segment_times,
)

log = logging.getLogger("cosybatch")


@dataclass
class Take:
    """One attempt at a row: its clip and verdict, or why there is no clip."""

    pending: PendingRow
    attempt: int
    audio: Optional[np.ndarray] = None
    verdict: Optional[Verdict] = None
    error: Optional[str] = None  # synthesis failed (final) ...
    dead: bool = False  # ... or the clip is no speech at all (empty, NaN, constant): the gate may try again
    language: Optional[str] = None

    def record(self, limits) -> dict:
        if self.verdict is not None:
            return self.verdict.record(limits)
        return {"attempt": self.attempt, "pass": False, "reason": self.error}


@dataclass
class Track:
    row_pending: PendingRow
    takes: list[Take] = field(default_factory=list)


def takes_attempt(engine_cls) -> bool:
    """Whether the engine's `prepare` accepts ``attempt`` (can make a row again with new seeds)."""
    try:
        return "attempt" in inspect.signature(engine_cls.prepare).parameters
    except (TypeError, ValueError):
        return False


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


class RowFinisher:
    """Finished rows -> (rendered items, failure records), through the quality gate."""

    def __init__(self, cfg: RunConfig, engines: EngineSet, policy: BatchPolicy, transcriber=None,
                 account: Optional[Callable[[Outcome], None]] = None, counts: Optional[QCCounts] = None,
                 on_retry: Optional[Callable[[int], None]] = None):
        self.cfg = cfg
        self.settings = cfg.qc_settings()
        self.engines = engines
        self.policy = policy
        self.transcriber = transcriber
        self.account = account or (lambda outcome: None)  # the stats of the batches a retry runs
        self.on_retry = on_retry or (lambda n: None)
        self.counts = counts if counts is not None else QCCounts()
        self.history = PaceHistory()
        self.retries = self.settings.retries if self.settings.gating else 0
        if self.retries and not takes_attempt(engines.cls):
            log.warning("engine %r cannot make a row again with new seeds (its prepare() takes no `attempt`): "
                        "rows failing the quality gate get no second take", engines.cls.name)
            self.retries = 0
        self._deaf_said: set = set()
        default = next(iter(engines.by_voice.values()), None)
        if transcriber is not None and default is not None:  # said once at start-up for the job's voice
            self._deaf(getattr(default, "language", None))
        self.seconds = 0.0  # spent measuring, transcribing and judging (the retakes' synthesis is the batches')

    def seed_history(self, items) -> None:
        """Resume: the speech rates of the clips already committed, so the z-scores go on from them."""
        for item in items:
            if item.get("qc_s_per_unit") and item.get("qc_pass") is not False:
                self.history.add(item.get("voice") or "", item["qc_s_per_unit"])

    # -- the whole path -----------------------------------------------------------------------
    def finish(self, finished: list[PendingRow]) -> tuple[list, list[dict]]:
        if self.settings.mode == "off":
            return self._plain(finished)
        t = time.monotonic()
        self._synth_s = 0.0
        try:
            return self._finish(finished)
        finally:
            self.seconds += time.monotonic() - t - self._synth_s

    def _finish(self, finished: list[PendingRow]) -> tuple[list, list[dict]]:
        tracks = [Track(p) for p in finished]
        active, pending = tracks, [t.row_pending for t in tracks]
        attempt = 0
        while active:
            takes = [self._take(p, attempt) for p in pending]
            self._transcribe([t for t in takes if t.verdict is not None and self._wants_asr(t)])
            for track, take in zip(active, takes, strict=True):
                if take.verdict is not None:
                    judge(take.verdict, self.settings)
                track.takes.append(take)
            again = [t for t in active if attempt < self.retries and self._may_retry(t.takes[-1])]
            if not again:
                break
            attempt += 1
            log.info("quality gate: %d row%s made again (take %d of %d): %s", len(again), "s" * (len(again) > 1),
                     attempt + 1, self.retries + 1,
                     "; ".join(f"{t.row_pending.row.id!r}: {t.takes[-1].record(self.settings.limits).get('reason')}"
                               for t in again[:3]) + (" ..." if len(again) > 3 else ""))
            self.on_retry(len(again))
            remade = self._again([t.row_pending for t in again], attempt)
            active, pending = [], []
            for track in again:
                redone = remade.get(track.row_pending.row.index)
                if redone is None:  # could not be prepared again: its last take stands
                    continue
                active.append(track)
                pending.append(redone)
        items, failures = [], []
        for track in tracks:
            self._settle(track, items, failures)
        return items, failures

    def _plain(self, finished: list[PendingRow]) -> tuple[list, list[dict]]:
        items, failures = [], []
        for p in finished:
            if p.error:
                failures.append({"id": p.row.id, "row": p.row.index, "reason": p.error})
                continue
            try:
                audio = assemble_audio(p.parts, self._engine(p).sample_rate, self.cfg)
            except ClipRejected as exc:
                failures.append({"id": p.row.id, "row": p.row.index, "reason": str(exc)})
                continue
            engine = self._engine(p)
            segments = segment_times(p.parts, p.texts, engine.sample_rate, self.cfg)
            items.append(render_item(p.row, p.text, audio, engine, self.cfg, p.label, p.instruct,
                                     extra=row_extra(p), segments=segments))
        return items, failures

    def _engine(self, p: PendingRow):
        return self.engines.by_voice[p.voice]

    # -- one take -----------------------------------------------------------------------------
    def _take(self, p: PendingRow, attempt: int) -> Take:
        if p.error:
            return Take(p, attempt, error=p.error)
        engine = self._engine(p)
        try:
            audio = assemble_audio(p.parts, engine.sample_rate, self.cfg)
        except ClipRejected as exc:
            if attempt == 0:
                self.counts.dead += 1
            return Take(p, attempt, error=str(exc), dead=True)
        signals = measure(audio, engine.sample_rate, p.text, raw=p.parts).as_dict()
        verdict = assess(signals, _merge_lm(p.lm), p.label or engine.voice_name, self.history, self.settings.limits,
                         self.cfg.sentence_silence, attempt, learn=attempt == 0)
        if attempt == 0:
            self.counts.first_take(verdict.flags)
        language = getattr(engine, "language", None) or p.row.language or text_language(p.text)
        return Take(p, attempt, audio, verdict, language=language)

    def _wants_asr(self, take: Take) -> bool:
        if self.transcriber is None or not wants_asr(take.verdict, self.settings, self.cfg.seed, take.pending.row.id):
            return False
        return not self._deaf(take.language)

    def _deaf(self, language: Optional[str]) -> bool:
        """Whether the ASR model cannot hear `language` (said once per language)."""
        if self.transcriber.hears(language):
            return False
        if language not in self._deaf_said:
            self._deaf_said.add(language)
            log.warning("the ASR model (%s) cannot hear %r: rows in it get the quality signals only; give "
                        "--qc-asr-model a multilingual Whisper folder to transcribe them",
                        self.transcriber.model_dir.name, language)
        return True

    def _transcribe(self, takes: list[Take]) -> None:
        from ..qc.asr import error_rates

        by_language: dict = {}
        for take in takes:
            by_language.setdefault(take.language, []).append(take)
        for language, group in by_language.items():
            texts = self.transcriber.transcribe([(t.audio, self._engine(t.pending).sample_rate) for t in group],
                                                language)
            for take, heard in zip(group, texts, strict=True):
                cer, wer = error_rates(take.pending.text, heard, language)
                take.verdict.asr = {"text": heard, "cer": cer, "wer": wer}
                self.counts.transcribed_take(take.attempt, cer)

    def _may_retry(self, take: Take) -> bool:
        if take.dead:
            return True
        return take.verdict is not None and take.verdict.passed is False

    def _again(self, pending: list[PendingRow], attempt: int) -> dict[int, PendingRow]:
        """The rows prepared with `attempt` (in the voice their first take had) and synthesised
        again, with the run's batch policy."""
        assembler = RowAssembler()
        units = []
        rows = [p.row for p in pending]
        for p in pending:
            row = p.row
            try:
                group, prepared, entry = self.engines.prepare(row, attempt, p.entry)
            except RowRejected as exc:
                log.warning("row %d (%r) could not be prepared for take %d: %s", row.index, row.id, attempt + 1, exc)
                continue
            units += assembler.add(row, prepared, group, entry)
        done: list[PendingRow] = []
        t = time.monotonic()
        for batch in self.policy.plan(units):
            outcome = run_batch(self.engines.by_voice[batch.group], batch, self.policy.guard)
            self.account(outcome)
            done += assembler.take(outcome)
        self.counts.retries += len(rows)
        self._synth_s += time.monotonic() - t
        return {p.row.index: p for p in done}

    # -- the outcome --------------------------------------------------------------------------
    def _settle(self, track: Track, items: list, failures: list) -> None:
        lim = self.settings.limits
        takes = track.takes
        row = track.row_pending.row
        clips = [t for t in takes if t.verdict is not None]
        chosen = next((t for t in clips if t.verdict.passed is not False), None)
        if chosen is None and clips and self.settings.on_fail == "keep" and self.settings.gating:
            chosen = min(clips, key=lambda t: (t.verdict.score(lim), t.attempt))
            self.counts.kept_failing += 1
        history = [t.record(lim) for t in takes] if len(takes) > 1 else None
        if chosen is None:
            last = takes[-1]
            if not self.settings.gating or (last.error and not last.dead and len(takes) == 1):
                failures.append({"id": row.id, "row": row.index, "reason": last.error or last.verdict.reason})
                return
            reason = last.verdict.reason if last.verdict is not None else last.error
            n = len(takes)
            failures.append({"id": row.id, "row": row.index,
                             "reason": f"qc: {reason} after {n} attempt{'s' if n > 1 else ''}",
                             "qc": {"attempts": [t.record(lim) for t in takes]}})
            self.counts.failed += 1
            return
        qc = chosen.verdict.record(lim)
        if history is not None:
            qc["attempts"] = history
        if chosen.verdict.passed and chosen.attempt > 0:
            self.counts.passed_after_retry += 1
        self.counts.committed(chosen.verdict, chosen.pending.label or self._engine(chosen.pending).voice_name)
        p = chosen.pending
        engine = self._engine(p)
        segments = segment_times(p.parts, p.texts, engine.sample_rate, self.cfg)
        items.append(render_item(p.row, p.text, chosen.audio, engine, self.cfg, p.label, p.instruct, qc=qc,
                                 extra=row_extra(p), segments=segments))


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
