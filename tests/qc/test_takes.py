"""The quality gate's retake loop in process (cosybatch.qc.takes.QualityGate): a failing clip is
made again through the caller's `remake`, and the row ends with the first passing take, its best
take (--qc-on-fail keep) or a failure that lists every take. The clips are synthetic (a voiced
harmonic tone, silence inserted where a fault is wanted), so each test knows what the signals see."""

from __future__ import annotations

import numpy as np
import pytest

from cosybatch.qc.gate import Limits, QCSettings
from cosybatch.qc.takes import Clip, QualityGate

SR = 22050


def voiced(seconds: float, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    x = sum(np.sin(2 * np.pi * 140.0 * k * t) / k for k in range(1, 12))
    x = x * (0.55 + 0.45 * np.sin(2 * np.pi * 4.0 * t) ** 2)
    x = x * (1 + 0.02 * np.random.default_rng(seed).standard_normal(len(t)))
    ramp = np.linspace(0, 1, len(t))
    x = x * np.minimum(1.0, ramp * 20) * np.minimum(1.0, (1 - ramp) * 8) ** 3  # no cut at either end
    return (x / np.abs(x).max()).astype(np.float32)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * SR), np.float32)


CLEAN = np.concatenate([silence(0.1), voiced(1.6), silence(0.15)])
GAPPED = np.concatenate([silence(0.1), voiced(1.8), silence(1.5), voiced(1.8, 1), silence(0.15)])  # long_gap only


def clip(index: int, audio, **kw) -> Clip:
    return Clip(ref=("row", index), row_id=f"r{index}", row_index=index, text="Hello there, my friend.",
                voice="v", sample_rate=SR, audio=audio, **kw)


def gate(mode="gate", retries=2, on_fail="drop") -> QualityGate:
    return QualityGate(QCSettings(mode, retries=retries, on_fail=on_fail, limits=Limits()), seed=0,
                       sentence_silence=0.0)


class Remaker:
    """The caller's side of a retake: records what it was asked and returns the next audio."""

    def __init__(self, takes):
        self.takes = takes  # attempt -> audio (or None: the row could not be prepared again)
        self.calls: list[tuple[list[int], int]] = []

    def __call__(self, clips, attempt):
        self.calls.append(([c.row_index for c in clips], attempt))
        audio = self.takes.get(attempt)
        return {} if audio is None else {c.row_index: clip(c.row_index, audio) for c in clips}


def test_a_failing_clip_is_made_again_and_its_passing_take_committed():
    g = gate()
    remake = Remaker({1: CLEAN})
    settled = g.settle([clip(0, CLEAN), clip(1, GAPPED)], remake)
    assert remake.calls == [([1], 1)]  # only the failing row, with the next attempt's seeds
    assert settled[0].failure is None and settled[0].qc["pass"] is True and "attempts" not in settled[0].qc
    kept = settled[1]
    assert kept.failure is None and kept.clip.audio is CLEAN
    assert [a["attempt"] for a in kept.qc["attempts"]] == [0, 1]
    assert kept.qc["attempts"][0]["flags"] == ["long_gap"] and kept.qc["attempts"][0]["pass"] is False
    counts = g.take_counts()
    assert (counts.retries, counts.passed_after_retry, counts.failed, counts.measured) == (1, 1, 0, 2)
    assert g.take_counts().retries == 0  # handed over once


def test_a_row_with_no_passing_take_fails_with_every_take():
    remake = Remaker({1: GAPPED, 2: GAPPED})
    [settled] = gate(retries=2).settle([clip(7, GAPPED)], remake)
    assert [attempt for _, attempt in remake.calls] == [1, 2]
    assert settled.clip is None
    assert settled.failure["id"] == "r7" and settled.failure["row"] == 7
    assert settled.failure["reason"] == "qc: long_gap after 3 attempts"
    assert [a["attempt"] for a in settled.failure["qc"]["attempts"]] == [0, 1, 2]


def test_keep_commits_the_best_take_marked_failing():
    worse = np.concatenate([silence(0.1), voiced(0.5), silence(3.0), voiced(0.5, 2), silence(0.15)])
    [settled] = gate(retries=1, on_fail="keep").settle([clip(0, worse)], Remaker({1: GAPPED}))
    assert settled.failure is None and settled.qc["pass"] is False
    scores = [a["score"] for a in settled.qc["attempts"]]
    assert settled.qc["score"] == min(scores)


def test_dead_audio_is_made_again_but_a_synthesis_error_is_final():
    remake = Remaker({1: CLEAN})
    dead, broken = clip(0, None, error="the engine returned empty audio (0 samples)", dead=True), \
        clip(1, None, error="synthesis failed: RuntimeError('x')")
    settled = gate().settle([dead, broken], remake)
    assert remake.calls == [([0], 1)]
    assert settled[0].clip.audio is CLEAN and settled[0].qc["attempts"][0]["reason"].startswith("the engine returned")
    assert settled[1].failure == {"id": "r1", "row": 1, "reason": "synthesis failed: RuntimeError('x')"}


def test_a_row_that_cannot_be_prepared_again_keeps_its_last_take():
    [settled] = gate(retries=2).settle([clip(0, GAPPED)], Remaker({}))
    assert settled.failure["reason"] == "qc: long_gap after 1 attempt"


@pytest.mark.parametrize("mode", ["off", "signals"])
def test_without_gating_nothing_is_made_again(mode):
    remake = Remaker({1: CLEAN})
    settled = gate(mode).settle([clip(0, GAPPED), clip(1, None, error="synthesis failed: x")], remake)
    assert remake.calls == []
    assert settled[0].clip.audio is GAPPED
    assert settled[0].qc is None if mode == "off" else settled[0].qc["flags"] == ["long_gap"]
    assert settled[1].failure["reason"] == "synthesis failed: x"


def test_an_engine_that_cannot_retake_gets_one_take(caplog):
    g = QualityGate(QCSettings("gate"), seed=0, sentence_silence=0.0, can_retake=False, engine_name="fixed")
    remake = Remaker({1: CLEAN})
    [settled] = g.settle([clip(0, GAPPED)], remake)
    assert remake.calls == [] and settled.failure["reason"] == "qc: long_gap after 1 attempt"
    assert "cannot make a row again" in caplog.text
