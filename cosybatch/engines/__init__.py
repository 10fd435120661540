"""Engines: the contract (`base`) and the registry that finds them by name (`registry`).

An engine is a subclass of :class:`Engine` registered under the ``cosybatch.engines`` entry-point
group. The job, the config, the CLI and ray-run only talk to this contract and never name an
engine, so a third-party package that implements it runs with batching, shards, resume, stats and
ray-run unchanged (docs/writing-an-engine.md).

Engine modules are imported lazily: the CLI never touches onnxruntime or torch (or CUDA) until a
run opens an engine, and an engine module must not import them at its top either.
"""

from .base import (
    Alias,
    Engine,
    EngineOptions,
    MemoryPlan,
    NoOptions,
    Piece,
    Prepared,
    RowRejected,
    ScaleRange,
    Synthesised,
    VoiceRequest,
    engine_check,
    engine_describe,
    item_seed,
    row_uniform,
)
from .registry import (
    DEFAULT_ENGINE,
    ENTRY_POINT_GROUP,
    engine_aliases,
    engine_class,
    engine_names,
    open_engine,
    parse_engine_options,
    quantize,
    register_engine,
)

__all__ = [
    "DEFAULT_ENGINE", "ENTRY_POINT_GROUP", "Alias", "Engine", "EngineOptions", "MemoryPlan", "NoOptions", "Piece",
    "Prepared", "RowRejected", "ScaleRange", "Synthesised", "VoiceRequest", "engine_aliases", "engine_check",
    "engine_class", "engine_describe", "engine_names", "item_seed", "open_engine", "parse_engine_options",
    "quantize", "register_engine", "row_uniform",
]
