"""The default Piper voice with faults on purpose, for the quality gate's tests: a row whose id
starts with ``twice-`` has its first take said twice (the whole clip, then the whole clip again),
and one whose id starts with ``always-twice-`` has every take said twice. Other rows are the voice's
own audio, so the gate must pass them and catch the doubled ones, whose text is all there."""

from __future__ import annotations

import numpy as np

from cosybatch.engines import Synthesised
from cosybatch.engines.piper import PiperEngine


class FaultyPiper(PiperEngine):
    name = "faulty-piper"

    def prepare(self, text, item_id, voice=None, attempt=0):
        prepared = super().prepare(text, item_id, voice, attempt)
        doubled = item_id.startswith("always-twice-") or (item_id.startswith("twice-") and attempt == 0)
        if doubled:
            self._doubled = getattr(self, "_doubled", set()) | {id(piece.payload) for piece in prepared.pieces}
        return prepared

    def synthesize(self, units):
        made = super().synthesize(units)
        doubled = getattr(self, "_doubled", set())
        audio = [np.concatenate([a, a]) if id(u.payload) in doubled else a
                 for u, a in zip(units, made.audio, strict=True)]
        doubled -= {id(u.payload) for u in units}  # made: an id may be reused by a later payload
        return Synthesised(audio, real_frames=made.real_frames, padded_frames=made.padded_frames, lm=made.lm)
