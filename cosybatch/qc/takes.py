"""The quality gate as one object: a batch's clips in, the take to commit (or the failure) of each
row out. It owns a clip's verdict and the retake policy: each clip is measured
(cosybatch.qc.signals), transcribed when the gate wants it (cosybatch.qc.asr) and judged
(cosybatch.qc.gate); with ``--qc gate`` or ``asr`` a row that fails is made again with its next
attempt's seeds, at once, up to ``--qc-retries`` times, then dropped or kept (``--qc-on-fail``).

The gate never runs an engine: whoever calls it passes ``remake``, which makes rows again (the
run's row line does, with the run's batch policy), as whisper's ``decode_with_fallback`` retries
inside the loop that owns decoding. Nothing of a row is committed before its last take, so a kill
at any attempt loses only the batch in flight; a rerun makes the same takes (the seeds depend on
the attempt only).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .gate import Calibration, PaceHistory, QCCounts, QCSettings, Verdict, assess, judge, learn, wants_asr
from .signals import measure

log = logging.getLogger("cosybatch")


@dataclass
class Clip:
    """One take of a row, as the run hands it to the gate. `ref` is the caller's own handle on the
    row (the gate never looks inside); `audio` is None when there is no clip (`error`)."""

    ref: Any
    row_id: str
    row_index: int
    text: str  # what should be heard
    voice: str  # whose speech-rate history the clip is judged against and joins
    sample_rate: int
    audio: Optional[np.ndarray] = None
    error: Optional[str] = None  # synthesis failed (final) ...
    dead: bool = False  # ... or the clip is no speech at all (empty, NaN, constant): it may be made again
    raw: Optional[list] = None  # the pieces before joining and normalisation (clipping is measured there)
    lm: Optional[dict] = None  # what an LM-based engine said of the row (stop reason, token runs)
    language: Optional[str] = None
    expected_s: Optional[float] = None  # how long the engine expects the clip to be; None: it cannot say


@dataclass
class Settled:
    """A row after the gate: the take to commit with its KEY.json ``qc`` record, or the failure."""

    clip: Optional[Clip] = None
    qc: Optional[dict] = None
    failure: Optional[dict] = None


@dataclass
class _Take:
    clip: Clip
    attempt: int
    verdict: Optional[Verdict] = None

    def record(self, limits) -> dict:
        if self.verdict is not None:
            return self.verdict.record(limits)
        return {"attempt": self.attempt, "pass": False, "reason": self.clip.error}


@dataclass
class _Track:
    first: Clip
    takes: list[_Take] = field(default_factory=list)


Remake = Callable[[list[Clip], int], dict[int, Clip]]  # (clips, attempt) -> row index -> the new take


class QualityGate:
    """The gate of one run (or of one ray-run chunk): `settle` a batch's clips."""

    def __init__(self, settings: QCSettings, seed: int, sentence_silence: float, transcriber=None,
                 can_retake: bool = True, engine_name: str = "", on_retry: Optional[Callable[[int], None]] = None):
        self.settings = settings
        self.seed = seed
        self.sentence_silence = sentence_silence
        self.transcriber = transcriber
        self.on_retry = on_retry or (lambda n: None)
        self.counts = QCCounts()  # what this gate saw since the last `take_counts`
        self.history = PaceHistory()
        self.calibration = Calibration()
        self.retries = settings.retries if settings.gating else 0
        if self.retries and not can_retake:
            log.warning("engine %r cannot make a row again with new seeds (its prepare() takes no `attempt`): "
                        "rows failing the quality gate get no second take", engine_name)
            self.retries = 0
        self._deaf_said: set = set()
        self.seconds = 0.0  # spent measuring, transcribing and judging (the retakes' synthesis is the batches')
        self._synth_s = 0.0

    @property
    def active(self) -> bool:
        return self.settings.mode != "off"

    def announce(self, language: Optional[str]) -> None:
        """Say at start-up when the ASR cannot hear the job's voice's language."""
        if self.transcriber is not None:
            self._deaf(language)

    def seed_history(self, items: Iterable[dict]) -> None:
        """Resume: the paces (or speech rates) of the clips already committed that passed unflagged,
        so the z-scores go on from them."""
        for item in items:
            if item.get("qc_flags") or item.get("qc_pass") is False:
                continue
            if item.get("qc_pace") is not None:
                self.history.add(item.get("voice") or "", item["qc_pace"], kind="pace")
            elif item.get("qc_s_per_unit"):
                self.history.add(item.get("voice") or "", item["qc_s_per_unit"])

    def take_counts(self) -> QCCounts:
        """What the gate saw since the last call (the job adds it to its own counts)."""
        counts, self.counts = self.counts, QCCounts()
        counts.calibration = self.calibration.report(self.settings.limits)
        return counts

    # -- the whole path -----------------------------------------------------------------------
    def settle(self, clips: list[Clip], remake: Remake) -> list[Settled]:
        """Each row's take to commit, or its failure, in the order of `clips`."""
        if not self.active:
            return [Settled(failure=_failure(c, c.error)) if c.audio is None else Settled(clip=c) for c in clips]
        t = time.monotonic()
        self._synth_s = 0.0
        try:
            return self._settle_all(clips, remake)
        finally:
            self.seconds += time.monotonic() - t - self._synth_s

    def _settle_all(self, clips: list[Clip], remake: Remake) -> list[Settled]:
        tracks = [_Track(c) for c in clips]
        active, current = tracks, list(clips)
        attempt = 0
        while active:
            takes = self._judged([self._take(c, attempt) for c in current])
            for track, take in zip(active, takes, strict=True):
                track.takes.append(take)
            again = [t for t in active if attempt < self.retries and _may_retry(t.takes[-1])]
            if not again:
                break
            attempt += 1
            log.info("quality gate: %d row%s made again (take %d of %d): %s", len(again), "s" * (len(again) > 1),
                     attempt + 1, self.retries + 1,
                     "; ".join(f"{t.first.row_id!r}: {t.takes[-1].record(self.settings.limits).get('reason')}"
                               for t in again[:3]) + (" ..." if len(again) > 3 else ""))
            self.on_retry(len(again))
            t = time.monotonic()
            remade = remake([t.first for t in again], attempt)
            self.counts.retries += len(again)
            self._synth_s += time.monotonic() - t
            active, current = [], []
            for track in again:
                redone = remade.get(track.first.row_index)
                if redone is None:  # could not be prepared again: its last take stands
                    continue
                active.append(track)
                current.append(redone)
        return [self._outcome(track) for track in tracks]

    def verdicts(self, clips: list[Clip]) -> list[dict]:
        """Each clip's KEY.json ``qc`` record as the gate would judge it, with no retake: what
        `cosybatch qc` records of a finished folder's clips."""
        return [take.record(self.settings.limits) for take in self._judged([self._take(c, 0) for c in clips])]

    def _judged(self, takes: list[_Take]) -> list[_Take]:
        """Takes heard (those the gate wants heard) and judged; first takes that pass join the history."""
        self._hear([t for t in takes if t.verdict is not None and self._wants_asr(t)])
        for take in takes:
            if take.verdict is None:
                continue
            voice = take.clip.voice
            judge(take.verdict, self.settings, self.calibration.limits(voice, self.settings.limits))
            learn(take.verdict, voice, self.history, self.calibration)
        return takes

    # -- one take -----------------------------------------------------------------------------
    def _take(self, clip: Clip, attempt: int) -> _Take:
        if clip.audio is None:
            if clip.dead and attempt == 0:
                self.counts.dead += 1
            return _Take(clip, attempt)
        raw = clip.raw if clip.raw is not None else ()
        signals = measure(clip.audio, clip.sample_rate, clip.text, raw=raw).as_dict()
        verdict = assess(signals, clip.lm, clip.voice, self.history, self.settings.limits, self.sentence_silence,
                         attempt, clip.expected_s)
        if attempt == 0:
            self.counts.first_take(verdict.flags)
        return _Take(clip, attempt, verdict)

    def _wants_asr(self, take: _Take) -> bool:
        if self.transcriber is None or not wants_asr(take.verdict, self.settings, self.seed, take.clip.row_id):
            return False
        return not self._deaf(take.clip.language)

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

    def _hear(self, takes: list[_Take]) -> None:
        """Each take's text scored against its audio; a clip too long for that is transcribed."""
        from .asr import error_rates

        by_language: dict = {}
        for take in takes:
            by_language.setdefault(take.clip.language, []).append(take)
        for language, group in by_language.items():
            heard = self.transcriber.score([(t.clip.audio, t.clip.sample_rate, t.clip.text) for t in group], language)
            for take, found in zip(group, heard, strict=True):
                if found is not None:
                    take.verdict.asr = found.as_dict()
                    self.counts.heard_take(take.attempt, found.support)
            long = [t for t, found in zip(group, heard, strict=True) if found is None]
            if long:
                texts = self.transcriber.transcribe([(t.clip.audio, t.clip.sample_rate) for t in long], language)
                for take, text in zip(long, texts, strict=True):
                    cer, wer = error_rates(take.clip.text, text, language)
                    take.verdict.asr = {"text": text, "cer": cer, "wer": wer}
                    self.counts.transcribed_take(take.attempt, cer)

    # -- the outcome --------------------------------------------------------------------------
    def _outcome(self, track: _Track) -> Settled:
        lim = self.settings.limits
        takes = track.takes
        clips = [t for t in takes if t.verdict is not None]
        chosen = next((t for t in clips if t.verdict.passed is not False), None)
        if chosen is None and clips and self.settings.on_fail == "keep" and self.settings.gating:
            chosen = min(clips, key=lambda t: (t.verdict.score(lim), t.attempt))
            self.counts.kept_failing += 1
        if chosen is None:
            last = takes[-1]
            if not self.settings.gating or (last.verdict is None and not last.clip.dead and len(takes) == 1):
                return Settled(failure=_failure(track.first, last.clip.error or last.verdict.reason))
            reason = last.verdict.reason if last.verdict is not None else last.clip.error
            n = len(takes)
            self.counts.failed += 1
            return Settled(failure={**_failure(track.first, f"qc: {reason} after {n} attempt{'s' if n > 1 else ''}"),
                                    "qc": {"attempts": [t.record(lim) for t in takes]}})
        qc = chosen.verdict.record(lim)
        if len(takes) > 1:
            qc["attempts"] = [t.record(lim) for t in takes]
        if chosen.verdict.passed and chosen.attempt > 0:
            self.counts.passed_after_retry += 1
        self.counts.committed(chosen.verdict, chosen.clip.voice)
        return Settled(clip=chosen.clip, qc=qc)


def _may_retry(take: _Take) -> bool:
    if take.clip.dead:
        return True
    return take.verdict is not None and take.verdict.passed is False


def _failure(clip: Clip, reason: Optional[str]) -> dict:
    return {"id": clip.row_id, "row": clip.row_index, "reason": reason}
