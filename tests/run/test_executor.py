"""What the executor makes of an engine's audio: the floor under every engine's audio (a clip that
is empty, non-finite or constant is never committed; its row fails with the reason and the rest of
the batch is written, issue 23, case 5), and the segment times of the pieces in the assembled clip."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cosybatch_tone import ToneEngine
from helpers import read_output, write_jsonl

from cosybatch.config import RunConfig
from cosybatch.engines import Synthesised, item_seed
from cosybatch.run.executor import assemble_audio, segment_times
from cosybatch.run.local import run

BROKEN = {
    "zeros": lambda a: np.zeros_like(a),
    "nan": lambda a: np.full_like(a, np.nan),
    "inf-sample": lambda a: np.concatenate([a[:10], np.array([np.inf], np.float32), a[10:]]),
    "empty": lambda a: a[:0],
    "constant": lambda a: np.full_like(a, 0.25),
}


@pytest.fixture
def broken_tone(monkeypatch):
    """The tone engine, returning broken audio for rows whose id names a kind of BROKEN (second piece)."""
    original = ToneEngine.synthesize

    def synthesize(self, units):
        syn = original(self, units)
        wanted = {item_seed(self.seed, kind, 1): fn for kind, fn in BROKEN.items()}
        audio = [wanted.get(u.payload[1], lambda a: a)(a) for u, a in zip(units, syn.audio, strict=True)]
        return Synthesised(audio, syn.real_frames, syn.padded_frames)

    monkeypatch.setattr(ToneEngine, "synthesize", synthesize)


@pytest.mark.parametrize("normalize", [True, False])
def test_empty_nan_or_constant_clip_fails_its_row(broken_tone, tone, tmp_path, normalize):
    rows = [{"id": "good-1", "text": "Fine. And more."}]
    rows += [{"id": kind, "text": "First piece. Second piece."} for kind in BROKEN]
    rows += [{"id": "good-2", "text": "Also fine. Yes."}]
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "out"
    result = run(tone(corpus, out, normalize=normalize, batch_size=16))
    assert set(read_output(out)) == {"good-1", "good-2"}
    reasons = {json.loads(x)["id"]: json.loads(x)["reason"] for x in (out / "failures.jsonl").read_text().splitlines()}
    assert set(reasons) == set(BROKEN)
    assert "empty" in reasons["empty"] and "piece 2 of 2" in reasons["empty"]
    assert "non-finite" in reasons["nan"] and "non-finite" in reasons["inf-sample"]
    assert "1 of" in reasons["inf-sample"]
    assert "constant" in reasons["zeros"] and "constant" in reasons["constant"]
    assert result.stats["items_failed"] == len(BROKEN) and result.stats["items_done"] == 2


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
