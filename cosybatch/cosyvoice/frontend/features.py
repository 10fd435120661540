"""CosyVoice2 prompt-audio features and a cached voice bank.

For a zero-shot prompt wav, CosyVoice2 needs three things, each from its own front end:

* speech tokens (25 Hz): whisper-style 128-bin log-mel of the 16 kHz audio -> ``speech_tokenizer_v2.onnx``;
* a 192-d speaker embedding: kaldi fbank (80 bins) of the 16 kHz audio, mean-normalised over time ->
  ``campplus.onnx``;
* the prompt mel: matcha-style 80-bin log-mel of the audio at the flow's rate (24 kHz), 50 frames/s,
  trimmed together with the tokens so that there are exactly two mel frames per token.

Upstream (FunAudioLLM/CosyVoice) recomputes all of this for every call. :class:`VoiceBank` computes it
once per distinct prompt (file identity + prompt text) and caches the result, errors included, so a
corpus with 10k rows sharing one prompt costs one feature extraction, and a broken prompt fails every
row at once with the same reason.

Everything here is our own code on numpy/torch/soxr/kaldi-native-fbank; no torchaudio, librosa or
whisper at run time.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import UsageError

SPEAKER_DIM = 192
MAX_PROMPT_SECONDS = 30.0  # upstream's speech tokenizer refuses longer audio
TOKENIZER_RATE = 16000  # speech tokenizer and campplus both read 16 kHz audio
MEL_PER_TOKEN = 2  # CosyVoice2 and 3 flows: 50 Hz mel, 25 Hz tokens

# whisper's front end (whisper/audio.py constants)
WHISPER_N_FFT = 400
WHISPER_HOP = 160



@dataclass(frozen=True)
class MelSettings:
    """matcha's mel spectrogram as the yaml's ``feat_extractor`` sets it: the flow's prompt features."""

    sample_rate: int = 24000
    n_fft: int = 1920
    hop: int = 480
    win: int = 1920
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float | None = 8000.0

    @classmethod
    def from_yaml(cls, raw: dict[str, Any], sample_rate: int) -> MelSettings:
        from ..yamlconf import Call

        node = raw.get("feat_extractor")
        if not isinstance(node, Call):
            return cls()  # CosyVoice2's, for a yaml that leaves it out
        k = node.kwargs
        try:
            fmax = k.get("fmax", 8000)
            return cls(int(k.get("sampling_rate", sample_rate)), int(k["n_fft"]), int(k["hop_size"]),
                       int(k["win_size"]), int(k.get("num_mels", 80)), float(k.get("fmin", 0)),
                       None if fmax is None else float(fmax))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"feat_extractor: {exc!r} in {k}") from None


V2_MEL = MelSettings()  # cosyvoice2.yaml's feat_extractor


class PromptError(ValueError):
    """A per-row failure with a human-readable reason (bad prompt audio, unknown speaker, ...)."""


# ---------------------------------------------------------------------------- audio


def load_audio(path: str | os.PathLike[str], max_seconds: float = MAX_PROMPT_SECONDS) -> tuple[np.ndarray, int]:
    """Read an audio file with soundfile as mono float32 (channels averaged); returns ``(samples, rate)``.

    Raises :class:`PromptError` for a missing, unreadable or empty file, non-finite samples, or audio
    longer than ``max_seconds`` (checked from the header, before decoding).
    """
    import soundfile as sf

    p = Path(path)
    if not p.exists():
        raise PromptError(f"prompt audio {str(p)!r} does not exist")
    if not p.is_file():
        raise PromptError(f"prompt audio {str(p)!r} is not a file")
    try:
        with sf.SoundFile(str(p)) as f:
            rate, frames = int(f.samplerate), int(f.frames)
            if rate > 0 and frames / rate > max_seconds:
                raise PromptError(
                    f"prompt audio {str(p)!r} is {frames / rate:.2f} s long; the limit is {max_seconds:g} s "
                    f"(upstream's speech tokenizer is limited to {MAX_PROMPT_SECONDS:g} s of prompt audio)"
                )
            data = f.read(dtype="float32", always_2d=True)
    except PromptError:
        raise
    except (sf.SoundFileError, RuntimeError, OSError, ValueError) as err:
        raise PromptError(f"cannot read prompt audio {str(p)!r}: {err}") from err
    if data.shape[0] == 0:
        raise PromptError(f"prompt audio {str(p)!r} is empty (no samples)")
    mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    if not np.isfinite(mono).all():
        raise PromptError(f"prompt audio {str(p)!r} contains NaN or infinite samples")
    return np.ascontiguousarray(mono, dtype=np.float32), rate


def resample(x: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Resample a 1-D signal with soxr (``HQ``); returns float32, unchanged (as float32) when the rates match."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if int(sr_in) == int(sr_out):
        return x
    import soxr

    return np.ascontiguousarray(soxr.resample(x, int(sr_in), int(sr_out), quality="HQ"), dtype=np.float32)


# ---------------------------------------------------------------------------- mel filterbank

_SLANEY_SP = 200.0 / 3.0  # Hz per mel in the linear region
_SLANEY_BREAK_HZ = 1000.0  # linear below, logarithmic above
_SLANEY_BREAK_MEL = _SLANEY_BREAK_HZ / _SLANEY_SP  # 15 mel
_SLANEY_LOGSTEP = math.log(6.4) / 27.0  # 27 mel per factor 6.4 above 1 kHz


def hz_to_mel_slaney(hz: np.ndarray | float) -> np.ndarray:
    """Slaney (Auditory Toolbox) mel scale: linear up to 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / _SLANEY_SP
    log = _SLANEY_BREAK_MEL + np.log(np.maximum(hz, _SLANEY_BREAK_HZ) / _SLANEY_BREAK_HZ) / _SLANEY_LOGSTEP
    return np.where(hz >= _SLANEY_BREAK_HZ, log, linear)


def mel_to_hz_slaney(mel: np.ndarray | float) -> np.ndarray:
    """Inverse of :func:`hz_to_mel_slaney`."""
    mel = np.asarray(mel, dtype=np.float64)
    linear = mel * _SLANEY_SP
    log = _SLANEY_BREAK_HZ * np.exp(_SLANEY_LOGSTEP * (np.maximum(mel, _SLANEY_BREAK_MEL) - _SLANEY_BREAK_MEL))
    return np.where(mel >= _SLANEY_BREAK_MEL, log, linear)


def slaney_mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """Triangular mel filterbank ``(n_mels, n_fft // 2 + 1)`` float32, as ``librosa.filters.mel`` with its defaults.

    Band edges are ``n_mels + 2`` points evenly spaced on the slaney mel scale between ``fmin`` and
    ``fmax`` (default ``sr / 2``); filter ``i`` rises from edge ``i`` to a peak of ``2 / (edge[i+2] -
    edge[i])`` at edge ``i + 1`` and falls to zero at edge ``i + 2`` (slaney area normalisation: every
    triangle has unit area in Hz).
    """
    if fmax is None:
        fmax = sr / 2.0
    bins = np.linspace(0.0, sr / 2.0, n_fft // 2 + 1)  # centre frequency of each rfft bin
    edges = mel_to_hz_slaney(np.linspace(hz_to_mel_slaney(fmin), hz_to_mel_slaney(fmax), n_mels + 2))
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins[None, :] - lo) / (mid - lo)
    falling = (hi - bins[None, :]) / (hi - mid)
    tri = np.clip(np.minimum(rising, falling), 0.0, None)
    return (tri * (2.0 / (hi - lo))).astype(np.float32)


@lru_cache(maxsize=8)
def _mel_filters_tensor(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float | None) -> torch.Tensor:
    return torch.from_numpy(slaney_mel_filters(sr, n_fft, n_mels, fmin, fmax))


@lru_cache(maxsize=4)
def _hann(n: int) -> torch.Tensor:
    return torch.hann_window(n)  # periodic, as whisper and matcha use it


# ---------------------------------------------------------------------------- front ends


def whisper_log_mel(wav16k: np.ndarray, n_mels: int = 128) -> np.ndarray:
    """Whisper's log-mel spectrogram of 16 kHz audio, ``(n_mels, len // 160)`` float32.

    STFT (n_fft 400, hop 160, periodic hann, centred with reflect padding), power of every frame but the
    last, slaney mel filters, ``log10(max(x, 1e-10))``, floored at ``max - 8``, then ``(x + 4) / 4``.
    """
    x = torch.from_numpy(np.ascontiguousarray(wav16k, dtype=np.float32))
    if x.ndim != 1:
        raise ValueError(f"expected 1-D audio, got shape {tuple(x.shape)}")
    if x.numel() <= WHISPER_N_FFT // 2:
        raise PromptError(f"prompt audio too short for the speech tokenizer ({x.numel()} samples at 16 kHz)")
    spec = torch.stft(
        x,
        WHISPER_N_FFT,
        WHISPER_HOP,
        window=_hann(WHISPER_N_FFT),
        center=True,
        pad_mode="reflect",
        return_complex=True,
    )
    power = spec[:, :-1].abs() ** 2
    mel = _mel_filters_tensor(TOKENIZER_RATE, WHISPER_N_FFT, n_mels, 0.0, None) @ power
    log = torch.clamp(mel, min=1e-10).log10()
    log = torch.maximum(log, log.max() - 8.0)
    return ((log + 4.0) / 4.0).numpy()


def _fbank_options(num_mel_bins: int):
    """kaldi-native-fbank options equal to ``torchaudio.compliance.kaldi.fbank(w, num_mel_bins=N, dither=0,
    sample_frequency=16000)``, i.e. Kaldi's ``compute-fbank-feats`` defaults with dither off."""
    import kaldi_native_fbank as knf

    opts = knf.FbankOptions()
    f = opts.frame_opts
    f.samp_freq = float(TOKENIZER_RATE)  # sample_frequency=16000
    f.frame_length_ms = 25.0  # 400-sample frames
    f.frame_shift_ms = 10.0  # 160-sample hop -> 100 frames/s
    f.dither = 0.0  # upstream passes dither=0 (knf's own default is 3e-5)
    f.snip_edges = True  # only whole frames: 1 + (n - 400) // 160 frames, no edge padding
    f.window_type = "povey"  # hann ** 0.85, Kaldi's default
    f.preemph_coeff = 0.97  # x[t] -= 0.97 * x[t-1] within each frame (x[-1] := x[0])
    f.remove_dc_offset = True  # subtract each frame's mean before pre-emphasis
    f.round_to_power_of_two = True  # zero-pad 400 -> 512-point FFT
    m = opts.mel_opts
    m.num_bins = int(num_mel_bins)  # 80 for campplus
    m.low_freq = 20.0  # Hz
    m.high_freq = 0.0  # <= 0 means Nyquist + high_freq: 8000 Hz
    m.vtln_low = 100.0  # unused: no VTLN warp (vtln_warp 1.0)
    m.vtln_high = -500.0
    if hasattr(m, "is_librosa"):
        m.is_librosa = False  # Kaldi's own mel banks (1127 ln(1 + f/700), unnormalised triangles)
    if hasattr(m, "htk_mode"):
        m.htk_mode = False
    opts.use_energy = False  # no energy coefficient: exactly num_mel_bins columns
    opts.raw_energy = True  # (only used with use_energy)
    opts.htk_compat = False
    opts.use_log_fbank = True  # log(max(mel energy, float32 eps)), as torchaudio
    opts.use_power = True  # power spectrum |X|^2, not magnitude
    return opts


def kaldi_fbank(wav16k: np.ndarray, num_mel_bins: int = 80) -> np.ndarray:
    """Kaldi log-mel filterbank ``(frames, num_mel_bins)`` float32 of 16 kHz audio, as upstream feeds campplus.

    The waveform is used unscaled (floats in [-1, 1]), like upstream's call of torchaudio's ``kaldi.fbank``
    on the loaded tensor. Frames: ``1 + (len - 400) // 160`` (0 for audio under 25 ms).
    """
    import kaldi_native_fbank as knf

    x = np.ascontiguousarray(wav16k, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"expected 1-D audio, got shape {x.shape}")
    fbank = knf.OnlineFbank(_fbank_options(num_mel_bins))
    fbank.accept_waveform(float(TOKENIZER_RATE), x)
    fbank.input_finished()
    n = fbank.num_frames_ready
    if n == 0:
        return np.zeros((0, num_mel_bins), dtype=np.float32)
    return np.stack([np.asarray(fbank.get_frame(i), dtype=np.float32) for i in range(n)])


def prompt_mel(wav: np.ndarray, s: MelSettings = V2_MEL) -> np.ndarray:
    """Matcha-style log-mel of audio at ``s.sample_rate``, ``(len // hop, n_mels)`` float32: the
    flow's prompt features.

    Reflect-pad (n_fft - hop) / 2 samples each side, STFT (periodic hann window, not centred),
    magnitude ``sqrt(re^2 + im^2 + 1e-9)``, slaney mel fmin-fmax, ``log(max(x, 1e-5))``. CosyVoice2:
    24 kHz, n_fft 1920, hop 480, 0-8000 Hz; CosyVoice-300M: 22.05 kHz, 1024, 256, 0-8000 Hz;
    CosyVoice3: as CosyVoice2 up to Nyquist.
    """
    x = torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32))
    if x.ndim != 1:
        raise ValueError(f"expected 1-D audio, got shape {tuple(x.shape)}")
    pad = (s.n_fft - s.hop) // 2
    if x.numel() <= pad:
        raise PromptError(f"prompt audio too short for the prompt mel ({x.numel()} samples at {s.sample_rate} Hz)")
    x = torch.nn.functional.pad(x[None, None], (pad, pad), mode="reflect")[0, 0]
    spec = torch.view_as_real(
        torch.stft(x, s.n_fft, s.hop, s.win, window=_hann(s.win), center=False, return_complex=True)
    )
    mag = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    mel = _mel_filters_tensor(s.sample_rate, s.n_fft, s.n_mels, s.fmin, s.fmax) @ mag
    return torch.log(torch.clamp(mel, min=1e-5)).T.contiguous().numpy()


# ---------------------------------------------------------------------------- voices


@dataclass(frozen=True, eq=False)
class Voice:
    """Everything the LLM and flow need about a voice. Shared between rows: treat the tensors as read-only.

    ``key`` is a stable id for provenance (``spk:NAME`` or ``prompt:<sha1 of file bytes + text>``);
    voices compare and hash by it.
    """

    key: str
    embedding: torch.Tensor  # (192,) float32
    prompt_text: str = ""  # '' for SFT speakers
    prompt_tokens: torch.Tensor | None = None  # (P,) int64, 25 Hz
    prompt_mel: torch.Tensor | None = None  # (2P, 80) float32

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Voice) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


def file_sha1(path: str | os.PathLike[str], extra: bytes = b"") -> str:
    """sha1 of a file's bytes followed by ``extra``, hex."""
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    h.update(extra)
    return h.hexdigest()


def load_spk2info(path: Path) -> dict[str, Any] | None:
    """``spk2info.pt`` ({speaker name: {'embedding': tensor, ...}}), or None when the model has none.

    Loaded weights-only, so a pickle of anything else (an object of some class, a function call)
    is refused, never run. That file, or a corrupt one, is the user's to replace: a usage error
    naming it, not a traceback."""
    if not path.is_file():
        return None
    fix = "re-save it holding only tensors, dicts, lists and strings, or use the official CosyVoice2-0.5B file"
    try:
        info = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError... for unsafe or corrupt files
        raise UsageError(f"{path}: cannot be loaded as a weights-only checkpoint ({_load_error(exc)}); {fix}") from None
    if not isinstance(info, dict) or not all(isinstance(name, str) for name in info):
        raise UsageError(f"{path}: expected a dict of speaker name -> {{'embedding': tensor}}, "
                         f"found {type(info).__name__}; {fix}")
    return info


def _load_error(exc: Exception) -> str:
    """The one useful sentence of torch's load error. The rest is advice to retry with
    ``weights_only=False`` or to allowlist the class: exactly what an untrusted file must not get."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = lines[0].split(". ")[0].rstrip(".")[:200] if lines else ""
    return f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__


class VoiceBank:
    """Speaker embeddings (``spk2info.pt``) and zero-shot prompt features, computed once and cached.

    ``prompt`` results (and :class:`PromptError` failures) are kept in a thread-safe LRU keyed by
    (resolved path, size, mtime, prompt text); concurrent requests for the same prompt share one
    computation. The ONNX sessions are created on first use, so SFT-only jobs never load them.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        providers: Sequence[str | tuple[str, dict[str, Any]]] | None = None,
        mel: MelSettings = V2_MEL,
        speech_tokenizer: str = "speech_tokenizer_v2.onnx",
        mel_per_token: int | None = MEL_PER_TOKEN,
        cache_size: int = 256,
        threads: int = 1,
    ) -> None:
        """``mel``: the flow's prompt mel (the yaml's feat_extractor); ``mel_per_token``: prompt mel
        frames per prompt speech token, to which both are trimmed (None: kept as they are, for
        CosyVoice-300M, whose flow interpolates tokens to mel frames)."""
        self.model_dir = Path(model_dir)
        self.providers = list(providers) if providers else ["CPUExecutionProvider"]
        self.mel = mel
        self.sample_rate = mel.sample_rate
        self.speech_tokenizer = speech_tokenizer
        self.mel_per_token = mel_per_token
        self.cache_size = max(1, int(cache_size))
        self.threads = int(threads)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Voice | PromptError] = OrderedDict()
        self._pending: dict[tuple, Future] = {}
        self._sessions: dict[str, Any] = {}
        self._session_lock = threading.Lock()  # separate: loading a model must not block cache hits
        self.spk2info: dict[str, Any] | None = load_spk2info(self.model_dir / "spk2info.pt")

    # -- SFT speakers

    @property
    def speakers(self) -> list[str]:
        """Names in ``spk2info.pt`` (empty when the model has none)."""
        return sorted(self.spk2info) if self.spk2info else []

    def speaker(self, name: str) -> Voice:
        """The built-in (SFT) speaker ``name``: its embedding, no prompt."""
        if self.spk2info is None:
            raise PromptError(f"speaker {name!r}: this model has no spk2info.pt, so it has no built-in speakers")
        if name not in self.spk2info:
            raise PromptError(f"unknown speaker {name!r}; available: {', '.join(self.speakers) or '(none)'}")
        info = self.spk2info[name]
        emb = info.get("embedding") if isinstance(info, dict) else None
        if not isinstance(emb, torch.Tensor):
            raise PromptError(
                f"speaker {name!r} in spk2info.pt has no 'embedding' tensor (a saved zero-shot speaker?); "
                "use its prompt audio instead"
            )
        emb = emb.detach().to("cpu", torch.float32).reshape(-1)
        if emb.numel() != SPEAKER_DIM:
            raise PromptError(f"speaker {name!r}: embedding has {emb.numel()} values, expected {SPEAKER_DIM}")
        return Voice(key=f"spk:{name}", embedding=emb.contiguous())

    # -- zero-shot prompts

    def prompt(self, wav_path: str | os.PathLike[str], prompt_text: str) -> Voice:
        """Features of a zero-shot prompt (audio + its transcript), computed once per distinct file and text."""
        if not isinstance(prompt_text, str):
            raise PromptError(f"prompt text for {str(wav_path)!r} must be a string, got {type(prompt_text).__name__}")
        path = Path(wav_path).expanduser()
        if "\x00" in str(path):  # the OS refuses it with a ValueError, not an OSError
            raise PromptError(f"prompt audio {str(path)!r}: a path cannot hold a NUL byte")
        try:
            resolved = path.resolve()
            st = resolved.stat()
        except OSError as err:
            raise PromptError(f"prompt audio {str(path)!r} does not exist or cannot be accessed: {err}") from err
        key = (str(resolved), st.st_size, st.st_mtime_ns, prompt_text)
        owner = False
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            else:
                fut = self._pending.get(key)
                if fut is None:
                    fut = self._pending[key] = Future()
                    owner = True
        if hit is not None:
            return _unwrap(hit)
        if not owner:
            return _unwrap(fut.result())
        try:
            result: Voice | PromptError = self._compute(resolved, prompt_text)
        except PromptError as err:
            result = err
        except BaseException as err:  # not a prompt problem: do not cache, let waiters see it too
            with self._lock:
                self._pending.pop(key, None)
            fut.set_exception(err)
            raise
        with self._lock:
            self._cache[key] = result
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self._pending.pop(key, None)
        fut.set_result(result)
        return _unwrap(result)

    def cache_info(self) -> dict[str, int]:
        """Number of cached prompts (successes and failures) and the bound."""
        with self._lock:
            return {"entries": len(self._cache), "max": self.cache_size}

    def _compute(self, path: Path, prompt_text: str) -> Voice:
        audio, sr = load_audio(path)  # its errors name the path already
        try:
            wav16 = resample(audio, sr, TOKENIZER_RATE)
            wav_flow = resample(audio, sr, self.sample_rate)
            tokens = self.speech_tokens(wav16)
            mel = prompt_mel(wav_flow, self.mel)
            ratio = self.mel_per_token
            n = min(mel.shape[0] // ratio, tokens.shape[0]) if ratio else tokens.shape[0]
            if n == 0 or mel.shape[0] == 0:
                raise PromptError("too short to give one speech token")
            embedding = self.embedding(wav16)
        except PromptError as err:
            seconds = audio.shape[0] / sr
            raise PromptError(f"prompt audio {str(path)!r} ({seconds:.3f} s): {err}") from None
        key = "prompt:" + file_sha1(path, b"\0" + prompt_text.encode("utf-8"))
        return Voice(
            key=key,
            embedding=torch.from_numpy(embedding),
            prompt_text=prompt_text,
            prompt_tokens=torch.from_numpy(tokens[:n].astype(np.int64)),
            prompt_mel=torch.from_numpy(np.ascontiguousarray(mel[: ratio * n] if ratio else mel)),
        )

    def speech_tokens(self, wav16k: np.ndarray) -> np.ndarray:
        """Speech tokens (int64; 25 Hz, CosyVoice-300M 50 Hz) of 16 kHz audio through the model's
        speech tokenizer (v1's gives them as [1, 1, T], v2's and v3's as [1, T])."""
        feats = whisper_log_mel(wav16k, n_mels=128)[None]
        sess = self._session(self.speech_tokenizer)
        inputs = sess.get_inputs()
        out = sess.run(None, {inputs[0].name: feats, inputs[1].name: np.array([feats.shape[2]], dtype=np.int32)})[0]
        return np.asarray(out).reshape(-1).astype(np.int64)

    def embedding(self, wav16k: np.ndarray) -> np.ndarray:
        """192-d speaker embedding (float32) of 16 kHz audio through ``campplus.onnx``."""
        feat = kaldi_fbank(wav16k, num_mel_bins=80)
        if feat.shape[0] == 0:
            raise PromptError("prompt audio is shorter than one 25 ms fbank frame")
        feat = feat - feat.mean(axis=0, keepdims=True)
        sess = self._session("campplus.onnx")
        out = sess.run(None, {sess.get_inputs()[0].name: feat[None].astype(np.float32)})[0]
        return np.asarray(out, dtype=np.float32).reshape(-1)

    def _session(self, filename: str):
        with self._session_lock:
            sess = self._sessions.get(filename)
            if sess is not None:
                return sess
            import onnxruntime as ort

            path = self.model_dir / filename
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: zero-shot prompts need it")
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            opts.intra_op_num_threads = self.threads
            sess = self._sessions[filename] = ort.InferenceSession(str(path), opts, providers=self.providers)
            return sess


def _unwrap(result: Voice | PromptError) -> Voice:
    if isinstance(result, PromptError):
        raise PromptError(str(result))  # a fresh exception each time: no traceback pile-up across rows
    return result
