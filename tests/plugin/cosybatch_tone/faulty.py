"""The default Piper voice with faults on purpose, for the quality gate's tests: a row whose id
starts with ``twice-`` has its first take said twice (the whole clip, then the whole clip again),
and one whose id starts with ``always-twice-`` has every take said twice. Other rows are the voice's
own audio, so the gate must pass them and catch the doubled ones, whose text is all there."""

from __future__ import annotations

import threading

import numpy as np

from cosybatch.engines import Synthesised
from cosybatch.engines.piper import PiperEngine


class FaultyPiper(PiperEngine):
    name = "faulty-piper"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()  # prepare and synthesize run on two threads
        self._doubled: set = set()  # ids of the payloads to double

    def prepare(self, text, item_id, voice=None, attempt=0):
        prepared = super().prepare(text, item_id, voice, attempt)
        if item_id.startswith("always-twice-") or (item_id.startswith("twice-") and attempt == 0):
            with self._lock:
                self._doubled.update(id(piece.payload) for piece in prepared.pieces)
        return prepared

    def synthesize(self, units):
        made = super().synthesize(units)
        with self._lock:
            twice = [id(u.payload) in self._doubled for u in units]
            self._doubled.difference_update(id(u.payload) for u in units)  # an id may be reused later
        audio = [np.concatenate([a, a]) if d else a for d, a in zip(twice, made.audio, strict=True)]
        return Synthesised(audio, real_frames=made.real_frames, padded_frames=made.padded_frames, lm=made.lm)
