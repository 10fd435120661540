"""Segment times from the pieces' sample counts, and the matching of espeak-ng's clauses to the text."""

from __future__ import annotations

import numpy as np

from cosybatch.config import RunConfig
from cosybatch.engines.piper.text import clause_spans
from cosybatch.run.executor import assemble_audio, segment_times


def test_segments_tile_the_assembled_clip():
    cfg = RunConfig.from_options(corpus="c.txt", out="out", sentence_silence=0.25, normalize=False)
    parts = [np.full(n, 0.5, dtype=np.float32) * np.sign(np.arange(n) % 2 - 0.5) for n in (1000, 333, 4001)]
    audio = assemble_audio(parts, 16000, cfg)
    segments = segment_times(parts, ["a", None, "c"], 16000, cfg)
    assert [s["text"] for s in segments] == ["a", None, "c"]  # a piece the engine could not tell: null
    bounds = [(round(s["start"] * 16000), round(s["end"] * 16000)) for s in segments]
    assert bounds == [(0, 1000), (5000, 5333), (9333, 13334)] and len(audio) == 13334
    for (start, end), part in zip(bounds, parts, strict=True):
        assert np.array_equal(audio[start:end], part)
    assert segment_times(parts, [None, None, None], 16000, cfg) is None  # no text at all: no segments
    assert segment_times(parts[:1], ["a"], 16000, cfg) == [{"text": "a", "start": 0.0, "end": 1000 / 16000}]


def test_clause_spans():
    text = "One, two. Dr. Who is here. Three"
    size = len  # a stand-in for the phoneme count of a text alone
    # As many pieces of punctuation as clauses: taken as they are.
    assert [text[a:b] for a, b in clause_spans(text, [3, 3, 2, 10, 5], size)] == [
        "One,", "two.", "Dr.", "Who is here.", "Three"]
    # Fewer clauses (espeak read "Dr." inside one): merged where the sizes say.
    assert [text[a:b] for a, b in clause_spans(text, [9, 16, 5], size)] == ["One, two.", "Dr. Who is here.", "Three"]
    assert clause_spans(text, [1] * 6, size) is None  # more clauses than the punctuation cuts: unknown
