"""Two-stage Piper synthesis (encoder + durations, then flow + decoder regrouped by real frames)
against the one-graph path of the same voice: same audio, same per-item noise, real padding figures."""

from __future__ import annotations

import gc
import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import TEXTS, read_output, write_parquet

from cosybatch.config import RunConfig
from cosybatch.engines import EngineOptions, open_engine
from cosybatch.engines.piper import PiperOptions
from cosybatch.engines.piper.split import group_by_frames
from cosybatch.errors import UsageError
from cosybatch.plan import Unit
from cosybatch.run.local import run

# Peaks of this voice's speech are 0.3-0.7. Batched audio differs from an item's single run only by
# float rounding of differently shaped convolutions, and near its end where a padded batch's decoder
# sees its neighbour frames: measured up to 2e-4 for both the one-graph and the two-stage batch.
BATCH_BOUND = 5e-4


def units_for(engine, texts, prefix="id"):
    units = []
    for row, text in enumerate(texts):
        prepared = engine.prepare(text, f"{prefix}-{row}")
        units += [Unit(row, part, piece.cost, "", piece.payload)
                  for part, piece in enumerate(prepared.pieces)]
    return units


def pair(**options):
    """(one-graph, two-stage) engines of the bundled voice with the same settings."""
    one = open_engine("piper", None, EngineOptions(device="cpu", engine=PiperOptions(two_stage=False, **options)))
    two = open_engine("piper", None, EngineOptions(device="cpu", engine=PiperOptions(two_stage=True, **options)))
    return one, two


NOISE = {"quiet": {"noise_scale": 0.0, "noise_w": 0.0}, "noisy": {}}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """The shared test texts without the 170-character one: a batch holding it cost 8 CPU-s in the
    one graph alone (every piece padded to its length), a fifth of this module. The rest, 13 to 159
    phonemes, still pad the one graph to under half real frames."""
    return [t for t in TEXTS if len(t) < 100]


@pytest.fixture(scope="module", params=["quiet", "noisy"], ids=["noise-off", "seeded-noise"])
def voice(request, texts):
    """One pair of engines (noise off, or the voice's seeded noise), the units of the test texts and
    one mixed batch of them through each engine, computed once for the tests below. One pair at a
    time: each ONNX session keeps the arena of its largest batch (about a GB), so the quiet pair is
    gone before the noisy one opens."""
    batch_whole = None
    if request.param == "quiet":
        # Two-stage with one decoder group, for test_padding_counts_real_decoder_frames: synthesised
        # and closed before the pair opens, so no more than two voices' arenas are alive at once.
        whole = open_engine("piper", None, EngineOptions(device="cpu", engine=PiperOptions(
            two_stage=True, stage2_efficiency=0.0, **NOISE["quiet"])))
        batch_whole = whole.synthesize(units_for(whole, texts))
        del whole
        gc.collect()
    one, two = pair(**NOISE[request.param])
    units = units_for(one, texts)
    return SimpleNamespace(one=one, two=two, units=units, batch_one=one.synthesize(units),
                           batch_two=two.synthesize(units), batch_whole=batch_whole)


quiet_only = pytest.mark.parametrize("voice", ["quiet"], indirect=True, ids=["noise-off"])
noisy_only = pytest.mark.parametrize("voice", ["noisy"], indirect=True, ids=["seeded-noise"])


def test_same_audio_as_one_graph(voice):
    """Alone, an item's two-stage audio is bit-identical to the one graph's (noise off, and with
    noise on: the same per-item streams); in a mixed batch both are within BATCH_BOUND of it."""
    one, two = voice.one, voice.two
    units, batch_one, batch_two = voice.units, voice.batch_one, voice.batch_two
    assert len({len(u.payload.ids) for u in units}) > 3  # mixed lengths: regrouping is exercised
    hop = one.config.hop
    # Alone: the shortest, the longest and two between (each single run costs a whole synthesis).
    by_length = sorted(range(len(units)), key=lambda i: len(units[i].payload.ids))
    alone = {by_length[0], by_length[-1], by_length[len(by_length) // 3], by_length[2 * len(by_length) // 3]}
    for i, (unit, a, b) in enumerate(zip(units, batch_one.audio, batch_two.audio, strict=True)):
        assert len(a) == len(b) and len(b) % hop == 0
        assert np.abs(b - a).max() <= BATCH_BOUND
        if i in alone:
            single_one = one.synthesize([unit]).audio[0]
            np.testing.assert_array_equal(two.synthesize([unit]).audio[0], single_one)
            assert len(b) == len(single_one) and np.abs(b - single_one).max() <= BATCH_BOUND
    assert batch_two.real_frames == batch_one.real_frames  # the same frame counts, item by item


@noisy_only
def test_noise_streams_are_per_item(voice, texts):
    """With noise on, an item's audio follows its own seed, not its batch: the same in any batch,
    different under another id."""
    two, units, batch_two = voice.two, voice.units, voice.batch_two
    alone = two.synthesize([units[3]]).audio[0]
    mixed = batch_two.audio[3]
    reordered = two.synthesize(units[::-1]).audio[len(units) - 4]
    assert np.abs(mixed - alone).max() <= BATCH_BOUND and np.abs(reordered - alone).max() <= BATCH_BOUND
    other = units_for(two, [texts[units[3].row_key]], prefix="other")[units[3].part]
    c = two.synthesize([other]).audio[0]
    assert len(c) != len(alone) or np.abs(c - alone).max() > 1e-2


@quiet_only
def test_padding_counts_real_decoder_frames(voice):
    """Padding figures come from the frame counts the graph computed: real frames are what the
    items' audio is long; padded frames are what the decoder groups computed, >= 95% real."""
    one, out_one, out_two = voice.one, voice.batch_one, voice.batch_two
    hop = one.config.hop
    assert out_two.real_frames == sum(len(a) for a in out_two.audio) // hop
    assert out_one.real_frames / out_one.padded_frames < 0.5  # the one graph pads to the longest
    assert out_two.real_frames / out_two.padded_frames >= 0.95
    assert out_two.padded_frames < out_one.padded_frames
    out_whole = voice.batch_whole  # one decoder group: sorted by frames, padded to the longest
    assert out_whole.padded_frames == out_one.padded_frames
    for a, b in zip(out_whole.audio, out_one.audio, strict=True):
        assert len(a) == len(b) and np.abs(a - b).max() <= BATCH_BOUND


@pytest.mark.parametrize("target", [0.0, 0.5, 0.9, 0.95, 1.0])
def test_group_by_frames_meets_the_target_with_fewest_groups(target):
    rng = np.random.default_rng(3)
    frames = [int(x) for x in rng.integers(20, 900, size=32)]
    groups = group_by_frames(frames, target)
    assert sorted(i for g in groups for i in g) == list(range(32))  # every item once
    for g in groups:
        assert sum(frames[i] for i in g) >= target * len(g) * max(frames[i] for i in g)
    if target == 0.0:
        assert len(groups) == 1
    if target == 1.0:
        assert len(groups) == len(set(frames))
    # No cut with fewer groups meets the target: check against every cut of the sorted order for
    # a small case.
    small = frames[:10]
    best = len(group_by_frames(small, target))
    order = sorted(small, reverse=True)
    for mask in range(1 << 9):
        cuts = [0] + [k + 1 for k in range(9) if mask >> k & 1] + [10]
        parts = [order[a:b] for a, b in itertools.pairwise(cuts)]
        if all(sum(p) >= target * len(p) * p[0] for p in parts):
            assert len(parts) >= best


@quiet_only
def test_split_cuts_at_the_durations(voice):
    two = voice.two
    split = two._two_stage.split
    assert split.carried[0] == split.durations
    assert "input" not in split.stage2_inputs and "input_lengths" not in split.stage2_inputs
    frame_noise = [n for n, f in zip(two._graph.noise_inputs, two._graph.noise_on_frames, strict=True) if f]
    assert set(frame_noise) <= set(split.stage2_inputs)
    assert not set(frame_noise) & set(split.stage1_inputs)


@quiet_only
def test_auto_uses_two_stages_for_batches_only(voice, texts):
    """Unset, two stages run batches of several pieces; a single piece, and every batch at the CPU
    default of batch 1, runs the one graph (same audio), and the stage sessions are never opened."""
    one, two = voice.one, voice.two
    auto = open_engine("piper", None, EngineOptions(device="cpu", engine=PiperOptions(noise_scale=0.0, noise_w=0.0)))
    units = units_for(auto, texts[:4])
    single = auto.synthesize(units[:1])
    assert auto._two_stage is None  # not opened for single pieces
    np.testing.assert_array_equal(single.audio[0], one.synthesize(units[:1]).audio[0])
    batch, expected = auto.synthesize(units), two.synthesize(units)
    assert auto._two_stage is not None
    assert (batch.real_frames, batch.padded_frames) == (expected.real_frames, expected.padded_frames)
    for a, b in zip(batch.audio, expected.audio, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not one._use_two_stage(32) and two._use_two_stage(1)
    with pytest.raises(UsageError):
        PiperOptions(stage2_efficiency=1.5)


def test_run_reports_two_stage_padding_in_stats(tmp_path, texts):
    """A whole job at batch 32 (two stages by default): every id once, stats.json's padding is
    the decoder's, under 5%."""
    rows = [{"id": f"row-{i}", "text": t} for i, t in enumerate(texts * 2)]
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    run(RunConfig.from_options(corpus=corpus, out=out, progress="none", device="cpu", batch_size=32, workers=1))
    stats = json.loads((out / "stats.json").read_text())
    assert stats["items_done"] == len(rows) and stats["items_failed"] == 0
    assert stats["padding_ratio"] <= 0.05
    assert set(read_output(out)) == {r["id"] for r in rows}
