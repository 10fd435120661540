"""`cosybatch run --engine cosyvoice` end to end on the tiny official-format model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from helpers import cli, read_output, write_parquet

from cosybatch.engines import EngineOptions, VoiceRequest, open_engine
from cosybatch.engines.cosyvoice import CosyVoiceOptions
from cosybatch.plan import Unit

SAMPLES_PER_TOKEN = 2 * 480  # 2 mel frames per speech token, 480 samples per frame


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


@pytest.fixture(scope="module")
def engine(cosyvoice_dir, corpus):
    return open_engine("cosyvoice", None, EngineOptions(device="cpu", corpus_dir=corpus.parent,
                                                        engine=CosyVoiceOptions(model=cosyvoice_dir)))


def run_row(engine, text: str, item_id: str, voice: VoiceRequest) -> tuple[np.ndarray, int]:
    prepared = engine.prepare(text, item_id, voice)
    units = [Unit(0, part, piece.cost, "", piece.payload)
             for part, piece in enumerate(prepared.pieces)]
    syn = engine.synthesize(units)
    return np.concatenate(syn.audio), syn.real_frames


@pytest.mark.slow
def test_run_every_row_once_with_exact_lengths(cosyvoice_dir, corpus, engine, tmp_path):
    out = tmp_path / "out"
    proc = cli("run", str(corpus), "--engine", "cosyvoice", "--model", str(cosyvoice_dir), "--out", str(out),
               "--progress", "none", "--no-normalize", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["items_done"] == 5 and summary["items_failed"] == 5

    items = read_output(out)
    assert sorted(items) == ["cross", "reuse", "sft-a", "sft-b", "zero-shot"]
    failures = {json.loads(line)["id"]: json.loads(line)["reason"]
                for line in (out / "failures.jsonl").read_text().splitlines()}
    assert sorted(failures) == ["bad-format", "bad-long", "bad-missing", "bad-outside", "bad-speaker"]
    assert "outside" in failures["bad-outside"] and "--prompt-dir" in failures["bad-outside"]
    assert "unknown speaker 'carol'" in failures["bad-speaker"] and "alice" in failures["bad-speaker"]
    assert "30" in failures["bad-long"]
    assert "nope.wav" in failures["bad-missing"]
    assert "notaudio.wav" in failures["bad-format"]

    voices = {
        "sft-a": VoiceRequest("alice", None, None, True),
        "sft-b": VoiceRequest("bob", None, None, True),
        "zero-shot": VoiceRequest(None, "prompt.wav", "A short prompt.", True),
        "cross": VoiceRequest(None, "prompt.wav", None, True),
    }
    for item_id, voice in voices.items():
        item = items[item_id]
        assert item["sample_rate"] == 24000
        assert len(item["audio"]) % SAMPLES_PER_TOKEN == 0
        assert np.abs(item["audio"]).max() > 0.01
        # The same row through the engine directly: same tokens (same seed and id), so same length.
        audio, tokens = run_row(engine, item["meta"]["source_text"] if "source_text" in item["meta"]
                                else item["meta"]["text"], item_id, voice)
        assert len(item["audio"]) == len(audio) == tokens * SAMPLES_PER_TOKEN
    assert items["zero-shot"]["meta"]["voice"].startswith("prompt:")
    assert items["zero-shot"]["meta"]["voice"] == items["reuse"]["meta"]["voice"]
    assert items["sft-a"]["meta"]["voice"] == "spk:alice"


@pytest.mark.slow
def test_resume_completes_without_duplicates(cosyvoice_dir, corpus, tmp_path):
    out = tmp_path / "out"
    base = ["run", str(corpus), "--engine", "cosyvoice", "--model", str(cosyvoice_dir), "--out", str(out),
            "--progress", "none", "--device", "cpu"]
    first = cli(*base, "--limit", "3")
    assert first.returncode == 0, first.stderr
    before = read_output(out)
    assert sorted(before) == ["sft-a", "sft-b", "zero-shot"]
    second = cli(*base)
    assert second.returncode == 0, second.stderr
    after = read_output(out)  # fails on any id written twice
    assert sorted(after) == ["cross", "reuse", "sft-a", "sft-b", "zero-shot"]
    for item_id, item in before.items():
        assert np.array_equal(item["audio"], after[item_id]["audio"])


def test_item_audio_does_not_depend_on_its_batch(engine):
    voice = VoiceRequest("alice", None, None, True)
    text = "One sentence to compare. And a second one, a little longer than the first."
    alone, tokens = run_row(engine, text, "row-7", voice)
    # The same row planned into one batch with other rows and voices.
    others = [("x", "Something else entirely.", VoiceRequest("bob", None, None, True)),
              ("y", "Another row with a prompt voice.", VoiceRequest(None, "prompt.wav", "A short prompt.", True))]
    units = []
    for key, (item_id, t, v) in enumerate([("row-7", text, voice), *others]):
        prepared = engine.prepare(t, item_id, v)
        units += [Unit(key, part, piece.cost, "", piece.payload)
                  for part, piece in enumerate(prepared.pieces)]
    syn = engine.synthesize(units)
    mine = np.concatenate([a for u, a in zip(units, syn.audio, strict=True) if u.row_key == 0])
    assert len(mine) == len(alone) == tokens * SAMPLES_PER_TOKEN
    snr = 10 * np.log10((alone**2).sum() / max(((alone - mine) ** 2).sum(), 1e-30))
    assert snr > 60, "batched audio must equal the item's own (up to float rounding)"


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

    from cosybatch.cosyvoice.lm.pool import LMRequest, Sampling

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
