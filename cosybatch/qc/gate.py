"""The quality gate: which signals flag a clip, which rows the ASR hears, and whether a clip passes.

Modes (``--qc``):
  off      nothing measured
  signals  every clip's signals and flags recorded (KEY.json ``qc``, the manifest, stats.json);
           nothing is retried or dropped. The default.
  gate     as signals, and a flagged clip fails: it is made again with a new seed, up to
           ``--qc-retries`` times, then dropped or kept marked failing (``--qc-on-fail``)
  asr      as gate, and the clips chosen by ``--qc-asr-rows`` (all, by default) are heard: Whisper
           scores the text the clip should say against its audio (cosybatch.qc.asr.Transcriber.score);
           a clip passes when the audio supports its text, no speech runs past or between the
           text's words, and no hard flag is raised. A clip too long for one Whisper window is
           transcribed instead and passes on its CER (and WER, if a limit is set)

Flags are hard (the clip is wrong whatever the ASR hears: the LM hit its length cap or gave
non-finite logits, a loop of one speech token, the clip stops mid-speech, a long silence, noise,
clipping, a length far from what its engine expects) or soft (speech rate or speech share far from
the voice's usual: the ASR decides when it runs; without ASR the flag fails the clip).

The length is judged against the engine's own expectation of each clip (`Engine.estimate_seconds`):
the pace, log(speech seconds / expected seconds), is judged against the voice's clips that passed
(a robust z), and before a voice has MIN_HISTORY of them against the expectation itself. Only
clips that pass join the history, so a run whose clips are mostly broken does not learn broken
clips as the norm.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar, Optional

from ..errors import UsageError

MODES = ("off", "signals", "gate", "asr")
ASR_ROWS = ("flagged", "all", "sample")
ON_FAIL = ("drop", "keep")
HARD = ("length_cap", "nonfinite", "token_loop", "cut_end", "long_lead", "long_tail", "long_gap", "noise", "clipped",
        "too_long", "too_short")
SOFT = ("fast", "slow", "low_speech")
HISTORY = 2000  # clips per voice the speech-rate median is taken over


@dataclass(frozen=True)
class Limits:
    """The thresholds; any of them can be set in a job spec's ``[qc]`` table."""

    max_cer: float = 0.20  # clips too long for one window, transcribed
    max_wer: Optional[float] = None
    # Hearing by scoring (docs/quality.md gives the figures these were set from, on two text domains):
    min_support: float = 3.0  # mean log-probability gain of the text's tokens with the audio over without
    min_word_support: float = 1.0  # the same over the weakest WORST_SPAN tokens: a word or two missing
    max_beyond_s: float = 0.5  # speech after the text's last word starts
    max_stretch_s: float = 1.25  # speech within one token's span of the alignment
    max_z: float = 4.0  # robust z of log(seconds per spoken character), for engines with no expectation
    max_pace_z: float = 3.5  # robust z of the pace against the expectation (too_long, too_short)
    min_history: int = 8  # clips of a voice before its speech rate is judged
    max_lead_s: float = 1.0
    max_tail_s: float = 1.0
    # the clip's last 30 ms within this many dB of its loud frames: it stops while speech sounds
    # (cut short). signals.SPEECH_DB, the level that counts as speech; a finished clip decays far below
    max_end_db: float = -35.0
    max_gap_s: float = 1.0  # beyond --sentence-silence
    min_speech_share: float = 0.6
    max_clipped: float = 0.01
    max_flatness: float = 0.3
    max_token_run: int = 25  # CosyVoice issue #1877's loop threshold

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class QCSettings:
    mode: str = "signals"
    asr_rows: str = "all"
    sample: float = 0.1
    retries: int = 2
    on_fail: str = "drop"
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"--qc must be one of {', '.join(MODES)} (got {self.mode!r})")
        if self.asr_rows not in ASR_ROWS:
            raise UsageError(f"--qc-asr-rows must be one of {', '.join(ASR_ROWS)} (got {self.asr_rows!r})")
        if self.on_fail not in ON_FAIL:
            raise UsageError(f"--qc-on-fail must be drop or keep (got {self.on_fail!r})")
        if not 0 < self.sample <= 1:
            raise UsageError(f"--qc-sample must be a share in (0, 1] (got {self.sample})")
        if self.retries < 0:
            raise UsageError(f"--qc-retries must be >= 0 (got {self.retries})")
        lim = self.limits
        if not lim.max_cer >= 0 or (lim.max_wer is not None and lim.max_wer < 0):
            raise UsageError("--qc-max-cer and --qc-max-wer must be >= 0")

    @property
    def gating(self) -> bool:
        return self.mode in ("gate", "asr")

    def fingerprint(self, asr_model: Optional[dict]) -> Optional[dict]:
        """What of the gate changes which audio is committed (None when nothing does)."""
        if not self.gating:
            return None
        out = {"mode": self.mode, "retries": self.retries, "on_fail": self.on_fail, **asdict(self.limits)}
        if self.mode == "asr":
            out.update(asr_rows=self.asr_rows, asr_model=asr_model)  # its model.bin's size and sha256
            if self.asr_rows == "sample":
                out["sample"] = self.sample
        return out


def sampled(seed: int, item_id: str, share: float) -> bool:
    """A seeded share of rows, the same under resume, --shard and ray-run."""
    digest = hashlib.blake2b(f"qc\x00{seed}\x00{item_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < share


class PaceHistory:
    """Each voice's recent clips that passed, for a robust z-score (x - median) / (1.4826 MAD), the
    MAD floored so a very even voice is not judged too finely. Two measures, kept apart:

    - the pace, log(speech seconds / the engine's expected seconds), when the engine expects a
      length: before the voice has `min_history` clips, judged against the expectation itself
      (centre 0, MAD PRIOR_MAD); after, against the voice's clips, the centre held within
      CENTRE_BAND of the expectation;
    - the speech rate, log(voiced seconds per spoken character), otherwise (no prior)."""

    MAD_FLOOR = 0.04
    # log units. The expectation's own spread: Piper's per-id frame rate runs 1.94-2.78 frames
    # per id over pieces (5th-95th percentile), and whole clips of the example and held-out corpora
    # lie within about +-0.25 of it; the MAD of clean clips' paces about their median was 0.052 on
    # the example corpus and 0.054 on the held-out one (docs/quality.md). The spread is the prior's
    # always: learnt from the run, it widens with every failure the gate misses.
    PRIOR_MAD = 0.05
    CENTRE_BAND = 0.1
    LEARN_Z = 1.5  # only paces this typical join the history

    def __init__(self) -> None:
        self.by_voice: dict[tuple, deque] = {}

    def add(self, voice: str, value: Optional[float], kind: str = "rate") -> None:
        """A clip that passed: its pace (`kind` "pace", already a log) or speech rate (s per unit)."""
        if value is None or (kind == "rate" and not value > 0):
            return
        self.by_voice.setdefault((kind, voice), deque(maxlen=HISTORY)).append(
            value if kind == "pace" else math.log(value))

    def z(self, voice: str, value: Optional[float], min_history: int, kind: str = "rate") -> Optional[float]:
        if value is None or (kind == "rate" and not value > 0):
            return None
        x = value if kind == "pace" else math.log(value)
        seen = self.by_voice.get((kind, voice))
        if seen is None or len(seen) < min_history:
            if kind != "pace":
                return None
            return round(x / (1.4826 * self.PRIOR_MAD), 3)
        values = sorted(seen)
        median = _median(values)
        if kind == "pace":
            median = min(max(median, -self.CENTRE_BAND), self.CENTRE_BAND)
            return round((x - median) / (1.4826 * self.PRIOR_MAD), 3)
        mad = max(_median(sorted(abs(v - median) for v in values)), self.MAD_FLOOR)
        return round((x - median) / (1.4826 * mad), 3)


class Calibration:
    """The hearing limits per voice, adapted to the scores its clips that passed get on this corpus:
    a limit moves down to (median - CAL_K x 1.4826 MAD) of the voice's passing clips, once it has
    CAL_MIN of them, never further than CAL_SLACK below the configured limit. A hard text domain
    (names, foreign words) scores lower than the text the defaults were set on; its clips then
    are not dropped for it, and the limits used are reported (stats.json, the audit page)."""

    CAL_MIN = 16
    CAL_K = 4.0
    CAL_SLACK: ClassVar[dict] = {"support": 1.0, "worst": 0.5}

    def __init__(self) -> None:
        self.seen: dict[tuple, deque] = {}

    def add(self, voice: str, asr: dict) -> None:
        for name in ("support", "worst"):
            if asr.get(name) is not None:
                self.seen.setdefault((name, voice), deque(maxlen=HISTORY)).append(asr[name])

    def limit(self, voice: str, name: str, configured: float) -> float:
        seen = self.seen.get((name, voice))
        if seen is None or len(seen) < self.CAL_MIN:
            return configured
        values = sorted(seen)
        median = _median(values)
        mad = max(_median(sorted(abs(v - median) for v in values)), 0.05)
        adapted = median - self.CAL_K * 1.4826 * mad
        return round(max(min(configured, adapted), configured - self.CAL_SLACK[name]), 3)

    def limits(self, voice: str, limits: Limits) -> dict:
        return {"min_support": self.limit(voice, "support", limits.min_support),
                "min_word_support": self.limit(voice, "worst", limits.min_word_support)}

    def report(self, limits: Limits) -> dict:
        """voice -> the limits in use and the passing clips they came from."""
        voices = sorted({voice for _, voice in self.seen})
        return {v: {**self.limits(v, limits), "clips": len(self.seen.get(("support", v), ()))} for v in voices}


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else (sorted_values[mid - 1] + sorted_values[mid]) / 2


def flags(signals: dict, lm: Optional[dict], z: Optional[float], limits: Limits, sentence_silence: float,
          pace_z: Optional[float] = None) -> list[str]:
    """The flags a clip's signals raise (hard ones first, in HARD and SOFT order)."""
    raised = set()
    if lm:
        if lm.get("stop") == "length_cap":
            raised.add("length_cap")
        if lm.get("stop") == "nonfinite":
            raised.add("nonfinite")
        if (lm.get("token_run") or 0) >= limits.max_token_run:
            raised.add("token_loop")
    if signals.get("end_db", -200.0) > limits.max_end_db:
        raised.add("cut_end")
    if signals["lead_s"] > limits.max_lead_s:
        raised.add("long_lead")
    if signals["tail_s"] > limits.max_tail_s:
        raised.add("long_tail")
    if signals["gap_s"] > limits.max_gap_s + sentence_silence:
        raised.add("long_gap")
    if signals["flatness"] > limits.max_flatness:
        raised.add("noise")
    if signals["clipped"] > limits.max_clipped:
        raised.add("clipped")
    if pace_z is not None and pace_z > limits.max_pace_z:
        raised.add("too_long")
    if pace_z is not None and pace_z < -limits.max_pace_z:
        raised.add("too_short")
    if z is not None and z > limits.max_z:
        raised.add("slow")
    if z is not None and z < -limits.max_z:
        raised.add("fast")
    if signals["speech_share"] < limits.min_speech_share:
        raised.add("low_speech")
    return [f for f in (*HARD, *SOFT) if f in raised]


def pace(signals: dict, expected_s: Optional[float]) -> Optional[float]:
    """log(speech seconds / expected seconds), the speech being from its first sound to its last."""
    if not expected_s or expected_s <= 0 or signals.get("speech_s", 0) <= 0:
        return None
    return round(math.log(signals["speech_s"] / expected_s), 4)


def assess(signals: dict, lm: Optional[dict], voice: str, history: PaceHistory, limits: Limits,
           sentence_silence: float, attempt: int = 0, expected_s: Optional[float] = None) -> Verdict:
    """A clip's verdict before any hearing and judgement: its pace against the voice's clips so far
    (or, when its engine expects no length, its speech rate), and the flags its signals raise.
    Nothing joins the history here: `learn` adds the clip once it is judged."""
    expected_s = round(expected_s, 4) if expected_s else None  # as recorded: `cosybatch qc` judges by the record
    p = pace(signals, expected_s)
    if p is not None:
        signals = {**signals, "expected_s": expected_s, "pace": p}
        pace_z, z = history.z(voice, p, limits.min_history, kind="pace"), None
    else:
        pace_z, z = None, history.z(voice, signals["s_per_unit"], limits.min_history)
    raised = flags(signals, lm, z, limits, sentence_silence, pace_z)
    return Verdict(attempt, signals, raised, lm, pace_z if p is not None else z)


def learn(verdict: Verdict, voice: str, history: PaceHistory, calibration: Optional[Calibration] = None) -> None:
    """A first take that raised no flag and was not failed joins its voice's history (and its
    hearing scores the calibration)."""
    if verdict.attempt != 0 or verdict.flags or verdict.passed is False:
        return
    if "pace" in verdict.signals:
        if verdict.z is None or abs(verdict.z) <= history.LEARN_Z:  # a passing outlier does not move the norm
            history.add(voice, verdict.signals["pace"], kind="pace")
    else:
        history.add(voice, verdict.signals["s_per_unit"])
    if calibration is not None and verdict.asr is not None:
        calibration.add(voice, verdict.asr)


@dataclass
class Verdict:
    """One attempt's judgement, as recorded in KEY.json."""

    attempt: int
    signals: dict
    flags: list[str]
    lm: Optional[dict] = None
    z: Optional[float] = None
    asr: Optional[dict] = None  # {"text", "cer", "wer"}
    passed: Optional[bool] = None  # None: no gate ran (mode signals)
    reason: Optional[str] = None  # why it failed

    def score(self, limits: Limits) -> float:
        """How bad the clip looks, for ranking (0: nothing wrong; 1 or more: past a limit)."""
        parts = [0.0]
        if any(f in HARD for f in self.flags):
            parts.append(2.0)
        if self.z is not None:
            parts.append(abs(self.z) / limits.max_z)
        if self.asr is not None and self.asr.get("cer") is not None:
            parts.append(self.asr["cer"] / max(limits.max_cer, 1e-6))
        if self.asr is not None and self.asr.get("support") is not None:
            short = limits.min_support - self.asr["support"]
            parts += [(1 + short / 2) if short > 0 else 0.0, self.asr["beyond_s"] / max(limits.max_beyond_s, 1e-6),
                      self.asr["stretch_s"] / max(limits.max_stretch_s, 1e-6)]
        parts.append(max(0.0, limits.min_speech_share - self.signals["speech_share"]) * 4)
        return round(max(parts), 4)

    def record(self, limits: Limits) -> dict:
        out = {"attempt": self.attempt, "flags": self.flags, "signals": self.signals}
        if self.lm is not None:
            out["lm"] = self.lm
        if self.z is not None:
            out["z"] = self.z
        if self.asr is not None:
            out["asr"] = self.asr
        if self.passed is not None:
            out["pass"] = self.passed
        if self.reason:
            out["reason"] = self.reason
        out["score"] = self.score(limits)
        return out


def judge(verdict: Verdict, settings: QCSettings, limits: Optional[dict] = None) -> None:
    """Set `passed` and `reason` of an attempt whose signals (and hearing, if it ran) are in.
    `limits` are the voice's calibrated hearing limits (`Calibration.limits`), if any."""
    if not settings.gating:
        return
    lim = settings.limits
    hard = [f for f in verdict.flags if f in HARD]
    soft = [f for f in verdict.flags if f in SOFT]
    why = []
    if hard:
        why.append(", ".join(hard))
    asr = verdict.asr
    if asr is not None and asr.get("support") is not None:
        limits = limits or {"min_support": lim.min_support, "min_word_support": lim.min_word_support}
        if asr["support"] < limits["min_support"]:
            why.append(f"text not heard (support {asr['support']:.2f} < {limits['min_support']:.2f})")
        elif asr["worst"] < limits["min_word_support"]:
            why.append(f"words not heard (support {asr['worst']:.2f} < {limits['min_word_support']:.2f} "
                       f"near {_weakest(asr)!r})")
        if asr["beyond_s"] > lim.max_beyond_s:
            why.append(f"speech past the text ({asr['beyond_s']:.2f} s > {lim.max_beyond_s:g} s)")
        if asr["stretch_s"] > lim.max_stretch_s:
            why.append(f"speech the text does not account for ({asr['stretch_s']:.2f} s > {lim.max_stretch_s:g} s)")
    elif asr is not None:
        cer, wer = asr["cer"], asr["wer"]
        if cer > lim.max_cer:
            why.append(f"cer {cer:.3g} > {lim.max_cer:g}")
        if lim.max_wer is not None and wer > lim.max_wer:
            why.append(f"wer {wer:.3g} > {lim.max_wer:g}")
    elif soft:
        why.append(", ".join(soft))  # no ASR to settle it: the flag decides
    verdict.passed = not why
    verdict.reason = "; ".join(why) or None


def _weakest(asr: dict) -> str:
    """The word the audio supports least (the words carry their probability with the audio)."""
    words = [w for w in asr.get("words") or () if any(c.isalnum() for c in w[0])]
    return min(words, key=lambda w: w[3])[0] if words else ""


def wants_asr(verdict: Verdict, settings: QCSettings, seed: int, item_id: str) -> bool:
    """Whether this attempt is transcribed (mode asr only)."""
    if settings.mode != "asr":
        return False
    if settings.asr_rows == "all":
        return True
    if any(f in HARD for f in verdict.flags):
        return False  # failed whatever the ASR hears: save the transcription
    if verdict.flags:
        return True
    return settings.asr_rows == "sample" and sampled(seed, item_id, settings.sample)


@dataclass
class QCCounts:
    """What the gate saw in one run, for stats.json "qc" (and merged across ray-run's actors)."""

    measured: int = 0  # first takes measured
    flagged: int = 0  # first takes with any flag
    flags: dict = field(default_factory=dict)  # flag -> first takes raising it
    dead: int = 0  # first takes with no speech at all (empty, NaN, constant)
    transcribed: int = 0  # takes the ASR heard, scored or transcribed (every attempt)
    cer_sum: float = 0.0  # over first takes transcribed
    cer_n: int = 0
    support_sum: float = 0.0  # over first takes scored
    support_n: int = 0
    retries: int = 0  # takes after the first
    passed_after_retry: int = 0
    failed: int = 0  # rows dropped by the gate
    kept_failing: int = 0  # rows kept marked qc.pass = false (--qc-on-fail keep)
    passed: int = 0  # committed rows the gate passed
    by_voice: dict = field(default_factory=dict)  # voice -> [committed, passed]
    calibration: dict = field(default_factory=dict)  # voice -> the hearing limits in use (the latest report)

    def first_take(self, raised: list[str]) -> None:
        self.measured += 1
        if raised:
            self.flagged += 1
        for f in raised:
            self.flags[f] = self.flags.get(f, 0) + 1

    def heard_take(self, attempt: int, support: float) -> None:
        self.transcribed += 1
        if attempt == 0:
            self.support_sum += support
            self.support_n += 1

    def transcribed_take(self, attempt: int, cer: float) -> None:
        self.transcribed += 1
        if attempt == 0:
            self.cer_sum += cer
            self.cer_n += 1

    def committed(self, verdict: Verdict, voice: str) -> None:
        entry = self.by_voice.setdefault(voice, [0, 0])
        entry[0] += 1
        if verdict.passed or (verdict.passed is None and not verdict.flags):  # no gate: unflagged counts
            entry[1] += 1
        if verdict.passed:
            self.passed += 1

    def merge(self, other: dict) -> None:
        for name, value in other.items():
            if name == "flags":
                for f, n in value.items():
                    self.flags[f] = self.flags.get(f, 0) + n
            elif name == "calibration":
                self.calibration.update(value)
            elif name == "by_voice":
                for voice, (c, p) in value.items():
                    entry = self.by_voice.setdefault(voice, [0, 0])
                    entry[0] += c
                    entry[1] += p
            elif hasattr(self, name):
                setattr(self, name, getattr(self, name) + value)

    def raw(self) -> dict:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}

    def summary(self, settings: QCSettings) -> dict:
        """stats.json's "qc" block."""
        out = {"mode": settings.mode, "measured": self.measured, "flagged": self.flagged,
               "flags": dict(sorted(self.flags.items())), "dead": self.dead}
        if settings.mode == "asr":
            out.update(asr_rows=settings.asr_rows, transcribed=self.transcribed,
                       support_mean=round(self.support_sum / self.support_n, 4) if self.support_n else None,
                       cer_mean=round(self.cer_sum / self.cer_n, 4) if self.cer_n else None)
        if settings.gating:
            out.update(passed=self.passed, retries=self.retries, passed_after_retry=self.passed_after_retry,
                       failed=self.failed, kept_failing=self.kept_failing,
                       limits=asdict(settings.limits), on_fail=settings.on_fail, max_retries=settings.retries)
        out["by_voice"] = {v: {"committed": c, "passed": p} for v, (c, p) in sorted(self.by_voice.items())}
        if self.calibration:
            out["calibration"] = dict(sorted(self.calibration.items()))
        return out
