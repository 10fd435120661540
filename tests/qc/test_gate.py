"""The quality gate's parts on clips with known defects: signals, the speech-rate z-score, the
judgement, the scores, the seeds of a retake, and the settings from flags and job specs."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cosybatch.config import RunConfig
from cosybatch.cosyvoice.pipeline import token_repetition
from cosybatch.engines import item_seed
from cosybatch.errors import UsageError
from cosybatch.qc.asr import edit_distance, error_rates
from cosybatch.qc.gate import Limits, PaceHistory, QCSettings, Verdict, flags, judge, sampled, wants_asr
from cosybatch.qc.signals import measure, spoken_units
from cosybatch.store.items import qc_columns

RATE = 22050


def speechlike(seconds: float, seed: int = 0, word_s: float = 0.3, pause_s: float = 0.08) -> np.ndarray:
    """Voiced 'words' (a harmonic tone with vibrato under an envelope) and short pauses between them,
    50 ms of silence at each end: what TTS output looks like to an energy detector."""
    rng = np.random.default_rng(seed)
    out = [np.zeros(int(0.05 * RATE), np.float32)]
    total = 0.1
    while total < seconds - 0.1:
        n = int(word_s * RATE)
        t = np.arange(n) / RATE
        f0 = rng.uniform(100, 180)
        word = sum(np.sin(2 * np.pi * k * f0 * t + 3 * np.sin(2 * np.pi * 5 * t)) / k for k in range(1, 6))
        out += [(0.5 * word * np.hanning(n)).astype(np.float32), np.zeros(int(pause_s * RATE), np.float32)]
        total += word_s + pause_s
    out.append(np.zeros(int(0.05 * RATE), np.float32))
    return np.concatenate(out)


TEXT = "The quick brown fox jumps over the lazy dog."


def test_a_clean_clip_has_short_edges_no_gap_and_most_of_it_speech():
    s = measure(speechlike(3.0), RATE, TEXT)
    assert s.lead_s < 0.1 and s.tail_s < 0.2 and s.gap_s == 0.0
    assert s.speech_share > 0.85 and s.flatness < 0.1 and s.clipped == 0.0
    assert s.units == spoken_units(TEXT) == 35
    assert s.s_per_unit == pytest.approx(s.voiced_s / 35) and s.voiced_s < s.speech_s  # pauses left out


def test_silence_inside_and_at_the_ends_is_measured_to_the_frame():
    clip = speechlike(3.0)
    half = len(clip) // 2
    gap = np.concatenate([clip[:half], np.zeros(2 * RATE, np.float32), clip[half:]])
    s = measure(gap, RATE, TEXT)
    assert s.gap_s == pytest.approx(2.0, abs=0.2)
    tail = measure(np.concatenate([clip, np.zeros(3 * RATE, np.float32)]), RATE, TEXT)
    assert tail.tail_s == pytest.approx(3.0, abs=0.2) and tail.speech_share < 0.6
    lim = Limits()
    assert "long_gap" in flags(s.as_dict(), None, None, lim, 0.0)
    assert "long_gap" not in flags(s.as_dict(), None, None, lim, sentence_silence=2.0)  # the silence asked for
    assert {"long_tail", "low_speech"} <= set(flags(tail.as_dict(), None, None, lim, 0.0))


def test_noise_is_flat_and_clipping_is_counted_before_normalisation():
    noise = np.random.default_rng(1).uniform(-0.5, 0.5, 3 * RATE).astype(np.float32)
    s = measure(noise, RATE, TEXT)
    assert s.flatness > 0.4
    assert "noise" in flags(s.as_dict(), None, None, Limits(), 0.0)
    loud = speechlike(2.0) * 4
    raw = np.clip(loud, -1, 1)
    s = measure(raw / np.abs(raw).max(), RATE, TEXT, raw=[raw])
    assert s.clipped > 0.05 and "clipped" in flags(s.as_dict(), None, None, Limits(), 0.0)


def test_speech_rate_is_judged_against_the_voice_median_once_it_has_history():
    history = PaceHistory()
    rng = np.random.default_rng(0)
    for _ in range(7):
        history.add("joe", 0.06 * math.exp(rng.normal(0, 0.08)))
    assert history.z("joe", 0.12, min_history=8) is None  # too few clips yet
    history.add("joe", 0.06)
    assert history.z("joe", 0.12, 8) > 4 and history.z("joe", 0.03, 8) < -4
    assert abs(history.z("joe", 0.062, 8)) < 1
    assert history.z("ann", 0.06, 8) is None  # each voice on its own
    base = measure(speechlike(3.0), RATE, TEXT).as_dict()
    assert flags(base, None, 5.0, Limits(), 0.0) == ["slow"]
    assert flags(base, None, -5.0, Limits(), 0.0) == ["fast"]


def test_lm_stop_reasons_and_loops_are_hard_flags():
    base = measure(speechlike(3.0), RATE, TEXT).as_dict()
    assert flags(base, {"stop": "length_cap", "token_run": 3}, None, Limits(), 0.0) == ["length_cap"]
    assert flags(base, {"stop": "nonfinite", "token_run": 0}, None, Limits(), 0.0) == ["nonfinite"]
    assert flags(base, {"stop": "eos", "token_run": 30}, None, Limits(), 0.0) == ["token_loop"]
    assert token_repetition([1, 2, 3, 4, 5, 6]) == {"token_run": 1, "repeat_4gram": 0.0}
    looped = token_repetition([7] * 30 + [1, 2, 3, 4, 1, 2, 3, 4])
    assert looped["token_run"] == 30 and looped["repeat_4gram"] > 0.5


def verdict(flags_: list[str], cer=None) -> Verdict:
    v = Verdict(0, measure(speechlike(2.0), RATE, TEXT).as_dict(), flags_)
    if cer is not None:
        v.asr = {"text": "x", "cer": cer, "wer": cer}
    return v


def test_the_judgement_of_each_mode():
    gate, asr, signals = QCSettings(mode="gate"), QCSettings(mode="asr"), QCSettings(mode="signals")
    v = verdict(["slow"])
    judge(v, signals)
    assert v.passed is None  # no gate: recorded, never judged
    v = verdict(["slow"])
    judge(v, gate)
    assert (v.passed, v.reason) == (False, "slow")  # no ASR to settle a soft flag
    v = verdict(["slow"], cer=0.05)
    judge(v, asr)
    assert v.passed is True  # the ASR heard every word: the rate was just unusual
    v = verdict(["long_gap"], cer=0.0)
    judge(v, asr)
    assert (v.passed, v.reason) == (False, "long_gap")  # a hard flag fails whatever the ASR hears
    v = verdict([], cer=0.41)
    judge(v, asr)
    assert (v.passed, v.reason) == (False, "cer 0.41 > 0.2")
    v = verdict([], cer=0.205)
    judge(v, asr)
    assert v.reason == "cer 0.205 > 0.2"  # not "0.20 > 0.20"
    v = verdict([], cer=0.1)
    v.asr["wer"] = 0.6
    judge(v, QCSettings(mode="asr", limits=Limits(max_wer=0.5)))
    assert v.reason == "wer 0.6 > 0.5"


def heard(support=5.0, worst=2.0, beyond=0.0, stretch=0.4, flags_=()) -> Verdict:
    v = Verdict(0, measure(speechlike(2.0), RATE, TEXT).as_dict(), list(flags_))
    v.asr = {"logprob": -0.2, "support": support, "worst": worst, "beyond_s": beyond, "stretch_s": stretch,
             "words": [["The", 0.0, 0.2, 0.9], ["fox", 0.2, 0.5, 0.01], [".", 0.5, 0.6, 0.9]]}
    return v


def test_the_judgement_of_a_clip_scored_against_its_text():
    asr = QCSettings(mode="asr")
    cases = {
        "clean": (heard(), None),
        "another row's audio": (heard(support=0.8, worst=-2.0), "text not heard (support 0.80 < 3.00)"),
        "a word missing": (heard(worst=-1.5), "words not heard (support -1.50 < 1.00 near 'fox')"),
        "said twice": (heard(beyond=3.2), "speech past the text (3.20 s > 0.5 s)"),
        "a phrase repeated": (heard(stretch=1.6), "speech the text does not account for (1.60 s > 1.25 s)"),
        "slow but heard": (heard(flags_=["slow"]), None),  # the audio says the text: soft flags are settled
        "too long": (heard(flags_=["too_long"]), "too_long"),  # against the engine's expectation: hard
    }
    for name, (v, reason) in cases.items():
        judge(v, asr)
        assert (v.passed, v.reason) == (reason is None, reason), name
    v = heard(support=2.0)
    judge(v, asr, {"min_support": 1.5, "min_word_support": 0.0})  # a voice's calibrated limits
    assert v.passed is True


def test_pace_is_judged_against_the_expectation_until_the_voice_has_history():
    history, lim = PaceHistory(), Limits()
    assert history.z("v", math.log(1.5), lim.min_history, kind="pace") > lim.max_pace_z  # 1.5x: too long at once
    assert abs(history.z("v", math.log(1.2), lim.min_history, kind="pace")) < lim.max_pace_z
    rng = np.random.default_rng(0)
    for x in rng.normal(0.1, 0.03, 40):  # this voice runs 10% over its engine's expectation, evenly
        history.add("v", float(x), kind="pace")
    assert abs(history.z("v", 0.1, lim.min_history, kind="pace")) < 1
    assert history.z("v", math.log(1.5), lim.min_history, kind="pace") > lim.max_pace_z
    # A centre far from the expectation is held within CENTRE_BAND of it.
    drifted = PaceHistory()
    for x in rng.normal(0.6, 0.03, 40):
        drifted.add("v", float(x), kind="pace")
    assert drifted.z("v", 0.6, lim.min_history, kind="pace") > lim.max_pace_z


def test_only_clips_that_pass_teach_the_history_so_a_broken_run_stays_judged():
    from cosybatch.qc.gate import assess, learn

    settings, lim = QCSettings(mode="gate"), Limits()
    history = PaceHistory()
    clean = measure(speechlike(3.0), RATE, TEXT).as_dict()
    expected_clean = clean["speech_s"]
    verdicts = []
    # Three of every four clips are 1.6 times as long as their engine expects (a broken batch).
    for i in range(80):
        expected = expected_clean / (1.6 if i % 4 else 1.0)
        v = assess(clean, None, "v", history, lim, 0.0, 0, expected)
        judge(v, settings)
        learn(v, "v", history)
        verdicts.append(v)
    broken = [v for i, v in enumerate(verdicts) if i % 4]
    assert all(v.passed is False and "too_long" in v.flags for v in broken)
    assert all(v.passed for i, v in enumerate(verdicts) if not i % 4)
    assert len(history.by_voice[("pace", "v")]) == 20  # only the clean ones joined


def test_which_rows_the_asr_hears():
    flagged, clean, hard = verdict(["slow"]), verdict([]), verdict(["noise"])
    by_rows = {rows: QCSettings(mode="asr", asr_rows=rows, sample=0.3) for rows in ("flagged", "all", "sample")}
    assert [wants_asr(v, by_rows["flagged"], 0, "a") for v in (flagged, clean, hard)] == [True, False, False]
    assert [wants_asr(v, by_rows["all"], 0, "a") for v in (flagged, clean, hard)] == [True, True, True]
    assert not wants_asr(flagged, QCSettings(mode="gate"), 0, "a")
    chosen = [i for i in range(2000) if wants_asr(clean, by_rows["sample"], 7, f"id{i}")]
    assert 0.25 < len(chosen) / 2000 < 0.35
    assert chosen == [i for i in range(2000) if sampled(7, f"id{i}", 0.3)]  # stable: the same rows every run


def test_scores_rank_failures_above_clean_clips_and_columns_flatten():
    lim = Limits()
    assert verdict([]).score(lim) == 0.0
    assert verdict(["noise"]).score(lim) >= 2.0
    assert verdict([], cer=0.4).score(lim) == pytest.approx(2.0)
    assert heard(support=1.0).score(lim) > heard(support=2.5).score(lim) >= 1.0 > heard().score(lim)
    assert heard(beyond=1.0).score(lim) == pytest.approx(2.0)
    v = verdict(["slow"], cer=0.3)
    judge(v, QCSettings(mode="asr"))
    cols = qc_columns(v.record(lim))
    assert cols["qc_pass"] is False and cols["qc_flags"] == "slow" and cols["qc_cer"] == 0.3
    assert cols["qc_attempts"] == 1 and cols["qc_asr_text"] == "x"


def test_attempt_zero_keeps_the_seed_rows_always_had_and_retakes_differ():
    old = int.from_bytes(hashlib.blake2b(b"0\x00row\x000", digest_size=8).digest(), "little")
    assert item_seed(0, "row", 0) == item_seed(0, "row", 0, 0) == old
    assert len({item_seed(0, "row", 0, a) for a in range(4)}) == 4


def naive_distance(a, b) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[:], i
        for j, y in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (x != y))
    return row[-1]


@given(st.text("abc ", max_size=14), st.text("abc ", max_size=14))
def test_edit_distance_is_levenshtein(a, b):
    assert edit_distance(a, b) == naive_distance(a, b)
    assert edit_distance(a.split(), b.split()) == naive_distance(a.split(), b.split())


def test_error_rates_after_whisper_normalisation():
    assert error_rates("It cost $5.50 at the store.", "it cost five dollars and fifty cents at the store") == (0, 0)
    assert error_rates("Dr. Smith arrived.", "Doctor Smith arrived") == (0, 0)
    cer, wer = error_rates("the quick brown fox", "the quick")
    assert wer == 0.5 and 0.4 < cer < 0.6
    assert error_rates("?!", "") == (0, 0) and error_rates("?!", "words") == (1, 1)


def test_words_in_brackets_are_kept_in_the_reference_as_the_engine_speaks_them():
    text = "Mater artium necessitas. [Necessity is the mother of invention]."
    assert error_rates(text, "Mater artium necessitas. Necessity is the mother of invention.") == (0, 0)
    assert error_rates("He said (twice) <no>", "he said twice no") == (0, 0)


def test_settings_are_checked_with_the_flag_named(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "x"}\n')
    with pytest.raises(UsageError, match="--qc must be one of"):
        RunConfig.from_options(corpus=corpus, out=tmp_path / "o", qc="strict")
    with pytest.raises(UsageError, match=r"unknown threshold.*max_silence"):
        RunConfig.from_options(corpus=corpus, out=tmp_path / "o", qc_limits={"max_silence": 1})
    with pytest.raises(UsageError, match="max_gap_s = 'long' should be a number"):
        RunConfig.from_options(corpus=corpus, out=tmp_path / "o", qc_limits={"max_gap_s": "long"})
    cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "o", qc="gate", qc_limits={"max_gap_s": 2.5},
                                 qc_max_cer=0.1)
    settings = cfg.qc_settings()
    assert settings.limits.max_gap_s == 2.5 and settings.limits.max_cer == 0.1
    assert settings.fingerprint(None)["max_gap_s"] == 2.5
    assert QCSettings(mode="signals").fingerprint(None) is None  # measuring changes no audio
