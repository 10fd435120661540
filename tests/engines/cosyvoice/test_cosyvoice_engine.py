"""CosyVoice2 through `cosybatch run` and its stages: usage errors, --check, the yaml's sampling,
stage batching, half precision and out-of-memory splits (what every family shares is in
test_cosyvoice_every_family.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from helpers import cli, read_output, write_parquet

from cosybatch.engines import EngineOptions, open_engine
from cosybatch.engines.cosyvoice import CosyVoiceOptions


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cv-corpus")
    t = np.linspace(0, 1.5, 24000, endpoint=False)
    sf.write(folder / "prompt.wav", (0.3 * np.sin(2 * np.pi * (180 + 60 * t) * t)).astype("float32"), 16000)
    sf.write(folder / "long.wav", np.zeros(31 * 16000, dtype="float32"), 16000)
    (folder / "notaudio.wav").write_text("not a wav file")
    rows = [
        {"id": "sft-a", "text": "Hello there.", "speaker": "alice"},
        {"id": "sft-b", "text": "The kettle is boiling, so please bring two cups.", "speaker": "bob"},
        {"id": "zero-shot", "text": "Zero-shot cloning works too.", "prompt_wav": "prompt.wav",
         "prompt_text": "A short prompt."},
        {"id": "cross", "text": "A prompt without its text sets only the voice.", "prompt_wav": "prompt.wav"},
        {"id": "bad-speaker", "text": "Unknown speaker.", "speaker": "carol"},
        {"id": "bad-missing", "text": "Missing prompt file.", "prompt_wav": "nope.wav", "prompt_text": "x"},
        {"id": "bad-long", "text": "Prompt over thirty seconds.", "prompt_wav": "long.wav", "prompt_text": "x"},
        {"id": "bad-format", "text": "Prompt that is not audio.", "prompt_wav": "notaudio.wav", "prompt_text": "x"},
        {"id": "reuse", "text": "The same prompt again, computed once.", "prompt_wav": "prompt.wav",
         "prompt_text": "A short prompt."},
        {"id": "bad-outside", "text": "A prompt outside the corpus folder.", "prompt_wav": "../prompt.wav",
         "prompt_text": "x"},
    ]
    for row in rows:
        row.setdefault("speaker", None)
        row.setdefault("prompt_wav", None)
        row.setdefault("prompt_text", None)
    return write_parquet(folder / "corpus.parquet", rows)


@pytest.mark.slow
@pytest.mark.parametrize(("args", "message"), [
    (["--speaker", "carol"], "unknown speaker 'carol'"),
    (["--prompt-wav", "nope.wav", "--prompt-text", "x"], "nope.wav"),
    (["--device", "cuda"], "no usable CUDA GPU"),
    (["--precision", "bf16", "--device", "cpu"], "is for CUDA; on CPU use fp32"),
])
def test_bad_job_level_voice_or_device_is_a_usage_error(cosyvoice_dir, corpus, tmp_path, args, message):
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = cli("run", str(corpus), "--engine", "cosyvoice", "--model", str(cosyvoice_dir),
               "--out", str(tmp_path / "out"), "--progress", "none", *args)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.slow
def test_cosyvoice_needs_a_model(corpus, tmp_path):
    proc = cli("run", str(corpus), "--engine", "cosyvoice", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "--model" in proc.stderr
    proc = cli("run", str(corpus), "--model", str(tmp_path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "--engine cosyvoice" in proc.stderr


@pytest.mark.slow
def test_check_validates_the_speaker_without_loading_weights(cosyvoice_dir, corpus, tmp_path):
    base = ["run", str(corpus), "--engine", "cosyvoice", "--model", str(cosyvoice_dir), "--check"]
    ok = cli(*base, "--speaker", "alice")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.splitlines()[-1])["voice"]["speakers"] == ["alice", "bob"]
    bad = cli(*base, "--speaker", "zed")
    assert bad.returncode == 2 and "unknown speaker 'zed'" in bad.stderr and "alice, bob" in bad.stderr


@pytest.mark.slow
def test_the_yamls_sampling_settings_are_used_and_recorded(cosyvoice_dir, corpus, tmp_path):
    """A folder whose yaml keeps one candidate (top_k 1) and never falls back (tau_r 2) decodes
    greedily; KEY.json says which settings made the audio."""
    import torch

    from cosybatch.cosyvoice.lm.slots import LMRequest, Sampling

    model = tmp_path / "model"
    model.mkdir()
    for entry in cosyvoice_dir.iterdir():
        (model / entry.name).symlink_to(entry)
    (model / "cosyvoice2.yaml").unlink()
    text = (cosyvoice_dir / "cosyvoice2.yaml").read_text()
    assert "top_k: 25" in text and "tau_r: 0.1" in text
    (model / "cosyvoice2.yaml").write_text(text.replace("top_k: 25", "top_k: 1").replace("tau_r: 0.1", "tau_r: 2"))
    engine = open_engine("cosyvoice", None, EngineOptions(device="cpu", corpus_dir=corpus.parent,
                                                          engine=CosyVoiceOptions(model=model)))
    assert engine.sampling == Sampling(top_p=0.8, top_k=1, win_size=10, tau_r=2.0)
    with torch.no_grad():
        engine.lm.llm_decoder.bias[6561:] = -1e4
    request = LMRequest(text=list(range(100, 106)), seed=5)
    sampled = engine.lm.generate([request], engine.sampling)[0]
    assert sampled == engine.lm.generate([LMRequest(text=list(range(100, 106)))], Sampling(greedy=True))[0]

    out = tmp_path / "out"
    proc = cli("run", str(corpus), "--engine", "cosyvoice", "--model", str(model), "--out", str(out),
               "--progress", "none", "--device", "cpu", "--limit", "1")
    assert proc.returncode == 0, proc.stderr
    meta = next(iter(read_output(out).values()))["meta"]
    assert meta["settings"]["sampling"] == {"top_p": 0.8, "top_k": 1, "win_size": 10, "tau_r": 2.0}
    assert meta["segments"] == [{"text": meta["text"], "start": 0.0, "end": meta["duration"]}]  # its one segment

    # --plan-only: the same batches, hours from the text tokens, and the rate of the run just made.
    from cosybatch.config import RunConfig
    from cosybatch.run.forecast import plan_only

    cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "again", engine="cosyvoice",
                                 engine_options={"model": str(model)},
                    device="cpu", limit=1, progress="none")
    plan = plan_only(cfg)["plan"]
    stats = json.loads((out / "stats.json").read_text())
    assert plan["batches"] == stats["batches"] and plan["rows"] == 1 and plan["audio_seconds"] > 0
    assert plan["rate"]["from"] == str(out)

    # stats.json counts the LM's decode steps: on CPU all eager, no CUDA graph captured or replayed.
    lm_stats = json.loads((out / "stats.json").read_text())["engine_stats"]["lm"]
    assert lm_stats["steps"] > 0 and lm_stats["eager_steps"] == lm_stats["steps"]
    assert lm_stats["graphs"] == lm_stats["graph_replays"] == lm_stats["capture_failures"] == 0
    assert lm_stats["stage_streams"] is False


def test_stage_batches_follow_real_lengths_and_the_cost_budget():
    from cosybatch.cosyvoice.pipeline import FLOW_QUADRATIC_FRAMES, flow_cost, stage_batches

    cost = {0: 100, 1: 90, 2: 80, 3: 50, 4: 40, 5: 10}
    assert stage_batches([0, 1, 2, 3, 4, 5], cost, 2) == [[0, 1], [2, 3], [4, 5]]
    # Padded cost = items x the first (longest) item's cost: 3 x 100 > 250, 3 x 80 <= 250.
    assert stage_batches([0, 1, 2, 3, 4, 5], cost, 8, budget=250) == [[0, 1], [2, 3, 4], [5]]
    assert stage_batches([0], {0: 10**9}, 8, budget=1) == [[0]], "an item over the budget still runs, alone"
    # Attention makes long items cost more than their length says.
    assert flow_cost(2 * FLOW_QUADRATIC_FRAMES) == 3 * flow_cost(FLOW_QUADRATIC_FRAMES), "twice the frames, 3x the cost"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_flow_is_finite_and_close_to_fp32(cosyvoice_dir, precision):
    """Weights converted once (the vocoder stays fp32); a padded batch stays finite and within 2%
    of fp32 on every item's mel."""
    import torch

    from cosybatch.cosyvoice.flow.cfm import FlowInput
    from cosybatch.cosyvoice.pipeline import Token2Wav

    items = [FlowInput(torch.arange(40) % 6561, torch.randn(192, generator=torch.Generator().manual_seed(1))),
             FlowInput(torch.arange(15) % 6561, torch.randn(192, generator=torch.Generator().manual_seed(2)))]
    reference = Token2Wav(cosyvoice_dir).mels(items)
    half = Token2Wav(cosyvoice_dir, precision=precision)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert {p.dtype for p in half.flow.parameters()} == {dtype}
    assert {p.dtype for p in half.hift.parameters()} == {torch.float32}
    for want, got in zip(reference, half.mels(items), strict=True):
        assert got.shape == want.shape and bool(torch.isfinite(got).all())
        assert float((got - want).norm() / want.norm()) < 0.02


def test_an_out_of_memory_stage_chunk_is_split_and_keeps_its_order():
    import torch

    from cosybatch.cosyvoice.pipeline import split_on_oom

    calls = []

    def run(chunk):
        calls.append(list(chunk))
        if len(chunk) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return [i * 10 for i in chunk]

    assert split_on_oom([1, 2, 3, 4, 5], run) == [10, 20, 30, 40, 50]
    assert calls == [[1, 2, 3, 4, 5], [1, 2], [3, 4, 5], [3], [4, 5]]

    def alone(chunk):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        split_on_oom([7], alone)
    with pytest.raises(ValueError):
        split_on_oom([1, 2], lambda c: (_ for _ in ()).throw(ValueError("not memory")))
