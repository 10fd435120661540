"""CosyVoice2 text frontend: Qwen2 tokenizer, text normalisation and segmenting.

Behaves like upstream CosyVoice's non-ttsfrd frontend (``CosyVoiceFrontEnd.text_normalize`` and
``split_paragraph``), with these differences on purpose:

* the tokenizer is built with Hugging Face ``tokenizers`` alone (no ``transformers`` at run time) and
  gives the same ids as upstream's ``QwenTokenizer``;
* wetext's FST normaliser is wrapped so that its failures (it raises on runs of spaces and on
  symbols such as ``#1`` or ``[1]``) fall back to normalising smaller pieces, its escaped output
  (``\\"``) is unescaped, and its ``1,000 -> "thousand"`` slip is repaired;
* the splitter never loses text (upstream drops a stop that follows another one, as in ``"?!"``)
  and never returns a segment longer than ``hard_max_tokens``: an over-long sentence is cut at a
  comma-like mark, else at a space, else between characters.
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "UPSTREAM_EXTRA_SPECIALS",
    "QwenTextTokenizer",
    "contains_chinese",
    "frontend",
    "frontend_segments",
    "is_speakable",
    "normalize",
    "spell_out_numbers",
    "split_segments",
]

# Added by upstream's QwenTokenizer on top of the folder's own added tokens, in this order.
UPSTREAM_EXTRA_SPECIALS: tuple[str, ...] = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endofprompt|>",
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)

# What upstream's CosyVoice3Tokenizer adds to BlankEN's tokenizer at load time, in its order
# (cosyvoice/tokenizer/tokenizer.py at ace7c47). The first three exist already, so <|endofprompt|>
# gets 151646. Tokens for instructions, non-verbal sounds, then ARPAbet and pinyin phones.
_ARPABET = (
    "AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 B CH D DH "
    "EH EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 JH K L M N NG "
    "OW OW0 OW1 OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 V W Y Z ZH"
)
_PINYIN = (
    "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié "
    "iòng ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s "
    "sh t u uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī "
    "uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng "
    "ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn "
    "īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ"
)
V3_SPECIALS: tuple[str, ...] = (
    *UPSTREAM_EXTRA_SPECIALS,
    "<|endofsystem|>",
    *(f"[{p}]" for p in _ARPABET.split()),
    *(f"[{p}]" for p in _PINYIN.split()),
)

# Qwen2's pre-tokenizer pattern (as in transformers' Qwen2Converter).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ---------------------------------------------------------------------------------------------- tokenizer


class TextEncoder(Protocol):
    """Anything with ``encode(text) -> list[int]``."""

    def encode(self, text: str) -> list[int]: ...


class QwenTextTokenizer:
    """The Qwen2 byte-level BPE tokenizer of a ``CosyVoice-BlankEN`` folder, as upstream's ``QwenTokenizer``.

    Reads ``tokenizer.json`` when the folder has one, else builds the tokenizer from ``vocab.json``,
    ``merges.txt`` and the ``added_tokens_decoder`` of ``tokenizer_config.json``; then adds
    :data:`UPSTREAM_EXTRA_SPECIALS` (tokens already present keep their ids).
    """

    def __init__(self, folder: str | Path, specials: Sequence[str] = UPSTREAM_EXTRA_SPECIALS) -> None:
        """``specials``: what upstream's tokenizer class adds (CosyVoice3's: :data:`V3_SPECIALS`)."""
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        config_path = self.folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text(encoding="utf-8"))
        if (self.folder / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        elif (self.folder / "vocab.json").is_file() and (self.folder / "merges.txt").is_file():
            tokenizer = _build_qwen2(self.folder, bool(config.get("add_prefix_space", False)))
        else:
            raise FileNotFoundError(f"{self.folder}: no tokenizer.json, nor vocab.json + merges.txt")
        _add_declared_tokens(tokenizer, config.get("added_tokens_decoder") or {}, self.folder)
        tokenizer.add_special_tokens([_added_token(token, special=True) for token in specials])
        self._tokenizer = tokenizer
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token (added tokens included), or None."""
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``[breath]``) become their ids."""
        return self._tokenizer.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for many texts at once (parallel in Rust)."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped (as upstream decodes)."""
        text = self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return _clean_up_tokenization(text) if self.clean_up_spaces else text

    def __len__(self) -> int:
        return self.vocab_size


def _added_token(content: str, special: bool, **flags: Any):
    from tokenizers import AddedToken

    return AddedToken(content, special=special, normalized=flags.pop("normalized", not special), **flags)


def _build_qwen2(folder: Path, add_prefix_space: bool):
    """Qwen2's fast tokenizer from vocab.json + merges.txt (what transformers' Qwen2Converter builds)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab, merges = models.BPE.read_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _add_declared_tokens(tokenizer, declared: dict[str, dict[str, Any]], folder: Path) -> None:
    """Add tokenizer_config.json's ``added_tokens_decoder`` in id order and check each lands on its id."""
    present = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    entries = sorted(((int(i), spec) for i, spec in declared.items()), key=lambda item: item[0])
    for token_id, spec in entries:
        content = spec["content"]
        if present.get(token_id) == content:  # already there (a tokenizer.json folder)
            continue
        flags = {k: bool(spec[k]) for k in ("lstrip", "rstrip", "single_word", "normalized") if k in spec}
        token = _added_token(content, special=bool(spec.get("special", False)), **flags)
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        got = tokenizer.token_to_id(content)
        if got != token_id:
            raise ValueError(f"{folder}: added token {content!r} is declared as id {token_id} but lands on {got}")


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (used when the config asks for it)."""
    for before, after in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
        (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(before, after)
    return text


# ---------------------------------------------------------------------------------------------- normalising

_CHINESE = re.compile(r"[\u4e00-\u9fff]+")
_WHITESPACE = re.compile(r"\s+")
_DIGITS = re.compile(r"[0-9]+")
# Sentence ends where long texts are cut before wetext (an ASCII stop only when a space follows).
_CHUNK_END = re.compile(r"[.!?;]+[\"”’')]*\s+|[。！？；]+[\"”’')）」』]*\s*")
_WETEXT_ESCAPE = re.compile(r'\\(["\\])')
# wetext's English grammar reads "1,000" as "thousand" and "1,500" as "thousand five hundred".
_ONE_THOUSAND_IN = re.compile(r"(?<![\d,.])1,\d{3}(?![\d]|,\d)")
_BARE_THOUSAND_OUT = re.compile(r"(?:^|(?<=\s))thousand\b")
_NUMBER_WORDS = frozenset(
    {"a", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"}
    | {"thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty", "thirty"}
    | {"forty", "fifty", "sixty", "seventy", "eighty", "ninety", "hundred"}
)

# wetext options equal to upstream's zh normaliser (WeTextProcessing defaults + upstream's two overrides).
ZH_TN_OPTIONS: dict[str, bool] = {
    "remove_erhua": False,
    "full_to_half": False,
    "traditional_to_simple": True,
    "remove_interjections": True,
}

_lock = threading.Lock()
_normalisers: dict[str, Any] = {}
_inflect_lock = threading.Lock()


def contains_chinese(text: str) -> bool:
    """Whether ``text`` holds a CJK unified ideograph (upstream's language switch)."""
    return bool(_CHINESE.search(text))


def _normaliser(lang: str):
    """wetext's TN normaliser for ``en`` or ``zh``, built once (wetext reads all its FSTs on import)."""
    found = _normalisers.get(lang)
    if found is not None:
        return found
    with _lock:
        if lang not in _normalisers:
            from wetext import Normalizer

            if lang == "zh":
                # upstream: WeTextProcessing's ZhNormalizer(remove_erhua=False, full_to_half=False), whose
                # other defaults convert traditional characters and drop interjections such as 啊 and 呃
                found = Normalizer(lang="zh", operator="tn", **ZH_TN_OPTIONS)
            else:
                found = Normalizer(lang="en", operator="tn")
            _normalisers[lang] = found
        return _normalisers[lang]


def _inflect():
    found = _normalisers.get("inflect")
    if found is None:
        with _lock:
            if "inflect" not in _normalisers:
                import inflect

                _normalisers["inflect"] = inflect.engine()
            found = _normalisers["inflect"]
    return found


def _tn(lang: str, text: str) -> str:
    """wetext TN of ``text``; where wetext fails, normalise halves (split at spaces), else keep it raw."""
    try:
        out = _normaliser(lang).normalize(text)
    except Exception:  # wetext asserts on inputs its tagger cannot cover
        words = text.split(" ")
        if len(words) < 2:
            return text
        half = len(words) // 2
        return " ".join(p for p in (_tn(lang, " ".join(words[:half])), _tn(lang, " ".join(words[half:]))) if p)
    # wetext's verbalizer escapes '"' and '\' whenever it ran (zh TN only runs when there are digits).
    if lang == "en" or re.search(r"\d", text):
        out = _WETEXT_ESCAPE.sub(r"\1", out)
    return out


def _tn_chunked(lang: str, text: str, size: int = 400) -> str:
    """:func:`_tn` over sentence-aligned chunks of about ``size`` characters.

    wetext's cost grows faster than linearly with the input and one unparsable symbol makes a
    whole call fail, so long texts go through it a few sentences at a time.
    """
    if len(text) <= size:
        return _tn(lang, text)
    parts: list[str] = []
    start = 0
    for match in _CHUNK_END.finditer(text):
        if match.end() - start >= size:
            parts.append(text[start : match.end()])
            start = match.end()
    parts.append(text[start:])
    out = ""
    for part in parts:
        done = _tn(lang, part.strip())
        if done:
            out += done + (" " if part[-1:].isspace() else "")
    return out.strip()


def _fix_bare_thousand(source: str, out: str) -> str:
    """Put back the "one" wetext drops from "1,000".."1,999" (at most once per such number in ``source``)."""
    budget = len(_ONE_THOUSAND_IN.findall(source))
    if not budget:
        return out
    pieces: list[str] = []
    last = 0
    for match in _BARE_THOUSAND_OUT.finditer(out):
        before = out[max(0, match.start() - 40) : match.start()].split()
        if budget and (not before or before[-1].lower() not in _NUMBER_WORDS):
            pieces.append(out[last : match.start()] + "one ")
            last = match.start()
            budget -= 1
    return "".join(pieces) + out[last:]


def spell_out_numbers(text: str) -> str:
    """Replace each run of ASCII digits by its English words (upstream's ``spell_out_number``)."""
    if not _DIGITS.search(text):
        return text
    engine = _inflect()  # importing inflect takes ~2 s, so only when digits survive wetext

    def words(match: re.Match[str]) -> str:
        with _inflect_lock:  # inflect keeps per-call state on the engine
            try:
                return engine.number_to_words(match.group())
            except Exception:  # too large for inflect: digit by digit
                return engine.number_to_words(match.group(), group=1)

    return _DIGITS.sub(words, text)


def _replace_blank(text: str) -> str:
    """Drop spaces except between two non-space ASCII characters (upstream's ``replace_blank``)."""
    out = []
    for i, c in enumerate(text):
        if c == " ":
            prev, nxt = text[i - 1 : i], text[i + 1 : i + 2]
            if not (prev.isascii() and prev not in " " and nxt.isascii() and nxt not in " "):
                continue
        out.append(c)
    return "".join(out)


def normalize(text: str) -> str:
    """Upstream's non-ttsfrd text normalisation: wetext zh TN (+ zh clean-up) or en TN + spelt-out digits.

    Whitespace runs (newlines included) become one space first: wetext's English grammar fails on
    them, and upstream drops newlines in Chinese text anyway.
    """
    text = _WHITESPACE.sub(" ", text).strip()
    if not text:
        return ""
    if contains_chinese(text):
        text = _tn_chunked("zh", text)
        text = text.replace("\n", "")
        text = _replace_blank(text)
        text = text.replace("²", "平方").replace("³", "立方")
        text = text.replace(".", "。").replace(" - ", "，")
        for mark in ("（", "）", "【", "】", "`"):
            text = text.replace(mark, "")
        text = text.replace("——", " ")
        return re.sub(r"[，,、]+$", "。", text)
    out = _fix_bare_thousand(text, _tn_chunked("en", text))
    return spell_out_numbers(out)


# ---------------------------------------------------------------------------------------------- splitting

_STOPS = {
    "en": frozenset(".?!;:"),
    "zh": frozenset("。？！；：、.?!;"),
}
_FINAL_STOP = {"en": ".", "zh": "。"}
# Kept with the sentence they close (upstream keeps one '"' or '”').
_CLOSERS = frozenset("\"”’')）]】」』》")
# Where an over-long sentence may be cut (after the mark).
_SOFT_BREAKS = frozenset(",，、;；:：—–")


def is_speakable(text: str) -> bool:
    """Whether ``text`` holds a letter or a digit (else it is only punctuation, symbols, emoji, space)."""
    return any(unicodedata.category(c)[0] in "LN" for c in text)


def _sentences(text: str, stops: frozenset[str]) -> list[str]:
    """Cut after each stop (and the closing quotes right after it); nothing is dropped."""
    out: list[str] = []
    start = i = 0
    n = len(text)
    while i < n:
        if text[i] in stops:
            end = i + 1
            while end < n and text[end] in _CLOSERS:
                end += 1
            piece = text[start:end]
            if start == i and out:  # a stop right after a stop ("?!", "..."): same sentence
                out[-1] += piece
            else:
                out.append(piece)
            start = i = end
        else:
            i += 1
    if start < n:
        out.append(text[start:])
    return out


def _fitting_prefix(text: str, count: Callable[[str], int], limit: int) -> int:
    """Length of the longest prefix of ``text`` (at least 1 character) with at most ``limit`` tokens."""
    lo = 1  # a prefix known to fit, or 1 when not even one character does
    hi = min(len(text), max(8 * limit, 16))
    while count(text[:hi]) <= limit:  # grow until the prefix no longer fits
        if hi == len(text):
            return hi
        lo, hi = hi, min(len(text), hi * 2)
    while hi - lo > 1:  # prefix lo fits (or is 1), prefix hi does not
        mid = (lo + hi) // 2
        if count(text[:mid]) <= limit:
            lo = mid
        else:
            hi = mid
    return lo


def _cut_point(prefix: str) -> int:
    """Where to cut a prefix that fits: late comma-like mark, else late space, else any such, else its end."""
    half = len(prefix) // 2
    soft = max((i + 1 for i, c in enumerate(prefix) if c in _SOFT_BREAKS), default=0)
    space = max((i for i, c in enumerate(prefix) if c.isspace() and i > 0), default=0)
    for cut in (soft if soft >= half else 0, space if space >= half else 0, soft, space):
        if 0 < cut <= len(prefix):
            return cut
    return len(prefix)


def _cut_long(sentence: str, count: Callable[[str], int], limit: int) -> list[str]:
    """``sentence`` as consecutive pieces of at most ``limit`` tokens, about equal in length."""
    left = count(sentence)  # tokens still to place (an estimate once pieces are cut off)
    if left <= limit:
        return [sentence]
    pieces: list[str] = []
    rest = sentence
    while rest:
        needed = -(-left // limit)
        target = limit if needed <= 1 else -(-left // needed)
        end = _fitting_prefix(rest, count, target)
        if end == len(rest):
            pieces.append(rest)
            break
        cut = _cut_point(rest[:end])
        used = count(rest[:cut])
        if used > target:  # BPE counts are not monotone in the prefix; the fitting prefix is safe
            cut, used = end, count(rest[:end])
        pieces.append(rest[:cut])
        rest = rest[cut:]
        left = max(left - used, 1)
    return pieces


def split_segments(
    text: str,
    encode: Callable[[str], Sequence[int]],
    lang: str,
    max_tokens: int = 80,
    min_tokens: int = 60,
    merge_tokens: int = 20,
    hard_max_tokens: int | None = None,
    drop_unspeakable: bool = True,
) -> list[str]:
    """Split normalised text into segments for synthesis, as upstream's ``split_paragraph``.

    Sentences end after ``. ? ! ; :`` (``lang="en"``) or ``。？！；：、.?!;`` (``"zh"``) plus any closing
    quotes. They are packed greedily while the pack stays within ``max_tokens`` or is still no longer
    than ``min_tokens``; a last pack shorter than ``merge_tokens`` joins the previous one. For ``zh``
    those three lengths count characters, as upstream does; ``hard_max_tokens`` (default
    ``2 * max_tokens``) always counts tokens and no segment exceeds it (a single character that alone
    encodes to more tokens is the only exception); a longer sentence is cut into about equal pieces,
    each at its last comma-like mark or space (in its second half), else between characters. A final
    stop is added when the text lacks one. The segments joined give back the stripped text plus that
    stop; segments with nothing speakable (no letter or digit) are then dropped unless
    ``drop_unspeakable`` is false.
    """
    if lang not in _STOPS:
        raise ValueError(f"lang must be 'en' or 'zh', not {lang!r}")
    hard = 2 * max_tokens if hard_max_tokens is None else hard_max_tokens
    if hard < 1:
        raise ValueError(f"hard_max_tokens must be positive, not {hard}")
    text = text.strip()
    if not text:
        return []
    stops = _STOPS[lang]
    if text.rstrip("".join(_CLOSERS))[-1:] not in stops:
        text += _FINAL_STOP[lang]

    def tokens(s: str) -> int:
        return len(encode(s))

    length = len if lang == "zh" else tokens  # upstream's measure for packing

    pieces: list[str] = []
    for sentence in _sentences(text, stops):
        pieces.extend(_cut_long(sentence, tokens, hard))

    segments: list[str] = []
    current = ""
    for piece in pieces:
        if current:
            joined = current + piece
            n_joined = length(joined)
            over_max = n_joined > max_tokens and length(current) > min_tokens
            over_hard = (n_joined if lang == "en" else tokens(joined)) > hard
            if over_max or over_hard:
                segments.append(current)
                current = ""
        current += piece
    if current:
        if segments and length(current) < merge_tokens and tokens(segments[-1] + current) <= hard:
            segments[-1] += current
        else:
            segments.append(current)
    return [s for s in segments if is_speakable(s)] if drop_unspeakable else segments


# ---------------------------------------------------------------------------------------------- frontend


def frontend_segments(
    text: str,
    tokenizer: TextEncoder,
    max_tokens: int = 80,
    min_tokens: int = 60,
    merge_tokens: int = 20,
    hard_max_tokens: int | None = None,
) -> list[tuple[str, list[int]]]:
    """Normalise, split and encode ``text``: ``(segment text, token ids)`` per segment, in order.

    Raises ValueError when nothing speakable remains (empty text, only punctuation or emoji).
    """
    lang = "zh" if contains_chinese(text) else "en"
    normalised = normalize(text)
    segments = split_segments(normalised, tokenizer.encode, lang, max_tokens, min_tokens, merge_tokens, hard_max_tokens)
    if not segments:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise ValueError(f"nothing speakable in {shown!r}: no letters or digits remain after normalisation")
    return [(segment, list(tokenizer.encode(segment))) for segment in segments]


def frontend(
    text: str,
    tokenizer: TextEncoder,
    max_tokens: int = 80,
    min_tokens: int = 60,
    merge_tokens: int = 20,
    hard_max_tokens: int | None = None,
) -> list[list[int]]:
    """Normalise, split and encode ``text``: the token ids of each segment, in order.

    Raises ValueError when nothing speakable remains (empty text, only punctuation or emoji).
    """
    segments = frontend_segments(text, tokenizer, max_tokens, min_tokens, merge_tokens, hard_max_tokens)
    return [ids for _, ids in segments]
