"""CosyVoice-300M's text tokenizer: openai-whisper's multilingual BPE (51,866 ids).

The v1 yaml builds its tokenizer with ``whisper.tokenizer.get_tokenizer(multilingual=True,
num_languages=100, language='en', task='transcribe')`` and encodes with ``allowed_special='all'``;
the model folder ships no tokenizer file. Importing ``whisper`` pulls numba (and installing it
pulls triton), none of which a tokenizer needs, so here:

* ``tiktoken`` runs the BPE;
* the rank file ``multilingual.tiktoken`` is read from the installed ``openai-whisper`` package,
  found with :func:`importlib.util.find_spec` without importing it (``pip install --no-deps
  openai-whisper==20250625`` is enough), or from a path given explicitly;
* the special tokens are laid out as whisper lays them out: after the 50,257 BPE ranks come
  ``<|endoftext|>``, ``<|startoftranscript|>``, one ``<|xx|>`` per language (the first
  ``num_languages`` of whisper's list, in its order), ``<|translate|>``, ``<|transcribe|>``,
  ``<|startoflm|>``, ``<|startofprev|>``, ``<|nospeech|>``, ``<|notimestamps|>`` and the 1,501
  timestamps ``<|0.00|>`` ... ``<|30.00|>``.
"""

from __future__ import annotations

import base64
import importlib.util
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["WHISPER_LANGUAGES", "TokenizerNotInstalled", "WhisperTextTokenizer", "whisper_vocab_path"]

INSTALL_HINT = "pip install tiktoken && pip install --no-deps openai-whisper==20250625"

# Whisper's language codes in whisper's order (the order fixes the ids of <|en|> ... <|yue|>).
WHISPER_LANGUAGES: tuple[str, ...] = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv", "it", "id", "hi",
    "fi", "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no", "th", "ur", "hr", "bg", "lt", "la",
    "mi", "ml", "cy", "sk", "te", "fa", "lv", "bn", "sr", "az", "sl", "kn", "et", "mk", "br", "eu", "is", "hy",
    "ne", "mn", "bs", "kk", "sq", "sw", "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc", "ka", "be",
    "tg", "sd", "gu", "am", "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn", "mt", "sa", "lb", "my", "bo", "tl",
    "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw", "su", "yue",
)

# openai-whisper's pre-tokenisation pattern (GPT-2's).
_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|>, every 20 ms


class TokenizerNotInstalled(RuntimeError):
    """tiktoken or openai-whisper's vocabulary file is missing; the message says what to install."""


def whisper_vocab_path(name: str = "multilingual") -> Path:
    """``<name>.tiktoken`` inside the installed openai-whisper package (the package is not imported)."""
    spec = importlib.util.find_spec("whisper")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / "assets" / f"{name}.tiktoken"
        if path.is_file():
            return path
    where = f" (package found at {', '.join(folders)} without assets/{name}.tiktoken)" if folders else ""
    raise TokenizerNotInstalled(f"CosyVoice-300M's text tokenizer needs openai-whisper's vocabulary{where}; "
                                f"run: {INSTALL_HINT}")


def special_tokens(num_languages: int = 100) -> list[str]:
    """Whisper's special tokens in id order (they follow the BPE ranks)."""
    if not 0 < num_languages <= len(WHISPER_LANGUAGES):
        raise ValueError(f"num_languages must be in 1..{len(WHISPER_LANGUAGES)} (got {num_languages})")
    return [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *[f"<|{code}|>" for code in WHISPER_LANGUAGES[:num_languages]],
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
        *[f"<|{i * 0.02:.2f}|>" for i in range(TIMESTAMPS)],
    ]


_cache: dict[tuple[str, int], object] = {}
_cache_lock = threading.Lock()


def _encoding(path: Path, num_languages: int):
    """The tiktoken Encoding, built once per (file, languages): reading 50k ranks takes ~0.1 s."""
    key = (str(path), num_languages)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
        try:
            import tiktoken
        except ImportError:
            message = f"CosyVoice-300M's text tokenizer needs tiktoken; run: {INSTALL_HINT}"
            raise TokenizerNotInstalled(message) from None
        ranks: dict[bytes, int] = {}
        try:
            for line in path.read_text(encoding="utf-8").splitlines():
                if line:
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        except (OSError, ValueError) as exc:
            raise TokenizerNotInstalled(f"{path}: not a tiktoken rank file ({exc}); run: {INSTALL_HINT}") from None
        specials = {token: len(ranks) + i for i, token in enumerate(special_tokens(num_languages))}
        encoding = tiktoken.Encoding(name=path.name, pat_str=_PATTERN, mergeable_ranks=ranks,
                                     special_tokens=specials, explicit_n_vocab=len(ranks) + len(specials))
        _cache[key] = encoding
        return encoding


class WhisperTextTokenizer:
    """``whisper.tokenizer.get_tokenizer(multilingual=True, num_languages=100)`` as CosyVoice-300M
    uses it: :meth:`encode` gives the same ids, special tokens written in the text (``<|en|>``)
    included (upstream encodes with ``allowed_special='all'``)."""

    def __init__(self, vocab_path: str | Path | None = None, num_languages: int = 100) -> None:
        self.vocab_path = Path(vocab_path) if vocab_path is not None else whisper_vocab_path()
        self.num_languages = num_languages
        self._encoding = _encoding(self.vocab_path, num_languages)
        self.eot = self._encoding.eot_token
        self.timestamp_begin = self._encoding.encode_single_token("<|0.00|>")

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (51,866 for 100 languages)."""
        return self._encoding.n_vocab

    def token_to_id(self, token: str) -> int | None:
        """The id of a special token (``<|en|>``) or of a string that is one BPE token; else None."""
        try:
            return self._encoding.encode_single_token(token)
        except KeyError:
            return None

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode(text, allowed_special="all")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._encoding.encode_batch(list(texts), allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; timestamp tokens are dropped, other special tokens kept (as whisper's ``decode``)."""
        return self._encoding.decode([i for i in ids if i < self.timestamp_begin])

    def __len__(self) -> int:
        return self.vocab_size
