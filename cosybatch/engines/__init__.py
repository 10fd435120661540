"""Engines behind one small protocol, imported lazily so the CLI never touches onnxruntime or
torch (or CUDA) until a run actually needs an engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np

from ..plan import Unit

# engine name -> "module:class"; modules are imported only when the engine is opened.
ENGINES = {
    "piper": "cosybatch.engines.piper:PiperEngine",
    "cosyvoice": "cosybatch.engines.cosyvoice:CosyVoiceEngine",
}


class RowRejected(Exception):
    """Raised by `Engine.prepare` for a row the engine cannot synthesise; the message is the reason."""


@dataclass(frozen=True)
class Prepared:
    """A row cut into pieces, each with its estimated cost and engine-specific input."""

    costs: tuple[int, ...]
    payloads: tuple[object, ...]
    text: str  # the text actually spoken, after the engine's own normalisation
    voice: Optional[str] = None  # the row's voice for the manifest, when it is not the engine's voice_name


@dataclass(frozen=True)
class Synthesised:
    """Audio for each unit of a batch, plus the frame counts used for padding statistics."""

    audio: list[np.ndarray]  # float32 mono, one per unit, trimmed to its exact length
    real_frames: int  # output frames the units needed
    padded_frames: int  # output frames the batch computed


@dataclass(frozen=True)
class VoiceRequest:
    """The voice a row asks for, for engines that take any voice per row (``multi_voice``)."""

    name: Optional[str] = None  # voice / speaker name
    prompt_wav: Optional[str] = None  # zero-shot prompt audio
    prompt_text: Optional[str] = None
    from_row: bool = False  # named by the corpus (paths then resolve against the corpus folder)


@dataclass(frozen=True)
class EngineOptions:
    """Options every engine understands; engine-specific ones travel in `extra`."""

    device: str = "auto"  # auto | cpu | cuda
    threads: int = 1  # intra-op threads per session (CPU)
    seed: int = 0
    extra: dict = field(default_factory=dict)


class Engine(Protocol):
    """One model. Engines with ``multi_voice = True`` serve every voice from one instance: the job
    passes each row's :class:`VoiceRequest` to ``prepare`` and batches rows of different voices
    together; the others are opened once per voice."""

    name: str
    sample_rate: int
    device: str  # the device actually used: "cpu" or "cuda"
    multi_voice: bool

    def describe(self) -> dict:
        """What identifies this engine's output (model hash, synthesis settings) for provenance
        and for refusing a resume with different settings."""

    def prepare(self, text: str, item_id: str) -> Prepared:
        """Text to pieces (sentences) with costs; raises RowRejected with a reason."""

    def synthesize(self, units: Sequence[Unit]) -> Synthesised:
        """Synthesise one batch; unit payloads come from `prepare` of this same engine."""


def open_engine(name: str, voice: Optional[str], options: EngineOptions) -> Engine:
    try:
        target = ENGINES[name]
    except KeyError:
        from ..errors import UsageError

        raise UsageError(f"unknown engine {name!r}; choose one of: {', '.join(sorted(ENGINES))}") from None
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(voice, options)
