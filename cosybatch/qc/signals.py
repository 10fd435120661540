"""Quality signals of one clip that need no model: where the speech is, how fast it is said, how
loud and whether it clips, whether it sounds like noise. Plain numpy, a few milliseconds per
minute of audio.

Silence is found with an energy detector, not a neural VAD. TTS output is studio-clean: between
words it falls to (near) digital silence, so frame energy against the clip's own loud frames
separates speech from silence as well as a VAD does (the probe in docs/quality.md), at any sample
rate, without resampling, and at a cost that disappears beside synthesis. A VAD is the better
tool for recorded speech with a noise floor; noise in a synthetic clip is caught instead by the
spectral flatness below (and by the ASR gate).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FRAME_S = 0.010  # energy frames
SPEECH_DB = -35.0  # a frame is speech within this many dB of the clip's loud frames (95th percentile)
FLOOR_DB = -60.0  # and above this level, relative to full scale
BRIDGE_S = 0.25  # pauses shorter than this (between words) count as speech
END_S = 0.030  # the clip's end: its level says whether it stops in silence or mid-speech
FLATNESS_N = 512  # FFT size of the flatness frames


@dataclass(frozen=True)
class Signals:
    duration_s: float
    lead_s: float  # silence before the first speech
    tail_s: float  # silence after the last speech
    gap_s: float  # the longest silence between two stretches of speech
    speech_s: float  # from the first speech to the last
    speech_share: float  # share of the clip inside speech stretches (pauses under BRIDGE_S included)
    voiced_s: float  # the speech frames themselves, no pause counted (not even those under BRIDGE_S)
    end_db: float  # level of the last END_S against the loud frames: near SPEECH_DB or above, the clip is cut
    units: int  # spoken characters (letters and digits) of the text
    s_per_unit: float | None  # voiced_s / units: the speech rate, pauses (which punctuation varies) left out
    peak_db: float  # of the clip as committed, dBFS
    rms_db: float
    clipped: float  # share of the engine's own samples at or beyond full scale (before normalisation)
    flatness: float  # median spectral flatness of the speech frames: near 0 for speech, about 0.5 for white noise

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def spoken_units(text: str) -> int:
    """Letters and digits: the unit speech rate is measured in, the same for every engine."""
    return sum(1 for c in text if c.isalnum())


def _db(x: float) -> float:
    return 20.0 * math.log10(x) if x > 1e-10 else -200.0


def _levels(audio: np.ndarray, sample_rate: int) -> tuple[np.ndarray, float]:
    """The RMS level of each FRAME_S frame and the clip's loud level (their 95th percentile)."""
    hop = max(1, round(FRAME_S * sample_rate))
    n = len(audio) // hop
    if n == 0:
        return np.zeros(0), 0.0
    frames = audio[: n * hop].astype(np.float64).reshape(n, hop)
    level = np.sqrt((frames * frames).mean(axis=1))
    return level, float(np.quantile(level, 0.95))


def speech_frames(audio: np.ndarray, sample_rate: int, bridge: bool = True) -> np.ndarray:
    """One bool per FRAME_S frame: speech (after bridging the short pauses between words, unless
    `bridge` is false)."""
    level, loud = _levels(audio, sample_rate)
    if loud <= 1e-10:
        return np.zeros(level.size, dtype=bool)
    speech = level > max(loud * 10 ** (SPEECH_DB / 20), 10 ** (FLOOR_DB / 20))
    return bridged(speech) if bridge else speech


def bridged(speech: np.ndarray) -> np.ndarray:
    """Speech frames with the pauses shorter than BRIDGE_S between two of them filled in."""
    speech = speech.copy()
    idx = np.flatnonzero(speech)
    if idx.size > 1:
        width = max(1, round(BRIDGE_S / FRAME_S))
        for a, b in itertools.pairwise(idx):
            if 1 < b - a <= width:
                speech[a:b] = True
    return speech


def end_level(audio: np.ndarray, sample_rate: int) -> float:
    """dB of the clip's last END_S (its loudest frame there) against the clip's loud frames. A
    finished utterance decays into silence (the default voice ends 72-80 dB down); a clip cut
    short, by a crash or a length cap, stops while speech still sounds (within SPEECH_DB)."""
    level, loud = _levels(audio, sample_rate)
    if loud <= 1e-10:
        return -200.0
    last = level[-max(1, round(END_S / FRAME_S)) :]
    return max(-200.0, _db(float(last.max()) / loud))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of True."""
    if mask.size == 0:
        return []
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


def flatness(audio: np.ndarray, speech: np.ndarray, sample_rate: int) -> float:
    """Median spectral flatness (geometric over arithmetic mean of the power spectrum) of up to 64
    frames taken evenly from the speech stretches."""
    hop = max(1, round(FRAME_S * sample_rate))
    starts = np.flatnonzero(speech) * hop
    starts = starts[starts + FLATNESS_N <= len(audio)]
    if starts.size == 0:
        return 0.0
    if starts.size > 64:
        starts = starts[np.linspace(0, starts.size - 1, 64).round().astype(int)]
    frames = np.stack([audio[s : s + FLATNESS_N] for s in starts]).astype(np.float64)
    power = np.abs(np.fft.rfft(frames * np.hanning(FLATNESS_N), axis=1)) ** 2 + 1e-20
    flat = np.exp(np.log(power).mean(axis=1)) / power.mean(axis=1)
    return float(np.median(flat))


def measure(audio: np.ndarray, sample_rate: int, text: str, raw: Sequence[np.ndarray] = ()) -> Signals:
    """The signals of a committed clip `audio` (float32 mono) that speaks `text`. `raw` are the
    engine's pieces before joining and normalisation, for the clipping share."""
    duration = len(audio) / sample_rate
    sounding = speech_frames(audio, sample_rate, bridge=False)
    voiced = float(sounding.sum()) * FRAME_S
    speech = bridged(sounding)
    runs = _runs(speech)
    if runs:
        first, last = float(runs[0][0]) * FRAME_S, float(runs[-1][1]) * FRAME_S
        lead, tail = first, max(0.0, duration - last)
        gap = max((float(b[0] - a[1]) * FRAME_S for a, b in itertools.pairwise(runs)), default=0.0)
        speech_s = last - first
        share = float(speech.sum()) * FRAME_S / duration if duration else 0.0
    else:
        lead, tail, gap, speech_s, share = duration, 0.0, 0.0, 0.0, 0.0
    units = spoken_units(text)
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    rms = float(np.sqrt(np.mean(np.square(audio, dtype=np.float64)))) if audio.size else 0.0
    total = sum(len(p) for p in raw)
    clipped = sum(int(np.count_nonzero(np.abs(p) >= 0.999)) for p in raw) / total if total else 0.0
    return Signals(
        duration_s=duration, lead_s=lead, tail_s=tail, gap_s=gap, speech_s=speech_s, speech_share=min(1.0, share),
        voiced_s=voiced, end_db=end_level(audio, sample_rate),
        units=units, s_per_unit=(voiced / units) if units and voiced > 0 else None,
        peak_db=_db(peak), rms_db=_db(rms), clipped=clipped, flatness=flatness(audio, speech, sample_rate),
    )
