"""What a Piper voice speaks of a row's text: which letters its language reads (the others reject
the row), and the spoken forms of symbols, without emoji (docs/piper.md: "Text normalisation")."""

from __future__ import annotations

import bisect
import re
import unicodedata
from collections.abc import Callable, Sequence
from typing import Optional

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
# form are read: for English voices as the words below (docs/piper.md: "Text normalisation"); for other
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
# Which words each piece speaks
# --------------------------------------------------------------------------------------------
# Where a clause of the text ends: , : ; . ! ? (with closing quotes or brackets after them) before a
# space or the end, as espeak-ng cuts its clauses.
_CLAUSE_END = re.compile(r"[.,:;!?\u2026]+[\"'\u201d\u2019)\]]*(?=\s|$)")


def clause_spans(text: str, sizes: Sequence[int], measure: Callable[[str], int]) -> Optional[list[tuple[int, int]]]:
    """Where in `text` each of espeak-ng's clauses is, given their sizes (`measure` of each clause's
    phonemes): (start, end) character offsets, or None when the punctuation cannot tell. espeak-ng
    says no offsets, so the text is cut at its clause punctuation; where that gives more pieces than
    espeak made clauses (it read "St." or "e.g." inside one), neighbours are merged where the sizes
    before each cut (`measure` of each piece's text phonemised alone) best match the clauses'."""
    chunks, start = [], 0
    for match in _CLAUSE_END.finditer(text):
        chunks.append((start, match.end()))
        start = match.end()
    chunks.append((start, len(text)))
    chunks = [_strip(text, a, b) for a, b in chunks]
    chunks = [c for c in chunks if any(ch.isalnum() for ch in text[c[0]:c[1]])]
    k = len(sizes)
    if not chunks or len(chunks) < k or k == 0:
        return None
    if len(chunks) == k:
        return chunks
    have = _running([measure(text[a:b]) for a, b in chunks])  # after chunk j, j = 0 .. m-2
    want = _running(list(sizes))  # after clause i, i = 0 .. k-2
    cuts = _best_cuts(have, want)
    spans, first = [], 0
    for cut in [*cuts, len(chunks) - 1]:
        spans.append((chunks[first][0], chunks[cut][1]))
        first = cut + 1
    return spans


def _strip(text: str, a: int, b: int) -> tuple[int, int]:
    while a < b and text[a].isspace():
        a += 1
    while b > a and text[b - 1].isspace():
        b -= 1
    return a, b


def _running(counts: list[int]) -> list[int]:
    run, out = 0, []
    for n in counts[:-1]:
        run += n
        out.append(run)
    return out


def _best_cuts(have: list[int], want: list[int]) -> list[int]:
    """Indices into `have` (increasing), one per `want`, minimising the summed distance."""
    m, k = len(have), len(want)
    if not k:
        return []
    inf = float("inf")
    cost = [[inf] * m for _ in range(k)]
    back = [[-1] * m for _ in range(k)]
    for j in range(m):
        cost[0][j] = abs(have[j] - want[0])
    for i in range(1, k):
        best, arg = inf, -1
        for j in range(m):
            if j - 1 >= 0 and cost[i - 1][j - 1] < best:
                best, arg = cost[i - 1][j - 1], j - 1
            if best < inf:
                cost[i][j] = best + abs(have[j] - want[i])
                back[i][j] = arg
    j = min(range(m), key=lambda x: cost[k - 1][x])
    cuts = [j]
    for i in range(k - 1, 0, -1):
        j = back[i][j]
        cuts.append(j)
    return cuts[::-1]
