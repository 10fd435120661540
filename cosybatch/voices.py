"""Voice pools and language routing: which voice a row without its own is spoken in.

A pool is a list of entries, each a voice (whatever the engine takes as one: a Piper voice name or
.onnx path, a CosyVoice SFT speaker), a speaker of a multi-speaker voice (``VOICE#SPEAKER``), or a
zero-shot prompt (a .wav, with the .txt beside it as its transcript), with a weight. A folder names
every voice (NAME.onnx + NAME.onnx.json) or every prompt (NAME.wav, NAME.txt) in it, sorted.

    --voice-pool "a,b:2,#3,prompts/"        a; b twice as often; speaker 3 of --voice; a folder
    --voice-map "en=a|b,de=c"               rows of language en: pool a|b; de: c

A row gets an entry by a seeded hash of its id (``hash``: the same under resume, --shard and
ray-run), or (``balanced``) the entry whose predicted audio so far, over its weight, is least, in
the order rows are read (the engine's cost estimate of each row: Piper's phoneme ids, CosyVoice's
text tokens).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from .errors import UsageError

MODES = ("hash", "balanced")
# The most speakers one `VOICE#LOW-HIGH` range may name: checked before the range is expanded (the
# largest Piper voices have about 900 speakers). A voice's own speaker count is checked at preflight.
MAX_SPEAKER_RANGE = 10_000
_LANGUAGE = re.compile(r"^[A-Za-z]{2,3}([-_][A-Za-z0-9]{1,8})*$")


@dataclass(frozen=True)
class PoolEntry:
    """One voice of a pool."""

    voice: Optional[str] = None  # the engine's voice; None: the job's --voice
    speaker: Optional[str] = None  # a speaker of a multi-speaker voice (name or id)
    prompt_wav: Optional[str] = None  # zero-shot prompt audio (engines that clone voices)
    prompt_text: Optional[str] = None  # what it says
    weight: float = 1.0

    def describe(self) -> dict:
        """For the job fingerprint: what is set, a prompt by its bytes' hash as well as its path."""
        out: dict[str, Any] = {k: v for k, v in (("voice", self.voice), ("speaker", self.speaker),
                                                 ("prompt_wav", self.prompt_wav), ("prompt_text", self.prompt_text))
                               if v is not None}
        if self.prompt_wav is not None:
            from .cache import file_sha256

            out["prompt_sha256"] = file_sha256(Path(self.prompt_wav))["sha256"]
        if self.weight != 1.0:
            out["weight"] = self.weight
        return out


def language_family(code: str) -> str:
    """"en" for en_US, en-GB or EN."""
    return code.replace("_", "-").split("-")[0].lower()


def check_language(value: str) -> Optional[str]:
    """Why `value` is not a language code (None: it is one: en, de, en-US, zh_CN, yue)."""
    if not _LANGUAGE.match(value):
        return f"language {value!r} is not a language code (en, de, en-US)"
    return None


# -- parsing ----------------------------------------------------------------------------------
def parse_pool(value: Any, flag: str = "--voice-pool") -> tuple[PoolEntry, ...]:
    """A pool from the command line ("a,b:2") or a job spec (a list of strings and tables
    {voice, speaker, prompt_wav, prompt_text, weight}, or a table ENTRY = WEIGHT); folders are
    expanded here."""
    if value is None or value == "" or value == () or value == {}:
        return ()
    if isinstance(value, Mapping):  # [voice_pool] a = 2: each key an entry string, its weight
        items = []
        for key, weight in value.items():
            scale = _weight(weight, flag, {key: weight})
            items += [replace(e, weight=e.weight * scale) for e in _entries(str(key), flag)]
    elif isinstance(value, str):
        items: Sequence = [part for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        raise UsageError(f"{flag}: give a comma-separated list of voices or a list (got {type(value).__name__})")
    entries: list[PoolEntry] = []
    for item in items:
        entries += _entries(item, flag)
    if not entries:
        raise UsageError(f"{flag}: the pool has no voices")
    return tuple(entries)


def _entries(item: Any, flag: str) -> list[PoolEntry]:
    if isinstance(item, PoolEntry):
        return [item]
    if isinstance(item, Mapping):
        unknown = set(item) - {"voice", "speaker", "prompt_wav", "prompt_text", "weight"}
        if unknown:
            raise UsageError(f"{flag}: unknown key(s) {sorted(unknown)} in {dict(item)!r}; an entry has voice, "
                             "speaker, prompt_wav, prompt_text and weight")
        weight = _weight(item.get("weight", 1.0), flag, item)
        text = {k: None if item.get(k) is None else str(item[k]) for k in ("voice", "speaker", "prompt_wav",
                                                                          "prompt_text")}
        if text["prompt_wav"] is not None and not Path(text["prompt_wav"]).is_file():
            raise UsageError(f"{flag}: prompt_wav {text['prompt_wav']!r} is not a file")
        if not any(text.values()):
            raise UsageError(f"{flag}: the entry {dict(item)!r} names no voice, speaker or prompt")
        return [PoolEntry(**text, weight=weight)]
    if not isinstance(item, str):
        raise UsageError(f"{flag}: an entry is a string or a table, not {item!r}")
    spec = item.strip()
    weight = 1.0
    head, sep, tail = spec.rpartition(":")
    if sep and re.fullmatch(r"[0-9.eE+-]+", tail):
        spec, weight = head, _weight(tail, flag, item)
    voice, sep, speaker = spec.partition("#")
    voice = voice.strip() or None
    if sep:
        speakers = _speakers(speaker.strip(), flag, item)
        return [PoolEntry(voice, s, weight=weight) for s in speakers]
    if voice is None:
        raise UsageError(f"{flag}: empty entry in {item!r}")
    path = Path(voice)
    if path.is_dir():
        return _folder(path, weight, flag)
    if voice.lower().endswith(".wav"):
        if not path.is_file():
            raise UsageError(f"{flag}: prompt {voice!r} is not a file")
        return [_prompt(path, weight)]
    return [PoolEntry(voice, weight=weight)]


def _weight(value: Any, flag: str, item: Any) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        weight = -1.0
    if not 0 < weight < float("inf") or isinstance(value, bool):
        raise UsageError(f"{flag}: the weight in {item!r} must be a number > 0")
    return weight


def _speakers(text: str, flag: str, item: str) -> list[str]:
    """"3" -> ["3"]; "0-3" -> ["0", "1", "2", "3"]; a name stays a name."""
    if not text:
        raise UsageError(f"{flag}: {item!r} names no speaker after '#'")
    low, dash, high = text.partition("-")
    if dash and low.isdigit() and high.isdigit():
        if len(low) > 9 or len(high) > 9:  # no int() of a huge digit string either
            raise UsageError(f"{flag}: speaker range {text!r} in {item!r} names ids past any voice's speakers")
        if int(high) < int(low):
            raise UsageError(f"{flag}: speaker range {text!r} runs backwards")
        count = int(high) - int(low) + 1
        if count > MAX_SPEAKER_RANGE:
            raise UsageError(f"{flag}: speaker range {text!r} in {item!r} names {count:,} speakers, over the "
                             f"limit of {MAX_SPEAKER_RANGE:,} for one range; name the voice's own speakers")
        return [str(i) for i in range(int(low), int(high) + 1)]
    return [text]


def _prompt(wav: Path, weight: float) -> PoolEntry:
    txt = wav.with_suffix(".txt")
    text = " ".join(txt.read_text(encoding="utf-8").split()) if txt.is_file() else None
    return PoolEntry(prompt_wav=str(wav), prompt_text=text or None, weight=weight)


def _folder(path: Path, weight: float, flag: str) -> list[PoolEntry]:
    """Every Piper voice (NAME.onnx with NAME.onnx.json) or, failing that, every prompt (NAME.wav)."""
    voices = sorted(p for p in path.glob("*.onnx") if p.with_name(p.name + ".json").is_file())
    if voices:
        return [PoolEntry(str(p), weight=weight) for p in voices]
    prompts = sorted(path.glob("*.wav"))
    if prompts:
        return [_prompt(p, weight) for p in prompts]
    raise UsageError(f"{flag}: folder {str(path)!r} holds no voices (NAME.onnx + NAME.onnx.json) and no prompts "
                     "(NAME.wav + NAME.txt)")


def parse_voice_map(value: Any, flag: str = "--voice-map") -> dict[str, tuple[PoolEntry, ...]]:
    """{language: pool} from "en=a|b,de=c" or a job spec's table {en = "a", de = ["b", "c"]}."""
    if value is None or value == "" or value == {}:
        return {}
    if isinstance(value, str):
        pairs = []
        for part in value.split(","):
            if not part.strip():
                continue
            language, sep, voices = part.partition("=")
            if not sep or not language.strip() or not voices.strip():
                raise UsageError(f"{flag}: {part!r} should be LANGUAGE=VOICE (en=VOICE, en=VOICE|VOICE)")
            pairs.append((language.strip(), voices.split("|")))
    elif isinstance(value, Mapping):
        pairs = [(str(k), v) for k, v in value.items()]
    else:
        raise UsageError(f"{flag}: give LANGUAGE=VOICE,... or a table (got {type(value).__name__})")
    found: dict[str, tuple[PoolEntry, ...]] = {}
    for language, voices in pairs:
        reason = check_language(language)
        if reason:
            raise UsageError(f"{flag}: {reason}")
        if language.lower() in found:
            raise UsageError(f"{flag}: language {language!r} is given twice")
        found[language.lower()] = parse_pool(voices, f"{flag} {language}")
    return found


# -- assignment -------------------------------------------------------------------------------
@dataclass
class Pool:
    """One pool's entries and, in balanced mode, the predicted audio given to each so far."""

    entries: tuple[PoolEntry, ...]
    totals: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.totals = [0.0] * len(self.entries)
        weights = [e.weight for e in self.entries]
        total = sum(weights)
        self._cumulative = [sum(weights[: i + 1]) / total for i in range(len(weights))]

    def hashed(self, seed: int, item_id: str) -> int:
        """The entry of `item_id`, by a seeded hash (weighted)."""
        if len(self.entries) == 1:
            return 0
        digest = hashlib.blake2b(f"{seed}\x00{item_id}\x00voice-pool".encode(), digest_size=8).digest()
        u = int.from_bytes(digest, "little") / 2.0**64
        return next((i for i, edge in enumerate(self._cumulative) if u < edge), len(self.entries) - 1)

    def least(self) -> int:
        """The entry with the least predicted audio so far per unit of weight (the first on ties)."""
        return min(range(len(self.entries)), key=lambda i: (self.totals[i] / self.entries[i].weight, i))

    def add(self, index: int, cost: float) -> None:
        self.totals[index] += cost


class VoiceRouter:
    """A job's pools: which entry a row is spoken with (thread-safe callers: the producer thread
    assigns; the quality gate's retakes reuse the assignment they are given)."""

    def __init__(self, pool: Sequence[PoolEntry], voice_map: Mapping[str, Sequence[PoolEntry]], mode: str,
                 seed: int):
        self.mode = mode
        self.seed = seed
        self.pool = Pool(tuple(pool)) if pool else None
        self.by_language = {k: Pool(tuple(v)) for k, v in voice_map.items()}

    @property
    def active(self) -> bool:
        return self.pool is not None or bool(self.by_language)

    def pool_for(self, language: Optional[str]) -> tuple[Optional[Pool], bool]:
        """(the pool a row of `language` draws from, whether it was chosen by language). None: the
        job's --voice. Raises LookupError naming the fix for a language the map has no voice for."""
        if language is not None and self.by_language:
            lang = language.lower()
            found = self.by_language.get(lang) or self.by_language.get(language_family(lang))
            if found is None:
                found = next((p for k, p in self.by_language.items() if language_family(k) == language_family(lang)),
                             None)
            if found is None:
                raise LookupError(f"language {language!r} has no voice: --voice-map names "
                                  f"{', '.join(sorted(self.by_language))}; add {language}=VOICE to --voice-map "
                                  "(or give the row a voice)")
            return found, True
        return self.pool, False

    def pick(self, pool: Pool, item_id: str) -> int:
        return pool.hashed(self.seed, item_id) if self.mode == "hash" else pool.least()

    def describe(self) -> dict:
        """For the job fingerprint (empty without pools, so earlier fingerprints stay as they were)."""
        if not self.active:
            return {}
        out: dict[str, Any] = {"mode": self.mode}
        if self.pool is not None:
            out["pool"] = [e.describe() for e in self.pool.entries]
        if self.by_language:
            out["map"] = {k: [e.describe() for e in p.entries] for k, p in sorted(self.by_language.items())}
        return out
