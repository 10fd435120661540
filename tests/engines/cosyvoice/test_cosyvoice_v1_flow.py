"""CosyVoice-300M (v1): the flow and the 22,050 Hz HiFT against upstream's classes, batching, and the
tiny official-layout folder (tiny_v1) loading strictly into upstream's classes and ours."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import upstream

from cosybatch.cosyvoice.flow.cfm import FlowInput
from cosybatch.cosyvoice.flow.v1 import MaskedDiffWithXvec, build_flow_v1, mel_frames
from cosybatch.cosyvoice.hift.generator import HiFT, load_hift_state
from cosybatch.cosyvoice.model import load_flow, load_hift, read_config
from cosybatch.cosyvoice.tiny import v1 as tiny_v1
from cosybatch.cosyvoice.tiny.__main__ import main as tiny_main
from cosybatch.cosyvoice.weights import ModelDirError, load_state, load_strict
from cosybatch.cosyvoice.yamlconf import Call, load_yaml

# (tokens, prompt tokens): with and without a zero-shot prompt; below and above the 40 tokens where
# the regulator starts stretching head, middle and tail separately (41 is the first split case).
SHAPES = [(13, 0), (45, 6), (7, 4), (60, 0), (41, 3)]
SEEDS = [11, 12, 13, 14, 15]
HOP = 256  # samples per mel frame: 8 * 8 * hop_len 4

# Waveforms are compared by SNR as in test_cosyvoice_flow.py: the harmonic source integrates f0 over every
# sample, so a last-bit difference in a batched conv moves samples by ~1e-5 while the signal stays the same.
MIN_SNR_DB = 60.0


def snr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    ref, oth = reference.double().numpy(), other.double().numpy()
    return float(10 * np.log10((ref**2).sum() / max(((ref - oth) ** 2).sum(), 1e-30)))


def make_items(shapes=SHAPES, seed=3) -> list[FlowInput]:
    gen = torch.Generator().manual_seed(seed)
    items = []
    for tokens, prompt in shapes:
        items.append(
            FlowInput(
                tokens=torch.randint(0, 4096, (tokens,), generator=gen),
                embedding=torch.randn(192, generator=gen),
                prompt_tokens=torch.randint(0, 4096, (prompt,), generator=gen) if prompt else None,
                prompt_mel=torch.randn(mel_frames(prompt), 80, generator=gen) if prompt else None,
            )
        )
    return items


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def v1_dir(tmp_path_factory):
    return tiny_v1.write_model_dir(tmp_path_factory.mktemp("v1") / "CosyVoice-300M-SFT", variant="sft", seed=0)


@pytest.fixture(scope="module")
def raw(v1_dir):
    return load_yaml(v1_dir / "cosyvoice.yaml")


@pytest.fixture(scope="module")
def flow(v1_dir) -> MaskedDiffWithXvec:
    return load_flow(read_config(v1_dir))


@pytest.fixture(scope="module")
def up_flow(v1_dir, raw):
    model = upstream.flow_v1_model(raw["flow"])
    model.load_state_dict(torch.load(v1_dir / "flow.pt", map_location="cpu", weights_only=True), strict=True)
    return model


@pytest.fixture(scope="module")
def hift(v1_dir) -> HiFT:
    return load_hift(read_config(v1_dir))


@pytest.fixture(scope="module")
def up_hift(v1_dir, raw):
    u = upstream.load()
    kwargs = dict(raw["hift"].kwargs)
    kwargs["f0_predictor"] = u.ConvRNNF0Predictor(**kwargs["f0_predictor"].kwargs)
    model = u.HiFTGenerator(**kwargs).eval()
    model.load_state_dict(torch.load(v1_dir / "hift.pt", map_location="cpu", weights_only=True), strict=True)
    return model


# ------------------------------------------------------------------------------------------------ flow


def test_mel_frames_follow_upstreams_rule(flow):
    for n in (1, 2, 20, 40, 41, 50, 123, 500):
        assert mel_frames(n) == flow.mel_frames(n) == int(n / 50 * 22050 / 256)
    assert mel_frames(50) == 86 and mel_frames(20) == 34


@pytest.mark.slow
def test_flow_batch_matches_upstream_single_items(flow, up_flow):
    items = make_items()
    batch = flow.inference(items, SEEDS)
    for item, seed, mel in zip(items, SEEDS, batch, strict=True):
        want = upstream.flow_v1_inference(up_flow, item, seed)
        assert mel.shape == (80, mel_frames(len(item.tokens))) == want.shape
        assert torch.isfinite(mel).all() and want.abs().max() > 1.0
        assert (mel - want).abs().max() <= 1e-4, "batched mel differs from upstream's single-item mel"


def test_flow_item_does_not_depend_on_its_batch(flow):
    items = make_items()
    batch = flow.inference(items, SEEDS)
    for k in (1, 2):  # a long split item with a prompt, and the shortest one
        alone = flow.inference([items[k]], [SEEDS[k]])[0]
        pair = flow.inference([items[3], items[k]], [SEEDS[3], SEEDS[k]])[1]
        for other in (pair, batch[k]):
            assert other.shape == alone.shape
            assert (other - alone).abs().max() <= 1e-4
    # The noise comes from the item's seed: another seed gives another mel.
    reseeded = flow.inference([items[2]], [SEEDS[2] + 1])[0]
    assert (reseeded - batch[2]).abs().max() > 1e-2


def test_flow_noise_is_upstreams_global_draw(flow):
    torch.manual_seed(42)
    want = torch.randn(1, 80, 37)
    assert torch.equal(flow.noise(37, 42), want)


def test_flow_refuses_half_a_prompt(flow):
    item = make_items([(5, 0)])[0]
    item.prompt_tokens = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="prompt"):
        flow.inference([item])
    with pytest.raises(ValueError, match="seeds"):
        flow.inference(make_items([(5, 0)]), [1, 2])


def test_build_flow_v1_refuses_another_family(raw):
    node = raw["flow"]
    with pytest.raises(ValueError, match="MaskedDiffWithXvec"):
        build_flow_v1(Call("cosyvoice.flow.flow.CausalMaskedDiffWithXvec", node.kwargs))


# ------------------------------------------------------------------------------------------------ HiFT


def test_hift_v1_settings(hift):
    assert hift.sampling_rate == 22050 and hift.samples_per_frame == HOP
    assert type(hift.m_source).__name__ == "SampleSineSource"


@pytest.mark.slow
def test_hift_single_items_match_upstream(hift, up_hift):
    gen = torch.Generator().manual_seed(1)
    for frames, seed in ((23, 3), (9, 5)):
        mel = torch.randn(80, frames, generator=gen)
        torch.manual_seed(seed)
        want, _ = up_hift.inference(speech_feat=mel[None])
        got = hift.vocode([mel], [seed])[0]
        assert got.shape == want[0].shape == (frames * HOP,)
        # Same seed and draw order as upstream's global generator: equal up to float rounding (measured 2.4e-7).
        assert (got - want[0]).abs().max() <= 1e-6


@pytest.mark.slow
def test_hift_batch_matches_upstream_and_single(hift, up_hift):
    gen = torch.Generator().manual_seed(2)
    mels = [torch.randn(80, n, generator=gen) for n in (23, 57, 9)]
    seeds = [3, 4, 5]
    batch = hift.vocode(mels, seeds)
    for mel, seed, got in zip(mels, seeds, batch, strict=True):
        torch.manual_seed(seed)
        want = up_hift.inference(speech_feat=mel[None])[0][0]
        alone = hift.vocode([mel], [seed])[0]
        assert got.shape == want.shape == alone.shape
        assert want.abs().max() > 0.1
        # A batched conv may round the F0 one ulp differently (measured: 3.8e-6 Hz on one item), and the
        # per-sample float32 phase sum carries that forward: ~1e-4 at the end of a 57-frame item.
        assert (got - want).abs().max() <= 1e-3
        assert snr_db(want, got) >= MIN_SNR_DB and snr_db(alone, got) >= MIN_SNR_DB


# ------------------------------------------------------------------------------------------------ folder


def test_folder_layout(v1_dir):
    names = {p.name for p in v1_dir.iterdir()}
    assert names == {"cosyvoice.yaml", "configuration.json", "llm.pt", "flow.pt", "hift.pt", "spk2info.pt",
                     "campplus.onnx", "speech_tokenizer_v1.onnx"}
    config = read_config(v1_dir)
    assert config.family.version == 1 and config.sample_rate == 22050
    spk2info = torch.load(v1_dir / "spk2info.pt", weights_only=True)
    assert sorted(spk2info) == sorted(tiny_v1.SPEAKERS)
    assert all(v["embedding"].shape == (1, 192) for v in spk2info.values())


def test_base_variant_has_no_speakers_and_writing_is_deterministic(tmp_path, v1_dir):
    out = tiny_v1.write_model_dir(tmp_path / "CosyVoice-300M", variant="base", seed=0, llm=False)
    assert not (out / "spk2info.pt").exists()
    for name in ("cosyvoice.yaml", "campplus.onnx", "speech_tokenizer_v1.onnx"):
        assert hashlib.sha256((out / name).read_bytes()).digest() == hashlib.sha256(
            (v1_dir / name).read_bytes()).digest()
    for name in ("flow.pt", "hift.pt"):
        a, b = load_state(out / name), load_state(v1_dir / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_folder_loads_strictly_into_upstream_lm(v1_dir, raw):
    upstream.load()
    from cosyvoice.llm.llm import TransformerLM
    from cosyvoice.transformer.encoder import ConformerEncoder, TransformerEncoder

    kw = raw["llm"].kwargs
    sizes = ("text_encoder_input_size", "llm_input_size", "llm_output_size", "text_token_size", "speech_token_size",
             "spk_embed_dim")
    lm = TransformerLM(**{k: kw[k] for k in sizes}, text_encoder=ConformerEncoder(**kw["text_encoder"].kwargs),
                       llm=TransformerEncoder(**kw["llm"].kwargs), sampling=None)
    lm.load_state_dict(torch.load(v1_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)


def test_bad_keys_are_named(v1_dir, raw, tmp_path):
    state = load_state(v1_dir / "flow.pt")
    state["decoder.estimator.bogus.weight"] = state.pop("decoder.estimator.final_proj.weight")
    path = tmp_path / "flow.pt"
    with pytest.raises(ModelDirError, match=r"missing: decoder\.estimator\.final_proj\.weight.*"
                       r"unexpected: decoder\.estimator\.bogus\.weight"):
        load_strict(build_flow_v1(raw["flow"]), state, path)
    hift_state = load_state(v1_dir / "hift.pt")
    del hift_state["m_source.l_linear.bias"]
    kwargs = dict(raw["hift"].kwargs)
    kwargs["f0_predictor"] = kwargs["f0_predictor"].kwargs
    with pytest.raises(ValueError, match=r"m_source\.l_linear\.bias"):
        load_hift_state(HiFT(**kwargs), hift_state)


def test_speech_tokenizer_v1_onnx(v1_dir):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(v1_dir / "speech_tokenizer_v1.onnx"), providers=["CPUExecutionProvider"])
    feats = np.random.default_rng(0).standard_normal((1, 128, 9)).astype(np.float32)
    for length in (9, 6, 1):
        (indices,) = session.run(None, {"feats": feats, "feats_length": np.array([length], dtype=np.int32)})
        assert indices.dtype == np.int64 and indices.shape == (1, 1, (length + 1) // 2)
        assert indices.min() >= 0 and indices.max() < 4096


def test_cli_writes_a_folder(tmp_path, capsys):
    out = tmp_path / "CosyVoice-300M-Instruct"
    tiny_main([str(out), "--family", "v1", "--variant", "instruct", "--seed", "1"])
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "spk2info.pt").is_file() and (out / "llm.pt").is_file()
    assert read_config(out).family.version == 1


def test_cli_short_makes_the_stop_id_likely_and_refuses_v3(tmp_path, capsys):
    from cosybatch.cosyvoice.tiny.random_weights import SHORT_STOP_BIAS

    out = tmp_path / "CosyVoice-300M-SFT"
    tiny_main([str(out), "--family", "v1", "--variant", "sft", "--short"])
    state = torch.load(out / "llm.pt", weights_only=True)
    bias, weight = state["llm_decoder.bias"], state["llm_decoder.weight"]
    assert bias[-1] == SHORT_STOP_BIAS and not weight[-1].any()  # v1's one stop id is its last
    assert bias[:-1].abs().max() < 1 and weight[:-1].any()  # the speech ids keep their random weights
    with pytest.raises(SystemExit):
        tiny_main([str(tmp_path / "v3"), "--family", "v3", "--short"])
    assert "--short is for v1 and v2" in capsys.readouterr().err
