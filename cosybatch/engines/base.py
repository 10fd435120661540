"""The engine contract: the `Engine` base class and the values that cross it.

For implementers: subclass `Engine`, supply the four abstract methods (``__init__``, ``describe``,
``prepare``, ``synthesize``), set ``name`` (and ``Options`` if the engine has settings), and
register the class under the ``cosybatch.engines`` entry-point group (docs/writing-an-engine.md).
The job calls, in order: ``check`` (also for ``run --check``; no weights loaded), ``__init__``,
``describe`` (through ``fingerprint``) and ``memory_plan`` once, then ``prepare`` for every row and
``synthesize`` for every batch, from several threads at once (``workers``).

This module imports no engine and nothing heavy: an engine module must not import onnxruntime or
torch at its top either, so that the CLI can read its class attributes (aliases, options) quickly.
"""

from __future__ import annotations

import abc
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import numpy as np

from ..errors import CosybatchError, EngineError
from ..plan import Unit

# No setting (an option, a voice's own defaults, a drawn range) can make one piece's audio longer
# than this: engines check a piece's predicted or produced length against it before allocating its
# audio and fail the row with PieceTooLong (docs/writing-an-engine.md). A piece of Piper's longest
# (600 phoneme ids) at the slowest length scale (4) is about 60 s; CosyVoice's longest segment at
# speed 1 about 45 s.
MAX_PIECE_SECONDS = 120.0


class RowRejected(Exception):
    """Raised by `Engine.prepare` for a row the engine cannot synthesise; the message is the reason."""


@dataclass(frozen=True)
class Piece:
    """One piece of a row (a sentence, or part of one): what the planner batches by."""

    cost: int  # estimated work, in the engine's own unit (Piper: phoneme ids; CosyVoice: text tokens)
    payload: object  # the engine's own input for this piece, handed back in `Unit.payload`
    # What this piece says, for the row's segment times (KEY.json "segments", Lhotse supervisions
    # per segment). None: the engine cannot tell; a row none of whose pieces says records no segments.
    text: Optional[str] = None


@dataclass(frozen=True)
class Prepared:
    """A row cut into pieces, in the order their audio is joined."""

    pieces: tuple[Piece, ...]  # at least one
    text: str  # the text actually spoken, after the engine's own normalisation
    voice: Optional[str] = None  # the row's voice for the manifest, when it is not the engine's voice_name
    instruct: Optional[str] = None  # the instruction the row is spoken with (the row's or the job's default)
    meta: Optional[dict] = None  # per-row values the engine drew (a scale drawn from a range), for KEY.json


@dataclass(frozen=True)
class Synthesised:
    """Audio for each unit of a batch, plus the frame counts used for padding statistics."""

    audio: list[np.ndarray]  # float32 mono at `Engine.sample_rate`, one per unit, trimmed to its exact length
    # For padding statistics, in the engine's own unit of work (Piper: decoder output frames;
    # CosyVoice: LM decode slot-steps): what the units needed, and what the batch computed.
    real_frames: int
    padded_frames: int
    # Optional, per unit: what an LM-based engine knows of how each piece ended, for the quality
    # signals: {"stop": "eos" | "length_cap" | "nonfinite", "tokens": n, "token_run": longest run of
    # one token, "repeat_4gram": share of repeated 4-grams}. None: the engine has no such signals.
    lm: Optional[list] = None


@dataclass(frozen=True)
class VoiceRequest:
    """The voice a row asks for, for engines that take any voice per row (``multi_voice``)."""

    name: Optional[str] = None  # voice / speaker name
    prompt_wav: Optional[str] = None  # zero-shot prompt audio
    prompt_text: Optional[str] = None
    from_row: bool = False  # named by the corpus (paths then resolve against the corpus folder)
    instruct: Optional[str] = None  # the row's instruction (engines with ``instruct``)
    speaker: Optional[str] = None  # a speaker of a multi-speaker voice (a voice pool's ``VOICE#SPEAKER``)
    pooled: bool = False  # chosen by the job from its voice pool (trusted like the command line, not a row)


@dataclass(frozen=True)
class NoOptions:
    """The options of an engine that has none of its own."""


@dataclass(frozen=True)
class EngineOptions:
    """What the job hands every engine; the engine's own settings are in `engine`."""

    device: str = "auto"  # auto | cpu | cuda
    threads: int = 1  # intra-op threads per session (CPU)
    seed: int = 0  # the job seed: derive each item's randomness from item_seed(seed, id, part)
    memory_fraction: float = 0.9  # GPU: the share of the device this process may use
    corpus_dir: Path = Path(".")  # where relative paths in corpus rows resolve
    allow_paths: bool = True  # False when the voice was named by a corpus row (untrusted)
    engine: Any = None  # an instance of the engine's `Options` dataclass (None: its defaults)


@dataclass(frozen=True)
class MemoryPlan:
    """What an engine set up on the GPU before the first batch."""

    probed_budget: Optional[int] = None  # padded cost per batch that fits its pre-allocated pool
    pool: Optional[dict] = None  # the pool, for stats.json


@dataclass(frozen=True)
class Alias:
    """A `cosybatch run` flag that sets one engine option: ``--FLAG VALUE`` is ``--engine-opt
    OPTION=VALUE`` (applied after --engine-opt, so it wins). Engines declare theirs in
    `Engine.aliases`; several engines may declare the same flag for an option of the same name."""

    option: str  # the engine option; the flag is --OPTION with '-' for '_'
    kind: type  # str, int, float or Path: how the command line parses the value
    help: str


class Engine(abc.ABC):
    """The contract between the job and a model. Subclass it, register the class under the
    ``cosybatch.engines`` entry-point group, and `cosybatch run --engine NAME` runs it.

    Class attributes say what the engine is; an instance is one loaded model (one per voice unless
    `multi_voice`)."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    """A frozen dataclass of the engine's settings (`--engine-opt KEY=VALUE`, `[engine_options]`).
    Each field's type (str, int, float, bool, Path, optionally Optional) converts the value; a
    docstring under each field documents it; `__post_init__` may raise UsageError."""
    aliases: ClassVar[tuple[Alias, ...]] = ()
    """Flags of `cosybatch run` that set one of `Options` (see `Alias`)."""
    multi_voice: ClassVar[bool] = False
    """True: one instance serves every voice, and `prepare` gets each row's VoiceRequest (rows of
    different voices share batches). False: the job opens one instance per voice name."""
    zero_shot: ClassVar[bool] = False
    """True: rows may carry prompt_wav / prompt_text (voice cloning)."""
    takes_instruct: ClassVar[bool] = False
    """True: rows may carry an ``instruct`` text (a natural-language instruction); the engine's
    ``prepare`` checks whether its model can follow one and rejects the row with the reason if not."""
    needs_torch_allocator: ClassVar[bool] = False
    """True: on a GPU, torch's cudaMallocAsync allocator is configured before the engine's module
    imports torch (it cannot change once torch has started)."""
    gpu_runtime: ClassVar[Optional[str]] = None
    """What runs this engine on a GPU: "onnxruntime" or "torch" (`needs_torch_allocator` implies
    "torch"). With --device cuda, `run` and `run --check` first check that it can run here (a CUDA
    build, a GPU the driver shows) and refuse with exit 2 before writing anything. None: only a GPU
    the NVIDIA driver shows is checked."""
    voice_column_fallback: ClassVar[Optional[str]] = None
    """A corpus column read as the row's voice when the corpus has no 'voice' column."""
    quantize: ClassVar[Optional[Any]] = None
    """Optional capability behind `cosybatch quantize --engine NAME`: a classmethod
    ``quantize(cls, voice, options: EngineOptions) -> dict`` that builds the engine's quantised
    model ahead of a run and returns what it built (printed as JSON). None: the engine has none."""

    sample_rate: int  # of the audio `synthesize` returns, in Hz
    device: str  # the device actually used: "cpu" or "cuda"
    voice_name: str  # the job's default voice, for the manifest and stats
    language: Optional[str] = None  # what the voice speaks ("en"), for the ASR gate; None: unknown or per row

    @abc.abstractmethod
    def __init__(self, voice: Optional[str], options: EngineOptions) -> None:
        """Load the model for `voice` (None: the engine's default); set sample_rate, device and voice_name."""

    @classmethod
    def check(cls, voice: Optional[str], options: EngineOptions) -> dict:
        """What `run --check` verifies without loading weights; returns what it resolved (a dict,
        its "voice" shown by `run --check`). Raise UsageError (or VoiceError) for a bad voice or option."""
        return {"voice": voice}

    @abc.abstractmethod
    def describe(self) -> dict:
        """Everything that makes this engine's audio differ (model hash, synthesis settings): it is
        stored in every KEY.json and in the job fingerprint, with the device, which `fingerprint`
        adds, so a resume with other settings is refused."""

    def fingerprint(self) -> dict:
        return {"engine": self.name, "device": self.device, **engine_describe(self)}

    @abc.abstractmethod
    def prepare(self, text: str, item_id: str, voice: VoiceRequest, attempt: int = 0) -> Prepared:
        """A row's text -> pieces with costs (the planner batches pieces of similar cost). Raise
        RowRejected with a reason for a row this engine cannot speak. Thread-safe.

        ``attempt`` > 0 when the quality gate asks for the row again: fold it into the pieces' seeds
        (``item_seed(seed, id, part, attempt)``) so the new take differs. An engine whose
        ``prepare`` takes no ``attempt`` is never asked again (its rows get one take)."""

    @abc.abstractmethod
    def synthesize(self, units: Sequence[Unit]) -> Synthesised:
        """One batch of pieces from `prepare` -> one trimmed float32 clip per piece. An
        out-of-memory error is retried by the job in halves; any other error, piece by piece."""

    def estimate_seconds(self, piece: Piece) -> Optional[float]:
        """The seconds of audio `piece` (from `prepare`) is expected to make, from its cost, without
        synthesising: `run --plan-only` sums them into the predicted hours. None (the default):
        the engine cannot say, and the plan shows the hours as unknown."""
        return None

    def batch_defaults(self) -> tuple[int, int]:
        """(pieces per batch, padded cost per piece) when the user gives no --batch-size / --batch-budget."""
        return (1, 256) if self.device == "cpu" else (64, 256)

    def memory_plan(self) -> MemoryPlan:
        """The GPU pool this engine pre-allocated and the batch budget its probe measured."""
        return MemoryPlan()

    def runtime_stats(self) -> dict:
        """Engine counters for stats.json's ``engine_stats`` (CosyVoice: its LM's CUDA graphs); {} if none."""
        return {}


def item_seed(job_seed: int, item_id: str, part: int, attempt: int = 0) -> int:
    """The seed of one piece's randomness: the same for the same (job seed, id, piece, attempt) in
    any batch, on any worker, in any rerun. Attempt 0 is the seed rows always had."""
    key = f"{job_seed}\x00{item_id}\x00{part}" + (f"\x00{attempt}" if attempt else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def row_uniform(job_seed: int, item_id: str, attempt: int, what: str) -> float:
    """A uniform draw in [0, 1) for one setting of one row (``what``: "length_scale"), from the
    row's seed `item_seed(job_seed, id, 0, attempt)`: the same in any batch, worker or rerun, new
    for each take of the quality gate."""
    key = f"{item_seed(job_seed, item_id, 0, attempt)}\x00{what}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


@dataclass(frozen=True)
class ScaleRange:
    """A synthesis setting given as one value (``1.1``) or a range (``0.9:1.2``) drawn per row."""

    low: float
    high: float

    @classmethod
    def parse(cls, value: Any, flag: str, minimum: float = 0.0, strict: bool = False,
              maximum: float = math.inf) -> Optional[ScaleRange]:
        """None, a number or "LOW:HIGH" -> a range (None stays None). Values below `minimum` (or at
        it, with `strict`) or above `maximum`, and values that are not finite, raise UsageError
        naming `flag` and the bounds."""
        from ..errors import UsageError

        if value is None:
            return None
        text = str(value).strip()
        low, sep, high = text.partition(":")
        try:
            lo, hi = float(low), float(high if sep else low)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: give a number (1.1) or a range LOW:HIGH (0.9:1.2)") from None
        bad = (lambda v: v <= minimum or v > maximum) if strict else (lambda v: v < minimum or v > maximum)
        if not (math.isfinite(lo) and math.isfinite(hi)) or bad(lo) or bad(hi) or hi < lo:
            bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
            if math.isfinite(maximum):
                bound += f" and <= {maximum:g}"
            raise UsageError(f"{flag} {text!r}: values must be finite and {bound}, LOW <= HIGH")
        return cls(lo, hi)

    @property
    def fixed(self) -> bool:
        return self.low == self.high

    def describe(self):
        """For fingerprints: the value, or [low, high]."""
        return self.low if self.fixed else [self.low, self.high]

    def draw(self, job_seed: int, item_id: str, attempt: int, what: str) -> float:
        """This row's value: uniform in [low, high], rounded to 4 decimals (what is recorded is what is used)."""
        if self.fixed:
            return self.low
        return round(self.low + (self.high - self.low) * row_uniform(job_seed, item_id, attempt, what), 4)


def bounded(name: str, value: Optional[float], low: float, high: float, flag: Optional[str] = None) -> None:
    """A numeric engine option inside [low, high] (None: unset, passes); UsageError naming it otherwise."""
    from ..errors import UsageError

    if value is None:
        return
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or not low <= number <= high:
        raise UsageError(f"{flag or '--engine-opt ' + name} {value!r}: must be between {low:g} and {high:g}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:79] + "…"


def _contract_call(engine_name: str, method: str, call) -> dict:
    """Call an engine's `check` or `describe`: a refusal (a CosybatchError) passes through; anything
    else, or a result that is not a dict, becomes an EngineError naming the engine and what it gave."""
    try:
        result = call()
    except CosybatchError:
        raise
    except Exception as exc:
        raise EngineError(f"engine {engine_name!r}: its {method}() raised {exc!r}; a refusal should raise "
                         "cosybatch.errors.UsageError with a message that says what to change") from exc
    if not isinstance(result, dict):
        raise EngineError(f"engine {engine_name!r}: its {method}() returned {_shown(result)}, not a dict "
                         f"(docs/writing-an-engine.md)")
    return result


def engine_check(cls: type[Engine], voice: Optional[str], options: EngineOptions) -> dict:
    """`cls.check(voice, options)`, with a clear error for a check that returns no dict or crashes."""
    return _contract_call(cls.name, "check", lambda: cls.check(voice, options))


def engine_describe(engine: Engine) -> dict:
    """`engine.describe()`, with a clear error for one that returns no dict or crashes."""
    return _contract_call(engine.name, "describe", engine.describe)
