"""CosyVoice2 prompt features (whisper log-mel, kaldi fbank, matcha mel) and the cached voice bank."""

from __future__ import annotations

import dataclasses
import math
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from cosybatch.cosyvoice.frontend import features
from cosybatch.cosyvoice.frontend.features import (
    MelSettings,
    PromptError,
    Voice,
    VoiceBank,
    kaldi_fbank,
    load_audio,
    prompt_mel,
    resample,
    slaney_mel_filters,
    whisper_log_mel,
)

# ---------------------------------------------------------------------------- helpers


def chirp(seconds: float, sr: int, f0: float = 150.0, f1: float = 3000.0, amp: float = 0.4) -> np.ndarray:
    t = np.arange(round(seconds * sr)) / sr
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * seconds))
    return (amp * np.sin(phase)).astype(np.float32)


def tone(seconds: float, sr: int, hz: float, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * hz * np.arange(round(seconds * sr)) / sr)).astype(np.float32)


@pytest.fixture()
def wavs(tmp_path: Path) -> dict[str, Path]:
    """A set of prompt files, good and bad."""
    rng = np.random.default_rng(1)
    out = {}
    left, right = chirp(1.2, 44100), chirp(1.2, 44100, f0=300.0, f1=5000.0, amp=0.2)
    out["chirp"] = tmp_path / "chirp_44k_stereo.wav"
    sf.write(out["chirp"], np.stack([left, right], axis=1), 44100)
    out["short"] = tmp_path / "half_second_16k.wav"
    sf.write(out["short"], (0.1 * rng.standard_normal(8000)).astype(np.float32) + tone(0.5, 16000, 220.0), 16000)
    out["long"] = tmp_path / "thirty_one_seconds.wav"
    sf.write(out["long"], np.zeros(31 * 8000, dtype=np.int16), 8000, subtype="PCM_16")
    out["empty_wav"] = tmp_path / "no_samples.wav"
    sf.write(out["empty_wav"], np.zeros(0, dtype=np.float32), 16000)
    out["zero_bytes"] = tmp_path / "zero_bytes.wav"
    out["zero_bytes"].write_bytes(b"")
    out["text"] = tmp_path / "not_audio.wav"
    out["text"].write_text("this is a transcript, not a RIFF file\n")
    out["tiny"] = tmp_path / "ten_ms.wav"
    sf.write(out["tiny"], tone(0.01, 16000, 440.0), 16000)
    return out


@pytest.fixture()
def onnx_calls(monkeypatch) -> list[str]:
    """Record every onnxruntime session run (by model file name)."""
    import onnxruntime as ort

    calls: list[str] = []
    real_run = ort.InferenceSession.run

    def counting_run(self, *args, **kwargs):
        calls.append(Path(self._model_path).name)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "run", counting_run)
    return calls


# ---------------------------------------------------------------------------- audio


def test_load_audio_mono_float32_and_resample(wavs):
    x, sr = load_audio(wavs["chirp"])
    assert sr == 44100 and x.dtype == np.float32 and x.ndim == 1 and x.shape[0] == 52920
    stereo, _ = sf.read(wavs["chirp"], dtype="float32")
    np.testing.assert_allclose(x, stereo.mean(axis=1), atol=1e-7)

    y16 = resample(x, 44100, 16000)
    y24 = resample(x, 44100, 24000)
    assert y16.dtype == np.float32 and abs(y16.shape[0] - 19200) <= 1
    assert abs(y24.shape[0] - 28800) <= 1
    assert resample(y16, 16000, 16000) is not None
    np.testing.assert_array_equal(resample(y16, 16000, 16000), y16)
    # A 1 kHz tone keeps its frequency and level through soxr.
    t = resample(tone(1.0, 44100, 1000.0), 44100, 16000)
    spectrum = np.abs(np.fft.rfft(t * np.hanning(t.size)))
    assert abs(np.argmax(spectrum) * 16000 / t.size - 1000.0) <= 1.0
    assert abs(np.abs(t[1000:-1000]).max() - 0.5) < 0.01


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("long", "31.00 s long; the limit is 30 s (upstream's speech tokenizer is limited to 30 s"),
        ("empty_wav", "is empty"),
        ("zero_bytes", "cannot read prompt audio"),
        ("text", "cannot read prompt audio"),
    ],
)
def test_load_audio_errors(wavs, name, needle):
    with pytest.raises(PromptError) as err:
        load_audio(wavs[name])
    assert needle in str(err.value)
    assert str(wavs[name]) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_load_audio_missing_and_custom_limit(tmp_path, wavs):
    with pytest.raises(PromptError, match="does not exist"):
        load_audio(tmp_path / "nope.wav")
    with pytest.raises(PromptError, match="is not a file"):
        load_audio(tmp_path)
    with pytest.raises(PromptError, match=r"1\.20 s long; the limit is 1 s"):
        load_audio(wavs["chirp"], max_seconds=1.0)
    # The text file's error carries soundfile's own reason, not just "failed".
    with pytest.raises(PromptError) as err:
        load_audio(wavs["text"])
    assert len(str(err.value).split(": ", 1)[1]) > 5


# ---------------------------------------------------------------------------- mel filterbank


def _mel(hz: np.ndarray) -> np.ndarray:
    """Slaney mel, written independently: 3 mel per 200 Hz up to 1 kHz, 27 mel per factor 6.4 above."""
    hz = np.asarray(hz, dtype=np.float64)
    return np.where(hz < 1000, 3 * hz / 200, 15 + 27 * np.log(np.maximum(hz, 1e-9) / 1000) / np.log(6.4))


def _hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel < 15, 200 * mel / 3, 1000 * 6.4 ** ((mel - 15) / 27))


@pytest.mark.parametrize(("sr", "n_fft", "n_mels", "fmax"), [(24000, 1920, 80, 8000.0), (22050, 2048, 128, None)])
def test_mel_filters_shape_and_area(sr, n_fft, n_mels, fmax):
    fb = slaney_mel_filters(sr, n_fft, n_mels, 0.0, fmax)
    assert fb.shape == (n_mels, n_fft // 2 + 1) and fb.dtype == np.float32
    assert (fb >= 0).all()
    edges = _hz(np.linspace(0.0, _mel(fmax or sr / 2), n_mels + 2))
    height = 2.0 / (edges[2:] - edges[:-2])  # slaney: unit area triangles
    df = sr / n_fft
    assert (fb.max(axis=1) <= height * (1 + 1e-5)).all()
    wide = (edges[2:] - edges[:-2]) / df >= 12  # triangles sampled by enough bins for a Riemann sum
    assert wide.sum() > n_mels // 3
    np.testing.assert_allclose(fb[wide].sum(axis=1) * df, 1.0, rtol=0.05)
    # Nothing above fmax, and every bin between two centres is covered by some filter.
    bins = np.arange(n_fft // 2 + 1) * df
    assert fb[:, bins > edges[-1] + 1e-6].max(initial=0.0) == 0.0
    covered = (bins >= edges[1]) & (bins <= edges[-2])
    assert (fb[:, covered].sum(axis=0) > 0).all()


def test_mel_filters_peaks_linear_then_log():
    sr, n_fft, n_mels = 16000, 32000, 40  # 0.5 Hz bins: the peaks land within half a bin of the centres
    fb = slaney_mel_filters(sr, n_fft, n_mels)
    peaks = fb.argmax(axis=1) * sr / n_fft
    centres = _hz(np.linspace(0.0, _mel(8000.0), n_mels + 2))[1:-1]
    np.testing.assert_allclose(peaks, centres, atol=0.5)
    low, high = peaks[peaks < 1000], peaks[peaks > 1000]
    assert len(low) >= 5 and len(high) >= 5
    step = np.diff(low)
    np.testing.assert_allclose(step, step.mean(), atol=1.0)  # evenly spaced in Hz below 1 kHz
    np.testing.assert_allclose(step.mean(), 200 / 3 * _mel(8000.0) / (n_mels + 1), rtol=1e-3)
    ratio = high[1:] / high[:-1]
    np.testing.assert_allclose(ratio, ratio.mean(), rtol=2e-3)  # evenly spaced in log(Hz) above
    # fmin/fmax move the edges: nothing below fmin.
    fb2 = slaney_mel_filters(sr, 2048, 20, fmin=300.0, fmax=4000.0)
    bins = np.arange(1025) * sr / 2048
    assert fb2[:, bins < 300.0].max() == 0.0 and fb2[:, bins > 4000.0].max() == 0.0


# ---------------------------------------------------------------------------- front ends


def test_whisper_log_mel_against_numpy_and_range():
    x = chirp(2.0, 16000) + 0.01 * np.random.default_rng(0).standard_normal(32000).astype(np.float32)
    m = whisper_log_mel(x, n_mels=128)
    assert m.shape == (128, 200) and m.dtype == np.float32
    assert m.max() - m.min() <= 2.0 + 1e-6  # floored at max - 8 (in log10), then divided by 4
    assert m.min() >= -1.5 and m.max() < 3.0

    # An independent float64 numpy version of the same recipe.
    padded = np.pad(x.astype(np.float64), 200, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 400)
    frames = np.stack([padded[i * 160 : i * 160 + 400] * window for i in range(x.size // 160 + 1)])
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    mel = slaney_mel_filters(16000, 400, 128).astype(np.float64) @ power[:-1].T
    ref = np.log10(np.maximum(mel, 1e-10))
    ref = (np.maximum(ref, ref.max() - 8.0) + 4.0) / 4.0
    np.testing.assert_allclose(m, ref, atol=2e-4)

    silent = whisper_log_mel(np.zeros(1600, dtype=np.float32), n_mels=80)
    assert silent.shape == (80, 10)
    np.testing.assert_allclose(silent, -1.5)


def test_kaldi_fbank_frames_and_properties():
    noise = 0.01 * np.random.default_rng(2).standard_normal(16000).astype(np.float32)
    x = tone(1.0, 16000, 1000.0) + noise  # the noise keeps (almost) every bin above the log floor
    fb = kaldi_fbank(x)
    live = fb > math.log(np.finfo(np.float32).eps) + 3
    assert live.mean() > 0.98
    assert fb.shape == (1 + (16000 - 400) // 160, 80) and fb.dtype == np.float32
    assert kaldi_fbank(x[:399]).shape == (0, 80)  # snip_edges: no partial frames
    assert kaldi_fbank(x[:400]).shape == (1, 80)
    # Kaldi's mel scale (1127 ln(1 + f/700)) from 20 Hz to Nyquist: the 1 kHz tone peaks in its bin.
    kmel = lambda f: 1127.0 * math.log(1.0 + f / 700.0)  # noqa: E731
    centres = [kmel(20.0) + (i + 1) * (kmel(8000.0) - kmel(20.0)) / 81 for i in range(80)]
    expected = int(np.argmin(np.abs(np.array(centres) - kmel(1000.0))))
    assert abs(int(np.bincount(fb.argmax(axis=1)).argmax()) - expected) <= 1
    # Power spectrum, log, unscaled input: doubling the signal adds ln 4 to every (non-floored) bin.
    np.testing.assert_allclose(kaldi_fbank(2 * x)[live], fb[live] + math.log(4.0), atol=2e-3)
    # DC offset removed per frame: a constant shift changes nothing.
    np.testing.assert_allclose(kaldi_fbank(x + 0.25), fb, atol=2e-2)

    # Pre-emphasis 0.97 tilts the spectrum: a 4 kHz tone carries |1 - 0.97 e^-jw|^2 times more
    # (total, i.e. summed over the bins) energy relative to a 200 Hz tone of the same level.
    def total(hz: float) -> float:
        return float(np.log(np.exp(kaldi_fbank(tone(0.5, 16000, hz))).sum(axis=1)).mean())

    gain = lambda hz: abs(1 - 0.97 * np.exp(-2j * np.pi * hz / 16000)) ** 2  # noqa: E731
    assert total(4000.0) - total(200.0) == pytest.approx(math.log(gain(4000.0) / gain(200.0)), abs=0.2)
    # Deterministic: dither is off.
    np.testing.assert_array_equal(kaldi_fbank(x), fb)


@pytest.mark.parametrize("settings", [
    MelSettings(),  # CosyVoice2
    MelSettings(22050, 1024, 256, 1024, fmax=8000.0),  # CosyVoice-300M
    MelSettings(fmax=None),  # CosyVoice3: up to Nyquist
], ids=["v2", "v1", "v3"])
def test_prompt_mel_frames_and_numpy_reference(settings):
    sr, n_fft, hop = settings.sample_rate, settings.n_fft, settings.hop
    x = chirp(1.0, sr) + 0.01 * np.random.default_rng(3).standard_normal(sr).astype(np.float32)
    m = prompt_mel(x, settings)
    assert m.shape == (sr // hop, 80) and m.dtype == np.float32
    padded = np.pad(x.astype(np.float64), (n_fft - hop) // 2, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    n = 1 + (padded.size - n_fft) // hop
    frames = np.stack([padded[i * hop : i * hop + n_fft] * window for i in range(n)])
    mag = np.sqrt(np.abs(np.fft.rfft(frames, axis=1)) ** 2 + 1e-9)
    filters = slaney_mel_filters(sr, n_fft, 80, 0.0, settings.fmax).T.astype(np.float64)
    np.testing.assert_allclose(m, np.log(np.maximum(mag @ filters, 1e-5)), atol=2e-3)
    assert prompt_mel(np.zeros(sr // 5, dtype=np.float32), settings).max() == pytest.approx(math.log(1e-5), abs=1e-6)
    with pytest.raises(PromptError, match="too short"):
        prompt_mel(np.zeros(100, dtype=np.float32), settings)


# ---------------------------------------------------------------------------- voice bank


def test_prompt_voice_shapes_alignment_and_determinism(cosyvoice_dir, wavs):
    bank = VoiceBank(cosyvoice_dir)
    v = bank.prompt(wavs["chirp"], "A rising tone.")
    assert v.key.startswith("prompt:") and len(v.key) == len("prompt:") + 40
    assert v.prompt_text == "A rising tone."
    assert v.embedding.shape == (192,) and v.embedding.dtype == torch.float32
    assert torch.isfinite(v.embedding).all() and v.embedding.abs().sum() > 0
    assert v.prompt_tokens is not None and v.prompt_mel is not None
    assert v.prompt_tokens.dtype == torch.long and v.prompt_tokens.ndim == 1
    p = v.prompt_tokens.shape[0]
    assert abs(p - 1.2 * 25) <= 1  # 25 Hz tokens
    assert v.prompt_mel.shape == (2 * p, 80) and v.prompt_mel.dtype == torch.float32
    assert ((v.prompt_tokens >= 0) & (v.prompt_tokens < 6561)).all()

    # 0.5 s at 16 kHz: 13 tokens from the tokenizer, 25 mel frames at 24 kHz -> aligned to 12 and 24.
    s = bank.prompt(wavs["short"], "Hi.")
    assert s.prompt_tokens.shape == (12,) and s.prompt_mel.shape == (24, 80)

    # A fresh bank (no cache) gives identical features.
    again = VoiceBank(cosyvoice_dir).prompt(wavs["chirp"], "A rising tone.")
    assert again.key == v.key and again == v and again is not v
    torch.testing.assert_close(again.embedding, v.embedding, rtol=0, atol=0)
    torch.testing.assert_close(again.prompt_tokens, v.prompt_tokens, rtol=0, atol=0)
    torch.testing.assert_close(again.prompt_mel, v.prompt_mel, rtol=0, atol=0)

    # The features are those of the module functions on the soxr-resampled audio.
    x, sr = load_audio(wavs["chirp"])
    mel = prompt_mel(resample(x, sr, 24000))[: 2 * p]
    np.testing.assert_array_equal(v.prompt_mel.numpy(), mel)
    x16 = resample(x, sr, 16000)
    emb = bank.embedding(x16)
    np.testing.assert_array_equal(v.embedding.numpy(), emb)
    # campplus reads the fbank mean-normalised over time, so the level of the prompt does not matter.
    import onnxruntime as ort

    campplus = ort.InferenceSession(str(cosyvoice_dir / "campplus.onnx"), providers=["CPUExecutionProvider"])
    fb = kaldi_fbank(x16)
    direct = campplus.run(None, {campplus.get_inputs()[0].name: (fb - fb.mean(axis=0))[None]})[0].reshape(-1)
    np.testing.assert_allclose(emb, direct, atol=1e-5)
    noisy = x16 + 0.05 * np.random.default_rng(4).standard_normal(x16.size).astype(np.float32)  # no floored bins
    np.testing.assert_allclose(bank.embedding(0.25 * noisy), bank.embedding(noisy), atol=1e-3)

    with pytest.raises(dataclasses.FrozenInstanceError):
        v.prompt_text = "changed"  # type: ignore[misc]


def test_prompt_cached_once_per_file_and_text(cosyvoice_dir, wavs, onnx_calls, tmp_path):
    bank = VoiceBank(cosyvoice_dir)
    first = bank.prompt(wavs["chirp"], "Text one.")
    assert sorted(onnx_calls) == ["campplus.onnx", "speech_tokenizer_v2.onnx"]
    for _ in range(5):
        assert bank.prompt(wavs["chirp"], "Text one.") is first
    # Same file through another spelling of its path: still the same entry.
    alias = tmp_path / "sub" / ".." / wavs["chirp"].name
    (tmp_path / "sub").mkdir()
    assert bank.prompt(alias, "Text one.") is first
    assert len(onnx_calls) == 2

    # Other text: another voice (same audio features), computed separately.
    other_text = bank.prompt(wavs["chirp"], "Text two.")
    assert len(onnx_calls) == 4
    assert other_text.key != first.key
    torch.testing.assert_close(other_text.embedding, first.embedding)

    # Other audio: a different embedding.
    other_audio = bank.prompt(wavs["short"], "Text one.")
    assert other_audio.key != first.key
    assert (other_audio.embedding - first.embedding).abs().max() > 1e-3

    # Rewriting the file invalidates the entry (size/mtime change) and gives a new key.
    sf.write(wavs["chirp"], chirp(1.0, 22050, f0=500.0), 22050)
    n = len(onnx_calls)
    changed = bank.prompt(wavs["chirp"], "Text one.")
    assert len(onnx_calls) == n + 2 and changed.key != first.key
    assert bank.cache_info()["entries"] == 4


def test_prompt_concurrent_requests_compute_once(cosyvoice_dir, wavs, onnx_calls):
    bank = VoiceBank(cosyvoice_dir)
    results: list[Voice] = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append(bank.prompt(wavs["chirp"], "Together."))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert sorted(onnx_calls) == ["campplus.onnx", "speech_tokenizer_v2.onnx"]


def test_prompt_lru_is_bounded(cosyvoice_dir, wavs, onnx_calls):
    bank = VoiceBank(cosyvoice_dir, cache_size=2)
    bank.prompt(wavs["short"], "a")
    bank.prompt(wavs["short"], "b")
    bank.prompt(wavs["short"], "a")  # refresh "a"
    bank.prompt(wavs["short"], "c")  # evicts "b"
    assert bank.cache_info() == {"entries": 2, "max": 2}
    assert len(onnx_calls) == 6
    bank.prompt(wavs["short"], "a")
    assert len(onnx_calls) == 6
    bank.prompt(wavs["short"], "b")
    assert len(onnx_calls) == 8


def test_prompt_errors_are_cached(cosyvoice_dir, wavs, monkeypatch, onnx_calls):
    bank = VoiceBank(cosyvoice_dir)
    loads: list[Path] = []
    real_load = features.load_audio

    def counting_load(path, *args, **kwargs):
        loads.append(Path(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(features, "load_audio", counting_load)
    messages = []
    for _ in range(10):
        with pytest.raises(PromptError) as err:
            bank.prompt(wavs["long"], "Too long.")
        messages.append(str(err.value))
    assert len(loads) == 1 and len(set(messages)) == 1
    assert "31.00 s" in messages[0] and "30 s" in messages[0]
    assert onnx_calls == []

    for name, needle in [
        ("empty_wav", "is empty"),
        ("text", "cannot read prompt audio"),
        ("zero_bytes", "cannot read prompt audio"),
        ("tiny", "(0.010 s): prompt audio too short for the speech tokenizer"),
    ]:
        with pytest.raises(PromptError) as err:
            bank.prompt(wavs[name], "x")
        assert needle in str(err.value) and str(wavs[name]) in str(err.value)
    with pytest.raises(PromptError, match="must be a string"):
        bank.prompt(wavs["short"], None)  # type: ignore[arg-type]
    with pytest.raises(PromptError, match="does not exist"):
        bank.prompt(wavs["chirp"].with_name("missing.wav"), "x")
    # A bad prompt does not poison good ones.
    assert bank.prompt(wavs["short"], "fine").prompt_tokens is not None


def test_sft_speakers(cosyvoice_dir, tmp_path):
    bank = VoiceBank(cosyvoice_dir)
    assert bank.speakers == ["alice", "bob"]
    info = torch.load(cosyvoice_dir / "spk2info.pt", weights_only=True)
    alice = bank.speaker("alice")
    assert alice.key == "spk:alice" and alice.prompt_text == ""
    assert alice.prompt_tokens is None and alice.prompt_mel is None
    assert alice.embedding.shape == (192,) and alice.embedding.dtype == torch.float32
    torch.testing.assert_close(alice.embedding, info["alice"]["embedding"].reshape(-1))
    assert bank.speaker("alice") == alice and bank.speaker("bob") != alice
    assert len({alice, bank.speaker("alice"), bank.speaker("bob")}) == 2

    with pytest.raises(PromptError, match=r"unknown speaker 'carol'; available: alice, bob"):
        bank.speaker("carol")

    bare = tmp_path / "no_spk2info"
    bare.mkdir()
    for name in ("campplus.onnx", "speech_tokenizer_v2.onnx"):
        shutil.copy(cosyvoice_dir / name, bare / name)
    bare_bank = VoiceBank(bare)
    assert bare_bank.speakers == []
    with pytest.raises(PromptError, match=r"no spk2info\.pt"):
        bare_bank.speaker("alice")
