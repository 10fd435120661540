"""The Piper engine (VITS voices on onnxruntime), by concern: `voice` (finding a voice and its
config), `text` (what a voice speaks: scripts, symbols, emoji), `phonemes` (espeak clauses -> ids,
the one `Phonemizer`), `graph` (the ONNX edit), `split` (two-stage synthesis), `quant` (INT8 voices)
and `engine` (`PiperEngine`). Nothing here imports onnxruntime at its top."""

from .engine import PiperEngine, PiperOptions

__all__ = ["PiperEngine", "PiperOptions"]
