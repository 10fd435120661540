"""A cosybatch engine written from docs/writing-an-engine.md alone: every sentence of a row
becomes a tone, 10 ms per character, at a pitch drawn from the piece's own seed. It exercises the
whole contract (options, prepare, batched synthesize, row rejection, batch defaults) without a
model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cosybatch.engines import Engine, Piece, Prepared, RowRejected, Synthesised, item_seed
from cosybatch.errors import UsageError

SAMPLE_RATE = 16000


@dataclass(frozen=True)
class ToneOptions:
    base_hz: float = 220.0
    """Lowest pitch; each piece sounds between this and twice it."""
    max_chars: int = 400
    """Longer sentences are refused."""

    def __post_init__(self) -> None:
        if self.base_hz <= 0:
            raise UsageError("tone: base_hz must be > 0")


class ToneEngine(Engine):
    name = "tone"
    Options = ToneOptions

    def __init__(self, voice, options):
        self.sample_rate = SAMPLE_RATE
        self.device = "cpu"
        self.voice_name = voice or "tone"
        self.seed = options.seed
        self.opts: ToneOptions = options.engine
        self.calls = 0

    def describe(self) -> dict:
        return {"voice": self.voice_name, "base_hz": self.opts.base_hz}

    def prepare(self, text, item_id, voice):
        sentences = [s.strip() for s in text.split(".") if s.strip()]
        if not sentences:
            raise RowRejected("nothing to sound")
        if any(len(s) > self.opts.max_chars for s in sentences):
            raise RowRejected(f"a sentence is over max_chars {self.opts.max_chars}")
        pieces = tuple(Piece(cost=len(s), payload=(len(s), item_seed(self.seed, item_id, i)))
                       for i, s in enumerate(sentences))
        return Prepared(pieces, ". ".join(sentences) + ".")

    def synthesize(self, units):
        self.calls += 1
        longest = max(u.payload[0] for u in units) * SAMPLE_RATE // 100
        audio = []
        for unit in units:
            chars, seed = unit.payload
            pitch = self.opts.base_hz * (1 + np.random.default_rng(seed).random())
            t = np.arange(chars * SAMPLE_RATE // 100) / SAMPLE_RATE
            audio.append((0.5 * np.sin(2 * np.pi * pitch * t)).astype(np.float32))
        return Synthesised(audio, real_frames=sum(len(a) for a in audio), padded_frames=longest * len(units))

    def batch_defaults(self):
        return 4, 64
