"""The engine contract, and the registry that finds engines by name.

An engine is a subclass of :class:`Engine` registered under the ``cosybatch.engines`` entry-point
group; the built-in ``piper`` and ``cosyvoice`` register there too, in cosybatch's own
pyproject.toml. The job, the config, the CLI and ray-run only talk to this contract and never name
an engine, so a third-party package that implements it runs with batching, shards, resume, stats
and ray-run unchanged (README: "Writing an engine").

Engine modules are imported lazily: the CLI never touches onnxruntime or torch (or CUDA) until a
run opens an engine, and an engine module must not import them at its top either.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import numpy as np

from ..errors import UsageError
from ..plan import Unit

ENTRY_POINT_GROUP = "cosybatch.engines"
DEFAULT_ENGINE = "piper"  # speaks real English on any machine with nothing to download


class RowRejected(Exception):
    """Raised by `Engine.prepare` for a row the engine cannot synthesise; the message is the reason."""


@dataclass(frozen=True)
class Prepared:
    """A row cut into pieces, each with its estimated cost and engine-specific input."""

    costs: tuple[int, ...]
    payloads: tuple[object, ...]
    text: str  # the text actually spoken, after the engine's own normalisation
    voice: Optional[str] = None  # the row's voice for the manifest, when it is not the engine's voice_name
    instruct: Optional[str] = None  # the instruction the row is spoken with (the row's or the job's default)


@dataclass(frozen=True)
class Synthesised:
    """Audio for each unit of a batch, plus the frame counts used for padding statistics."""

    audio: list[np.ndarray]  # float32 mono, one per unit, trimmed to its exact length
    # For padding statistics, in the engine's own unit of work (Piper: decoder output frames;
    # CosyVoice: LM decode slot-steps): what the units needed, and what the batch computed.
    real_frames: int
    padded_frames: int


@dataclass(frozen=True)
class VoiceRequest:
    """The voice a row asks for, for engines that take any voice per row (``multi_voice``)."""

    name: Optional[str] = None  # voice / speaker name
    prompt_wav: Optional[str] = None  # zero-shot prompt audio
    prompt_text: Optional[str] = None
    from_row: bool = False  # named by the corpus (paths then resolve against the corpus folder)
    instruct: Optional[str] = None  # the row's instruction (engines with ``instruct``)


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


class Engine:
    """The contract between the job and a model. Subclass it, register the class under the
    ``cosybatch.engines`` entry-point group, and `cosybatch run --engine NAME` runs it.

    Class attributes say what the engine is; an instance is one loaded model (one per voice unless
    `multi_voice`). The job calls, in order: ``check`` (``run --check``, no weights loaded),
    ``__init__``, ``describe`` and ``memory_plan`` once, then ``prepare`` for every row and
    ``synthesize`` for every batch, from several threads at once (``workers``)."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    """A frozen dataclass of the engine's settings (`--engine-opt KEY=VALUE`, `[engine_options]`).
    Each field's type (str, int, float, bool, Path, optionally Optional) converts the value; a
    docstring under each field documents it; `__post_init__` may raise UsageError."""
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

    sample_rate: int  # of the audio `synthesize` returns
    device: str  # the device actually used: "cpu" or "cuda"
    voice_name: str  # the job's default voice, for the manifest and stats

    def __init__(self, voice: Optional[str], options: EngineOptions) -> None:
        raise NotImplementedError

    @classmethod
    def check(cls, voice: Optional[str], options: EngineOptions) -> dict:
        """What `run --check` verifies without loading weights; returns what it resolved.
        Raise UsageError (or VoiceError) for a bad voice or option."""
        return {"voice": voice}

    def describe(self) -> dict:
        """Everything that makes this engine's audio differ (model hash, synthesis settings): it is
        stored in every KEY.json and in the job fingerprint, with the device, which `fingerprint`
        adds, so a resume with other settings is refused."""
        raise NotImplementedError

    def fingerprint(self) -> dict:
        return {"engine": self.name, "device": self.device, **self.describe()}

    def prepare(self, text: str, item_id: str, voice: VoiceRequest) -> Prepared:
        """A row's text -> pieces with costs (the planner batches pieces of similar cost). Raise
        RowRejected with a reason for a row this engine cannot speak. Thread-safe."""
        raise NotImplementedError

    def synthesize(self, units: Sequence[Unit]) -> Synthesised:
        """One batch of pieces from `prepare` -> one trimmed float32 clip per piece. An
        out-of-memory error is retried by the job in halves; any other error, piece by piece."""
        raise NotImplementedError

    def batch_defaults(self) -> tuple[int, int]:
        """(pieces per batch, padded cost per piece) when the user gives no --batch-size / --batch-budget."""
        return (1, 256) if self.device == "cpu" else (64, 256)

    def memory_plan(self) -> MemoryPlan:
        """The GPU pool this engine pre-allocated and the batch budget its probe measured."""
        return MemoryPlan()


def item_seed(job_seed: int, item_id: str, part: int) -> int:
    """The seed of one piece's randomness: the same for the same (job seed, id, piece) in any
    batch, on any worker, in any rerun."""
    digest = hashlib.blake2b(f"{job_seed}\x00{item_id}\x00{part}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@functools.cache
def _entry_points() -> dict:
    """Scanned once per process (about 13 ms here; the job asks for its engine class often)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def engine_names() -> list[str]:
    return sorted(_entry_points())


def engine_class(name: str) -> type[Engine]:
    """The class registered as `name` (imported now, not its heavy dependencies)."""
    found = _entry_points()
    if name not in found:
        raise UsageError(f"unknown engine {name!r}; installed engines: {', '.join(sorted(found)) or 'none'} "
                         f"(a plugin registers under the {ENTRY_POINT_GROUP!r} entry-point group)")
    try:
        cls = found[name].load()
    except Exception as exc:
        raise UsageError(f"engine {name!r} ({found[name].value}) failed to import: {exc!r}") from None
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise UsageError(f"engine {name!r} ({found[name].value}) is not a cosybatch.engines.Engine subclass")
    return cls


def open_engine(name: str, voice: Optional[str], options: EngineOptions) -> Engine:
    cls = engine_class(name)
    if options.engine is None:
        options = dataclasses.replace(options, engine=parse_engine_options(cls, {}))
    return cls(voice, options)


def parse_engine_options(cls: type[Engine], raw: Mapping[str, Any]):
    """`raw` (strings from --engine-opt, typed values from a job spec) -> an instance of
    `cls.Options`, each value converted to its field's type; errors name the key."""
    import difflib

    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    hints = typing.get_type_hints(cls.Options)
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            others = [n for n in engine_names() if n != cls.name and name in _option_names(n)]
            close = difflib.get_close_matches(name, fields, n=1)
            known = (f"it is an option of {' and '.join(others)}: add --engine {others[0]}" if len(others) == 1
                     else f"engines that take it: {', '.join(others)}; choose one with --engine" if others
                     else f"did you mean {close[0]!r}?" if close
                     else f"its options are: {', '.join(sorted(fields)) or 'none'}")
            raise UsageError(f"engine {cls.name!r} has no option {key!r}; {known}")
        values[name] = _convert(cls.name, name, value, hints[name])
    try:
        return cls.Options(**values)
    except TypeError as exc:  # a required option is missing
        raise UsageError(f"engine {cls.name!r}: {exc}; give it as --engine-opt KEY=VALUE") from None


def _option_names(engine: str) -> set[str]:
    try:
        return {f.name for f in dataclasses.fields(engine_class(engine).Options)}
    except UsageError:  # a broken plugin does not hide the real error
        return set()


def _convert(engine: str, key: str, value: Any, hint) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    target = args[0] if args else hint
    if value is None:
        if args or hint is Any:
            return None
    elif target is Any:
        return value
    elif target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.strip().lower() in ("1", "true", "yes", "on")
    elif target in (int, float):
        number = value
        if isinstance(value, str):
            try:
                number = float(value) if target is float else int(value)
            except ValueError:
                number = None
        if isinstance(number, (int, float)) and not isinstance(number, bool) and math.isfinite(number) \
                and (target is float or number == int(number)):
            return target(number)
    elif target is str and isinstance(value, (str, int, float, Path)) and not isinstance(value, bool):
        return str(value)
    elif target is Path and isinstance(value, (str, Path)):
        return Path(value)
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:79] + "…"
    raise UsageError(f"engine {engine!r} option {key} = {shown} should be a {getattr(target, '__name__', target)}")
