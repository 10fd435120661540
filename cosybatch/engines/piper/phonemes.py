"""Text -> phonemes -> phoneme ids for a Piper voice: espeak-ng's clauses (through the bridge that
piper-tts ships), cut into pieces the model takes. One `Phonemizer` serves the engine and the INT8
calibration, so both see the same ids for the same text."""

from __future__ import annotations

import ctypes
import re
import threading
import unicodedata
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:
    from .voice import VoiceConfig

# Pieces longer than this many phoneme ids are split at clause, then word boundaries: very long
# sequences cost quadratic attention time and memory and gain nothing in prosody.
MAX_PIECE_IDS = 600
_ESPEAK_LOCK = threading.Lock()  # espeak-ng keeps global state: one caller at a time
_ESPEAK_READY = False
# The voice espeak-ng was last set to. espeak-ng allocates on every espeak_SetVoiceByName and frees
# nothing (about 1.3 KB a call, native memory): setting it once per row made `--plan-only` and a run
# grow by about 4 KB a row, so it is set only when it changes.
_ESPEAK_VOICE: Optional[str] = None
# espeak-ng's clause terminators (its translate.h CLAUSE_* values, masked with 0xFFFFF) -> the
# punctuation piper-tts's bridge reports for them; CLAUSE_TYPE_SENTENCE marks a sentence's end.
_CLAUSE_TYPE_SENTENCE = 0x00080000
_TERMINATORS = {40 | 0x80000: ".", 40 | 0x2000 | 0x80000: "?", 45 | 0x3000 | 0x80000: "!",
                20 | 0x1000 | 0x40000: ",", 30 | 0x40000: ":", 30 | 0x1000 | 0x40000: ";"}
_ESPEAK_CHARS_AUTO, _ESPEAK_PHONEMES_IPA = 0, 0x02
# espeak_TextToPhonemesWithTerminator, called straight (see `_espeak_phonemes`); None: not found.
_TEXT_TO_PHONEMES: Optional[Callable[..., Optional[bytes]]] = None
_LANG_SWITCH = re.compile(r"\([^)]*\)")  # espeak marks foreign words as (fr)...(en)
_CLAUSE_BREAKS = (",", ":", ";")
_PUNCTUATION = frozenset(".,:;!?¡¿—…\"'()-")


def _bind_text_to_phonemes(espeakbridge) -> Optional[Callable[..., Optional[bytes]]]:
    """espeak_TextToPhonemesWithTerminator of the espeak-ng that piper-tts's bridge links in (and
    exports), or None where it cannot be found. Opening the bridge's own .so again gives the copy the
    interpreter already loaded (the loader shares it by path), so the voice the bridge set applies."""
    try:
        func = ctypes.CDLL(espeakbridge.__file__).espeak_TextToPhonemesWithTerminator
    except (OSError, AttributeError, TypeError):
        return None
    func.restype = ctypes.c_char_p
    func.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    return func


def _espeak_phonemes(func: Callable[..., Optional[bytes]], text: str) -> list[tuple[str, str, bool]]:
    """What piper-tts's `espeakbridge.get_phonemes` returns, without its leak: the bridge appends each
    clause's tuple with PyList_Append(list, Py_BuildValue(...)) and never drops its own reference, so
    every clause of every call stays alive (a 3-tuple and its phoneme string, about 200 B a clause:
    +4 MB per 10k calls of a two-sentence text, the same text or not; `sys.getrefcount` of a clause
    tuple is one too many). This is the bridge's loop, in Python, with the same flags and mapping."""
    if "\x00" in text:
        raise ValueError("embedded null character")  # what the bridge's PyArg_ParseTuple("s") says
    buffer = ctypes.create_string_buffer(text.encode("utf-8"))
    cursor = ctypes.c_void_p(ctypes.addressof(buffer))  # espeak advances it; NULL once all is read
    terminator = ctypes.c_int()
    raw = []
    while cursor.value is not None:
        phonemes = func(ctypes.byref(cursor), _ESPEAK_CHARS_AUTO, _ESPEAK_PHONEMES_IPA, ctypes.byref(terminator))
        kind = terminator.value & 0x000FFFFF
        raw.append(((phonemes or b"").decode("utf-8"), _TERMINATORS.get(kind, ""),
                    kind & _CLAUSE_TYPE_SENTENCE == _CLAUSE_TYPE_SENTENCE))
    return raw


def espeak_clauses(voice: str, text: str) -> list[tuple[str, bool]]:
    """Text -> [(phoneme string of one clause, ends a sentence)]."""
    global _ESPEAK_READY, _ESPEAK_VOICE, _TEXT_TO_PHONEMES
    from piper import espeakbridge
    from piper.phonemize_espeak import ESPEAK_DATA_DIR

    with _ESPEAK_LOCK:
        if not _ESPEAK_READY:
            espeakbridge.initialize(str(ESPEAK_DATA_DIR))
            _TEXT_TO_PHONEMES = _bind_text_to_phonemes(espeakbridge)
            _ESPEAK_READY = True
        if voice != _ESPEAK_VOICE:
            espeakbridge.set_voice(voice)
            _ESPEAK_VOICE = voice
        if _TEXT_TO_PHONEMES is not None:
            raw = _espeak_phonemes(_TEXT_TO_PHONEMES, text)
        else:  # a piper-tts whose bridge does not export espeak-ng: its get_phonemes, leak and all
            raw = espeakbridge.get_phonemes(text)
    clauses = []
    for phonemes, terminator, end_of_sentence in raw:
        phonemes = _LANG_SWITCH.sub("", phonemes) + terminator
        if terminator in _CLAUSE_BREAKS:
            phonemes += " "
        clauses.append((phonemes, bool(end_of_sentence)))
    return clauses


def sounds(phonemes: str) -> int:
    """A clause's size for matching it to its text: its phoneme characters, without spaces and punctuation."""
    return sum(1 for ch in phonemes if not ch.isspace() and ch not in _PUNCTUATION)


def _merge_clusters(phonemes: list[str], clusters: frozenset) -> list[str]:
    if not clusters:
        return phonemes
    longest = max(len(c) for c in clusters)
    out, i = [], 0
    while i < len(phonemes):
        for n in range(min(longest, len(phonemes) - i), 1, -1):
            if tuple(phonemes[i : i + n]) in clusters:
                out.append("".join(phonemes[i : i + n]))
                i += n
                break
        else:
            out.append(phonemes[i])
            i += 1
    return out


def _split_words(phonemes: list[str], limit: int) -> list[list[str]]:
    """Split an over-long clause at spaces (word boundaries), or hard at `limit` if it has none."""
    chunks, current = [], []
    for p in phonemes:
        current.append(p)
        if len(current) >= limit:
            cut = max((i for i, q in enumerate(current) if q == " "), default=-1)
            if cut <= 0:
                cut = len(current) - 1
            chunks.append(current[: cut + 1])
            current = current[cut + 1 :]
    if current:
        chunks.append(current)
    return chunks


class Phonemizer:
    """A voice's text -> pieces of phonemes -> phoneme ids, with no model loaded. Thread-safe."""

    def __init__(self, config: VoiceConfig, max_piece_ids: int = MAX_PIECE_IDS) -> None:
        self.config = config
        self.max_piece_ids = max_piece_ids

    def phonemize(self, text: str) -> list[list[str]]:
        """Text -> pieces of phonemes: sentences, split further where one is over-long."""
        return [phonemes for phonemes, _ in self.pieces(text)[0]]

    def pieces(self, text: str) -> tuple[list[tuple[list[str], Optional[tuple[int, int]]]], list[int]]:
        """Text -> ([(phonemes of a piece, (first, last) clause it holds, or None when it holds part
        of a clause cut at words)], the size (`sounds`) of each of espeak's clauses). The clauses let
        `text.clause_spans` say which words of the text each piece speaks."""
        if self.config.phoneme_type == "text":
            phonemes = list(unicodedata.normalize("NFD", text))
            return [(phonemes, (0, 0))], [len(phonemes)]
        limit = max(8, (self.max_piece_ids - 3) // 2)  # ids: ^ _ (p _)* $ = 2 x phonemes + 3
        pieces: list = []
        sizes: list[int] = []
        current: list[str] = []
        span: Optional[list] = None  # [first, last] clause of `current`; None once it holds part of one
        for index, (phonemes, end_of_sentence) in enumerate(espeak_clauses(self.config.espeak_voice, text)):
            clause = _merge_clusters(list(unicodedata.normalize("NFD", phonemes)), self.config.vowel_clusters)
            sizes.append(sounds(phonemes))
            if current and len(current) + len(clause) > limit:
                pieces.append((current, span))
                current, span = [], []
            whole = True
            if len(clause) > limit:
                *full, clause = _split_words(clause, limit)
                if full:
                    if current:
                        pieces.append((current, span))
                    pieces.extend((chunk, None) for chunk in full)
                    current, span, whole = [], [], False
            if not current:
                span = [index, index] if whole else None
            elif span is not None:
                span = [*span[:1], index] if whole else None
            current.extend(clause)
            if end_of_sentence:
                pieces.append((current, span))
                current, span = [], []
        if current:
            pieces.append((current, span))
        return [(ph, tuple(sp) if sp else None) for ph, sp in pieces], sizes

    def sounds(self, text: str) -> int:
        """How many phonemes espeak-ng makes of `text` alone (`sounds`), to place clause cuts."""
        return sum(sounds(phonemes) for phonemes, _ in espeak_clauses(self.config.espeak_voice, text))

    def to_ids(self, phonemes: Sequence[str]) -> tuple[np.ndarray, int]:
        """Phonemes -> `^ _ p1 _ p2 _ ... $` ids, and how many phonemes the voice lacked."""
        id_map = self.config.phoneme_id_map
        pad = id_map["_"]
        ids = list(id_map["^"]) + list(pad)
        missing = 0
        for p in phonemes:
            mapped = id_map.get(p)
            if mapped is None:
                missing += 1
                continue
            ids.extend(mapped)
            ids.extend(pad)
        ids.extend(id_map["$"])
        return np.asarray(ids, dtype=np.int64), missing
