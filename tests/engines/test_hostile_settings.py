"""Issue 31, hole 7: every numeric engine setting is finite and inside documented bounds at
`run --check` (Piper's length and noise scales and their ranges, CosyVoice's speed and its batch
sizes), and no setting, a voice's own defaults included, can make one piece's audio longer than
MAX_PIECE_SECONDS: the row fails with the reason instead of allocating it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import cli, read_output, write_jsonl

from cosybatch.config import RunConfig
from cosybatch.engines.base import MAX_PIECE_SECONDS
from cosybatch.engines.cosyvoice import CosyVoiceOptions
from cosybatch.engines.piper.engine import PiperOptions
from cosybatch.errors import UsageError
from cosybatch.run.local import run


@pytest.mark.parametrize(("option", "value"), [
    ("length_scale", "1000"), ("length_scale", "100"), ("length_scale", "0.9:1000"), ("length_scale", "0.1"),
    ("length_scale", "nan"), ("length_scale", "inf"), ("length_scale", "1e300"),
    ("noise_scale", "50"), ("noise_scale", "-1"), ("noise_w", "0:1e9"), ("noise_w", "nan"),
])
def test_piper_prosody_out_of_bounds_is_refused(option, value):
    with pytest.raises(UsageError) as info:
        PiperOptions(**{option: value})
    assert f"--{option.replace('_', '-')} {value!r}" in str(info.value)
    assert "and <= " in str(info.value)


@pytest.mark.parametrize(("option", "value"), [("max_piece_ids", 10**9), ("pad_multiple", 10**6),
                                               ("max_piece_ids", 2)])
def test_piper_sizes_out_of_bounds_are_refused(option, value):
    with pytest.raises(UsageError, match=f"{option} {value}: must be between"):
        PiperOptions(**{option: value})


def test_piper_bounds_themselves_pass():
    PiperOptions(length_scale="0.25:4", noise_scale="0:2", noise_w="0", max_piece_ids=2000, pad_multiple=256)


@pytest.mark.parametrize("value", ["0.0001", "1e300", "0.1:1", "1:5", "inf", "nan"])
def test_cosyvoice_speed_out_of_bounds_is_refused(value):
    with pytest.raises(UsageError) as info:
        CosyVoiceOptions(model=Path("m"), speed=value)
    assert f"--speed {value!r}" in str(info.value) and ">= 0.25 and <= 4" in str(info.value)


@pytest.mark.parametrize(("option", "value"), [("lm_slots", 10**9), ("flow_batch", 0), ("hift_batch", 5000),
                                               ("max_segment_tokens", 10**6), ("max_segment_tokens", 0),
                                               ("max_instruct_chars", 10**12)])
def test_cosyvoice_sizes_out_of_bounds_are_refused(option, value):
    with pytest.raises(UsageError, match="must be between"):
        CosyVoiceOptions(model=Path("m"), **{option: value})
    CosyVoiceOptions(model=Path("m"), speed="0.25:4")


def test_run_check_refuses_a_huge_length_scale_with_exit_2(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "Hello there."}])
    proc = cli("run", corpus, "--out", tmp_path / "out", "--length-scale", "1000", "--check")
    assert proc.returncode == 2, proc.stderr
    assert "--length-scale '1000'" in proc.stderr and "<= 4" in proc.stderr
    assert not (tmp_path / "out").exists()


def slow_voice(tmp_path: Path, length_scale: float) -> Path:
    """The bundled voice with `length_scale` as its own default (its .onnx.json), past any bound."""
    from cosybatch.engines.piper.voice import bundled_voice

    model, config = bundled_voice()
    raw = json.loads(config.read_text())
    raw.setdefault("inference", {})["length_scale"] = length_scale
    (tmp_path / "slow.onnx").symlink_to(model)
    (tmp_path / "slow.onnx.json").write_text(json.dumps(raw))
    return tmp_path / "slow.onnx"


@pytest.mark.parametrize("batch", [1, 4])  # one graph, and two stages
def test_a_voice_default_that_would_make_a_piece_too_long_fails_its_rows(tmp_path, batch):
    import resource

    voice = slow_voice(tmp_path, 1000.0)
    rows = [{"id": f"r{i}", "text": "The kettle is boiling."} for i in range(4)]
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "out"
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run(RunConfig.from_options(corpus=corpus, out=out, voice=str(voice), device="cpu", batch_size=batch,
                                        workers=1,
                           progress="none", max_failures="100%"))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib) / 1024
    assert result.stats["items_failed"] == 4 and not read_output(out)
    reasons = [json.loads(line)["reason"] for line in (out / "failures.jsonl").read_text().splitlines()]
    assert all(f"over the cap of {MAX_PIECE_SECONDS:g} s on one piece" in r for r in reasons), reasons
    assert all("length_scale 1000" in r for r in reasons), reasons
    assert grown_mib < 1024, grown_mib


def test_a_cosyvoice_segment_over_the_cap_fails_its_row(cosyvoice_dir, tmp_path, monkeypatch):
    from cosybatch.cosyvoice import pipeline

    real = pipeline.Pipeline.synthesize

    def capped(self, segs):
        self.max_piece_seconds = 0.01  # every segment the tiny model makes is longer than this
        return real(self, segs)

    monkeypatch.setattr(pipeline.Pipeline, "synthesize", capped)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "Hello there.", "speaker": "alice"}])
    out = tmp_path / "out"
    run(RunConfig.from_options(corpus=corpus, out=out, engine="cosyvoice", device="cpu", progress="none",
                               max_failures="100%",
                  engine_options={"model": str(cosyvoice_dir)}))
    reason = json.loads((out / "failures.jsonl").read_text().splitlines()[0])["reason"]
    assert "over the cap of 0.01 s on one piece" in reason and "speed 1" in reason


def test_the_cosyvoice_engine_sets_the_cap(cosyvoice_dir):
    from cosybatch.engines import EngineOptions, open_engine

    engine = open_engine("cosyvoice", None, EngineOptions(device="cpu", engine=CosyVoiceOptions(model=cosyvoice_dir)))
    assert engine.pipeline.max_piece_seconds == MAX_PIECE_SECONDS
