"""The cheap quality signals against clips with known defects: numpy-made speech-like clips (voiced
syllables in words, short pauses, a fade into silence), a voice's history of clean ones, then each
kind of failure that benchmarks/qc_detection.py injects into real speech, judged as `--qc gate`
judges (qc.gate.flags and judge)."""

from __future__ import annotations

import numpy as np
import pytest

from cosybatch.qc.gate import PaceHistory, QCSettings, Verdict, flags, judge
from cosybatch.qc.signals import measure
from cosybatch.run.executor import clip_fault

RATE = 16000
SYLLABLE_S = 0.18
PAUSE_S = 0.07  # between words: under signals.BRIDGE_S
VOICE = "synthetic"


def syllable(rng: np.random.Generator) -> np.ndarray:
    t = np.arange(round(SYLLABLE_S * RATE)) / RATE
    f0 = rng.uniform(100, 140)
    tone = sum(np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 6)) / k for k in range(1, 12))
    return (np.hanning(t.size) ** 0.5 * tone).astype(np.float32)


def utterance(words: int, rng: np.random.Generator) -> tuple[np.ndarray, str, list[int]]:
    """A clip of `words` words of 2-3 syllables, 0.1 s of silence before and 0.15 s after, its
    text (three letters a syllable) and the sample at the middle of each syllable."""
    pieces = [np.zeros(round(0.1 * RATE), np.float32)]
    text, middles, at = [], [], pieces[0].size
    for _ in range(words):
        n = int(rng.integers(2, 4))
        for _ in range(n):
            s = syllable(rng)
            pieces.append(s)
            middles.append(at + s.size // 2)
            at += s.size
        text.append("abc" * n)
        gap = np.zeros(round(PAUSE_S * RATE), np.float32)
        pieces.append(gap)
        at += gap.size
    pieces.append(np.zeros(round(0.15 * RATE), np.float32))
    audio = np.concatenate(pieces)
    return audio / np.abs(audio).max(), " ".join(text) + ".", middles


@pytest.fixture(scope="module")
def voice():
    """A history of 16 clean clips of one voice, and one more clean clip to break."""
    rng = np.random.default_rng(3)
    history = PaceHistory()
    for _ in range(16):
        audio, text, _ = utterance(int(rng.integers(4, 12)), rng)
        history.add(VOICE, measure(audio, RATE, text).s_per_unit)
    return history, utterance(8, rng)


def judged(history: PaceHistory, audio: np.ndarray, text: str) -> Verdict:
    settings = QCSettings(mode="gate")
    signals = measure(audio, RATE, text, raw=[audio]).as_dict()
    z = history.z(VOICE, signals["s_per_unit"], settings.limits.min_history)
    verdict = Verdict(0, signals, flags(signals, None, z, settings.limits, 0.0), None, z)
    judge(verdict, settings)
    return verdict


def test_clean_clip_passes(voice):
    history, (audio, text, _) = voice
    verdict = judged(history, audio, text)
    assert verdict.flags == [] and verdict.passed, verdict
    assert verdict.signals["end_db"] < -60  # it decays into silence


def test_truncated_clip_stops_mid_speech(voice):
    history, (audio, text, middles) = voice
    cut = middles[int(len(middles) * 0.55)]  # inside a syllable
    verdict = judged(history, audio[:cut], text)
    assert "cut_end" in verdict.flags and "fast" in verdict.flags and verdict.passed is False, verdict


def test_repeated_clip_is_slow(voice):
    history, (audio, text, _) = voice
    verdict = judged(history, np.concatenate([audio, audio]), text)
    assert verdict.flags == ["slow"] and verdict.passed is False, verdict
    half = len(audio) // 2
    verdict = judged(history, np.concatenate([audio[:half], audio]), text)  # its first half said twice
    assert "slow" in verdict.flags and verdict.passed is False, verdict


def test_silence_inside(voice):
    history, (audio, text, _) = voice
    at = len(audio) // 2
    verdict = judged(history, np.concatenate([audio[:at], np.zeros(2 * RATE, np.float32), audio[at:]]), text)
    assert "long_gap" in verdict.flags and verdict.passed is False, verdict
    # the pauses left out of the speech rate: 2 s of silence does not make the clip "slow"
    assert "slow" not in verdict.flags


def test_noise(voice):
    history, (audio, text, _) = voice
    rms = float(np.sqrt(np.mean(audio.astype(np.float64) ** 2)))
    noise = (np.random.default_rng(0).standard_normal(audio.size) * rms).astype(np.float32)
    verdict = judged(history, noise / np.abs(noise).max(), text)
    assert "noise" in verdict.flags and verdict.passed is False, verdict


def test_zeros_are_caught_by_the_clip_floor(voice):
    _, (audio, _, _) = voice
    assert "constant audio" in clip_fault(np.zeros_like(audio))
