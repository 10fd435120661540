"""The clip's last stage (run/shaping.py) through real runs of the embedded voice: each format and
rate round-trips through soundfile and `verify`, loudness lands on its target as an independent
meter measures it, trimming keeps every voiced sample, and the settings are part of the job."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile
from helpers import assert_exactly_once, write_jsonl

from cosybatch.config import RunConfig
from cosybatch.errors import ResumeMismatchError, UsageError
from cosybatch.run.forecast import plan_only
from cosybatch.run.local import run
from cosybatch.run.shaping import to_loudness

ROWS = [
    {"id": "short", "text": "Yes."},
    {"id": "one", "text": "The quick brown fox jumps over the lazy dog."},
    {"id": "two", "text": "It was a bright cold day in April. The clocks were striking thirteen."},
]


def make(tmp_path, name, **options):
    corpus = tmp_path / "c.jsonl"
    if not corpus.exists():
        write_jsonl(corpus, ROWS)
    out = tmp_path / name
    result = run(RunConfig.from_options(corpus=corpus, out=out, progress="none", sentence_silence=0.3, **options))
    assert result.status == "complete"
    return out, assert_exactly_once(out, [r["id"] for r in ROWS])


# -- an independent loudness meter: ITU-R BS.1770-4 as the standard writes it, at 48 kHz -----------
# The K-weighting filter's two biquads with the coefficients the standard tabulates for 48 kHz
# (its Tables 1 and 2); the clip is brought to 48 kHz first (scipy's polyphase resampler, not the
# run's soxr). Gating: 400 ms blocks, 75 % overlap, an absolute gate at -70 LKFS and a relative one
# 10 LU below the absolutely gated loudness.
SHELF = ([1.53512485958697, -2.69169618940638, 1.19839281085285], [1.0, -1.69065929318241, 0.73248077421585])
HIGHPASS = ([1.0, -2.0, 1.0], [1.0, -1.99004745483398, 0.99007225036621])


def bs1770(audio: np.ndarray, rate: int) -> float:
    from scipy.signal import lfilter, resample_poly

    g = math.gcd(rate, 48000)
    x = resample_poly(audio.astype(np.float64), 48000 // g, rate // g)
    x = lfilter(*HIGHPASS, lfilter(*SHELF, x))
    block, step = 19200, 4800  # 400 ms, 100 ms at 48 kHz
    if len(x) < block:
        powers = np.array([np.mean(x * x)])
    else:
        powers = np.array([np.mean(x[i:i + block] ** 2) for i in range(0, len(x) - block + 1, step)])
    loud = -0.691 + 10 * np.log10(np.maximum(powers, 1e-20))
    powers = powers[loud > -70]
    relative = -0.691 + 10 * np.log10(powers.mean()) - 10
    powers = powers[-0.691 + 10 * np.log10(powers) > relative]
    return float(-0.691 + 10 * np.log10(powers.mean()))


def true_peak(audio: np.ndarray, rate: int) -> float:
    from scipy.signal import resample_poly

    return 20 * math.log10(float(np.max(np.abs(resample_poly(audio.astype(np.float64), 4, 1)))))


def test_each_format_and_rate_round_trips(tmp_path):
    options = {"wav": {"sample_rate": 16000}, "flac": {"audio_format": "flac", "sample_rate": 16000},
               "opus": {"audio_format": "opus"}}  # the voice's 22050 Hz -> Opus's 24000
    wav, wav_items = make(tmp_path, "wav16", **options["wav"])
    flac, flac_items = make(tmp_path, "flac16", **options["flac"])
    opus, opus_items = make(tmp_path, "opus", **options["opus"])
    for out, items, fmt, rate in ((wav, wav_items, "wav", 16000), (flac, flac_items, "flac", 16000),
                                  (opus, opus_items, "opus", 24000)):
        manifest = {r["id"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}
        for item_id, item in items.items():
            info = soundfile.info(io.BytesIO(item["data"]))
            assert item["meta"]["format"] == fmt and item["sample_rate"] == info.samplerate == rate
            assert info.format == {"wav": "WAV", "flac": "FLAC", "opus": "OGG"}[fmt]
            assert len(item["audio"]) == item["meta"]["num_samples"] == manifest[item_id]["num_samples"]
            assert manifest[item_id].get("format") == (None if fmt == "wav" else fmt)
            assert item["meta"].get("resampled_from") == (None if rate == 22050 else 22050)
        stats = json.loads((out / "stats.json").read_text())
        assert stats["items_done"] == len(ROWS)
        # --plan-only foresees the shards' size in this format and rate.
        planned = plan_only(RunConfig.from_options(corpus=tmp_path / "c.jsonl", out=tmp_path / "plan", progress="none",
                                                   sentence_silence=0.3, **options[fmt]))["plan"]["disk_bytes"]
        assert planned == pytest.approx(sum(p.stat().st_size for p in out.glob("shard-*.tar")), rel=0.35), fmt
    for item_id in wav_items:  # FLAC is lossless: the very samples of the WAV job at the same rate
        assert np.array_equal(flac_items[item_id]["audio"], wav_items[item_id]["audio"])
        assert len(flac_items[item_id]["data"]) < 0.8 * len(wav_items[item_id]["data"])
    for item_id, item in opus_items.items():  # lossy, at a fraction of the bytes (32 of WAV's 353 kbit/s)
        assert len(item["data"]) < 0.25 * len(wav_items[item_id]["data"]) * 22050 / 16000


def test_loudness_lands_on_the_target_under_the_true_peak_ceiling(tmp_path):
    out, items = make(tmp_path, "ebu", loudness=-23.0, sample_rate=16000, audio_format="flac")
    manifest = {r["id"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    for item_id, item in items.items():
        record = item["meta"]["loudness"]
        assert not record["limited_by_peak"]
        assert bs1770(item["audio"], item["sample_rate"]) == pytest.approx(-23.0, abs=0.5), item_id
        assert manifest[item_id]["loudness_lufs"] == record["lufs"] == pytest.approx(-23.0, abs=0.01)
        assert true_peak(item["audio"], item["sample_rate"]) <= -1.0 + 0.1
    # Loud enough that the ceiling holds them back (the run's clips asked for -9 LUFS under -2 dBTP,
    # through the stage itself): they stay under it, quieter than asked, and say so.
    for item_id, item in items.items():
        audio, record = to_loudness(item["audio"], item["sample_rate"], -9.0, -2.0)
        assert record["limited_by_peak"] and record["lufs"] < -9.0, item_id
        assert true_peak(audio, item["sample_rate"]) <= -2.0 + 0.1
        assert bs1770(audio, item["sample_rate"]) == pytest.approx(record["lufs"], abs=0.5)


def test_trimmed_clips_keep_every_voiced_sample(tmp_path):
    _, whole = make(tmp_path, "whole", normalize=False)
    _, trimmed = make(tmp_path, "trimmed", normalize=False, trim_silence=60)
    for item_id, item in whole.items():
        audio, cut = item["audio"], trimmed[item_id]
        lead, tail = cut["meta"]["trimmed_s"]
        start = round(lead * 22050)
        # The trimmed clip is the untrimmed one's middle, sample for sample ...
        assert np.array_equal(cut["audio"], audio[start:start + len(cut["audio"])])
        assert start + len(cut["audio"]) + round(tail * 22050) == len(audio)
        # ... and holds every voiced sample: each within 40 dB of the clip's peak (found here, sample by
        # sample, not by the frames the trimming reads), with at most 60 ms of silence either side.
        voiced = np.flatnonzero(np.abs(audio) >= 0.01 * np.max(np.abs(audio)))
        assert start <= voiced[0] and voiced[-1] < start + len(cut["audio"])
        margin = round(0.07 * 22050)
        assert voiced[0] - start <= margin and start + len(cut["audio"]) - voiced[-1] <= margin
        # Piece times move with the cut and stay inside the clip.
        segments = cut["meta"].get("segments")
        if segments:
            for before, after in zip(item["meta"]["segments"], segments, strict=True):
                assert after["start"] == pytest.approx(max(0.0, before["start"] - lead), abs=1e-5)
                assert 0 <= after["start"] <= after["end"] <= cut["meta"]["duration"] + 1e-9
    assert any(sum(i["meta"]["trimmed_s"]) > 0 for i in trimmed.values())  # something was cut


def test_a_resume_with_other_audio_settings_is_refused(tmp_path):
    out, _ = make(tmp_path, "job", audio_format="flac")
    corpus = tmp_path / "c.jsonl"
    with pytest.raises(ResumeMismatchError, match=r"audio\.format was 'flac', now 'opus'"):
        run(RunConfig.from_options(corpus=corpus, out=out, audio_format="opus", progress="none",
                                   sentence_silence=0.3))
    with pytest.raises(ResumeMismatchError, match=r"audio\.sample_rate was None, now 16000"):
        run(RunConfig.from_options(corpus=corpus, out=out, audio_format="flac", sample_rate=16000,
                                   progress="none", sentence_silence=0.3))


@pytest.mark.parametrize(("options", "message"), [
    ({"audio_format": "mp3"}, "--audio-format must be one of wav, flac, opus"),
    ({"bitrate": 64}, r"--bitrate is for the lossy format \(opus\); wav is lossless"),
    ({"audio_format": "opus", "bitrate": 300}, r"--bitrate must be a number in \[6, 256\]"),
    ({"sample_rate": 4000}, "--sample-rate must be a whole number in"),
    ({"trim_silence": 10}, "--trim-silence must be a whole number in"),
    ({"loudness": 3}, "--loudness must be a number in"),
])
def test_settings_out_of_range_are_refused_naming_the_option(options, message):
    with pytest.raises(UsageError, match=message):
        RunConfig.from_options(corpus="c.jsonl", out="out", **options)


def test_a_job_spec_sets_them_as_the_command_line_does(tmp_path):
    from cosybatch.jobspec import config_from_spec

    spec = tmp_path / "job.toml"
    spec.write_text('corpus = "c.jsonl"\nout = "out"\naudio_format = "opus"\nbitrate = 24\nsample_rate = 16000\n'
                    'loudness = -20\ntrue_peak = -2\ntrim_silence = 150\n')
    cfg = config_from_spec(spec)
    assert cfg.output.audio_settings() == {"format": "opus", "bitrate": 24, "sample_rate": 16000, "loudness": -20,
                                           "true_peak": -2, "trim_silence_ms": 150}
    assert cfg == RunConfig.from_options(corpus="c.jsonl", out="out", audio_format="opus",
                                         bitrate=24, sample_rate=16000, loudness=-20, true_peak=-2, trim_silence=150)
