"""The batched Piper engine against itself (batch vs single) and against piper-tts's own
synthesis of the same voice."""

from __future__ import annotations

import numpy as np
import pytest

from cosybatch.engines import EngineOptions, RowRejected, open_engine
from cosybatch.engines.piper import PiperOptions
from cosybatch.plan import Unit


def units_for(engine, texts):
    units = []
    for row, text in enumerate(texts):
        prepared = engine.prepare(text, f"id-{row}")
        units += [Unit(row, part, piece.cost, "", piece.payload)
                  for part, piece in enumerate(prepared.pieces)]
    return units


@pytest.fixture(scope="module")
def quiet_engine():
    return open_engine("piper", None, EngineOptions(device="cpu", engine=PiperOptions(noise_scale=0.0, noise_w=0.0)))


@pytest.mark.parametrize("noisy", [False, True], ids=["noise-off", "seeded-noise"])
def test_batch_matches_single(engine, quiet_engine, texts, noisy):
    eng = engine if noisy else quiet_engine
    units = units_for(eng, texts)
    assert len({len(u.payload.ids) for u in units}) > 3  # really mixed lengths: padding is exercised
    batch = eng.synthesize(units)
    for unit, audio in zip(units, batch.audio, strict=True):
        single = eng.synthesize([unit]).audio[0]
        assert len(audio) == len(single)
        assert np.abs(audio - single).max() <= 1e-3
    assert batch.padded_frames > batch.real_frames


def test_trim_is_exact_and_tail_is_not_silent_padding(quiet_engine, texts):
    short, long = units_for(quiet_engine, [texts[1], texts[6]])[:2]
    out = quiet_engine.synthesize([short, long])
    hop = quiet_engine.config.hop
    assert len(out.audio[0]) % hop == 0 and len(out.audio[1]) % hop == 0
    assert len(out.audio[0]) < len(out.audio[1])


def test_seeded_noise_reproducible_per_item(engine, texts):
    unit = units_for(engine, [texts[3]])[0]
    a = engine.synthesize([unit]).audio[0]
    b = engine.synthesize([unit]).audio[0]
    np.testing.assert_array_equal(a, b)
    other = engine.prepare(texts[3], "another-id").pieces[0].payload
    c = engine.synthesize([Unit(0, 0, 1, "", other)]).audio[0]
    assert len(c) != len(a) or np.abs(c - a).max() > 1e-2  # a different id draws different noise


def test_matches_piper_tts_with_noise_off(quiet_engine, texts):
    """Same text, same voice: our phonemes, ids and audio equal piper-tts's own pipeline."""
    from piper import PiperVoice, SynthesisConfig

    from cosybatch.engines.piper.voice import bundled_voice

    model, _ = bundled_voice()
    voice = PiperVoice.load(model)
    cfg = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0, normalize_audio=False)
    text = texts[5]  # three sentences
    theirs = list(voice.synthesize(text, cfg))
    ours = units_for(quiet_engine, [text])
    assert len(ours) == len(theirs) == 3
    audio = quiet_engine.synthesize(ours).audio
    for unit, chunk, mine in zip(ours, theirs, audio, strict=True):
        assert list(unit.payload.ids) == list(chunk.phoneme_ids)
        assert len(mine) == len(chunk.audio_float_array)
        assert np.abs(mine - chunk.audio_float_array).max() <= 1e-3


def test_long_sentence_is_split_and_nothing_is_lost(quiet_engine):
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)  # ~360 words, no stop
    prepared = quiet_engine.prepare(words, "long")
    assert len(prepared.pieces) > 1
    assert max(q.cost for q in prepared.pieces) <= 600
    # Every word's phonemes are kept: the pieces together hold as many ids as the text needs.
    whole = sum(q.cost - 3 for q in prepared.pieces)  # minus ^ _ ... $ framing per piece
    assert whole > 360 * 4


def test_nothing_pronounceable_is_rejected(engine):
    with pytest.raises(RowRejected, match="nothing pronounceable"):
        engine.prepare("... - . —", "x")


def test_padding_the_phoneme_axis_changes_nothing(engine, texts):
    """On CUDA the phoneme axis is padded to a multiple of 32 (fewer cuDNN shape searches); the
    padding is masked, so every item's audio is what it is unpadded."""
    padded = open_engine("piper", None, EngineOptions(device="cpu", engine=PiperOptions(pad_multiple=32)))
    units = units_for(engine, texts[:4])
    plain = engine.synthesize(units).audio
    wide = padded.synthesize(units).audio
    for a, b in zip(plain, wide, strict=True):
        assert len(a) == len(b)
        assert np.abs(a - b).max() <= 1e-3


def test_the_edited_graph_is_cached_and_an_unusable_cache_edits_in_memory(tmp_path, monkeypatch, texts):
    """The first open writes the edited graph and its CPU optimization to the cache; a later open
    reads them (no edit, no onnx) and an open whose cache folder cannot be made edits the graph in
    memory: all three know the same graph (the edit's fields) and give the same audio, bit for bit."""
    from cosybatch.engines.piper.graph import patch_graph

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    options = EngineOptions(device="cpu", engine=PiperOptions(noise_scale=0.0, noise_w=0.0))
    first = open_engine("piper", None, options)
    folder = tmp_path / "cache" / "cosybatch" / "piper-patched"
    cached = sorted(folder.glob("*.onnx"))
    assert len(cached) == 2  # the edited graph and onnxruntime's EXTENDED-level optimization of it
    units = units_for(first, texts[:3])
    audio = first.synthesize(units).audio
    in_memory = patch_graph(first.model_path.read_bytes(), conv2d=first.conv2d)
    assert first._graph.fields() == in_memory.fields() and first._graph.noise_inputs

    again = open_engine("piper", None, options)
    assert sorted(folder.glob("*.onnx")) == cached and again._graph.fields() == in_memory.fields()
    (tmp_path / "blocked").write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "blocked"))
    uncached = open_engine("piper", None, options)
    assert uncached._graph.fields() == in_memory.fields()
    for engine in (again, uncached):
        assert all(np.array_equal(a, b) for a, b in zip(engine.synthesize(units).audio, audio, strict=True))
