"""The batch-native HiFT vocoder against upstream CosyVoice2's HiFTGenerator, one item at a time.

Tiny widths keep it fast; every other hyperparameter is CosyVoice2's. Random weights are made non-trivial
(Snake alphas and biases perturbed, F0 head spread around the voicing threshold) so that a missing mask, a
shared iSTFT envelope or a wrong noise draw shows up as a difference.
"""

from __future__ import annotations

import pytest
import torch
import upstream

from cosybatch.cosyvoice.hift.generator import HiFT, load_hift_state

WIDTH = 32
HOP = 480  # samples per mel frame: 8 * 5 * 3 * hop_len 4
CONFIG = {
    "in_channels": 80,
    "base_channels": WIDTH,
    "nb_harmonics": 8,
    "sampling_rate": 24000,
    "nsf_alpha": 0.1,
    "nsf_sigma": 0.003,
    "nsf_voiced_threshold": 10,
    "upsample_rates": [8, 5, 3],
    "upsample_kernel_sizes": [16, 11, 7],
    "istft_params": {"n_fft": 16, "hop_len": 4},
    "resblock_kernel_sizes": [3, 7, 11],
    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "source_resblock_kernel_sizes": [7, 7, 11],
    "source_resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "lrelu_slope": 0.1,
    "audio_limit": 0.99,
}
F0_CONFIG = {"num_class": 1, "in_channels": 80, "cond_channels": WIDTH}


@pytest.fixture(scope="module")
def reference():
    """Upstream HiFTGenerator with random, perturbed weights (weight-norm parametrised, as upstream builds it)."""
    u = upstream.load()
    torch.manual_seed(1234)
    model = u.HiFTGenerator(**CONFIG, f0_predictor=u.ConvRNNF0Predictor(**F0_CONFIG)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".alpha"):
                param.uniform_(0.5, 2.0)
            elif name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
        # Spread F0 over roughly 0..150 Hz so frames fall on both sides of the 10 Hz voicing threshold.
        model.f0_predictor.classifier.weight.mul_(1000.0)
        model.f0_predictor.classifier.bias.fill_(30.0)
    return model


@pytest.fixture(scope="module")
def ours(reference):
    model = HiFT(**CONFIG, f0_predictor=dict(F0_CONFIG)).eval()
    load_hift_state(model, reference.state_dict())
    return model


def upstream_single(reference, mel: torch.Tensor, seed: int) -> torch.Tensor:
    """One (80, L) mel through upstream's inference with the global RNG seeded."""
    torch.manual_seed(seed)
    audio, _ = reference.inference(speech_feat=mel[None])
    return audio[0]


def run_batch(model: HiFT, mels: list[torch.Tensor], seeds: list[int], pad_value: float = 0.0):
    """Pad (80, L_i) mels into one batch (padding filled with ``pad_value`` noise) and vocode it."""
    lengths = torch.tensor([m.shape[-1] for m in mels])
    batch = pad_value * torch.randn(len(mels), 80, int(lengths.max()))
    for i, m in enumerate(mels):
        batch[i, :, : m.shape[-1]] = m
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    return model(batch, lengths, generators)


@pytest.mark.slow
def test_batch_matches_upstream_item_by_item(reference, ours):
    gen = torch.Generator().manual_seed(7)
    lengths = [37, 20, 5]
    seeds = [101, 202, 303]
    mels = [torch.randn(80, n, generator=gen) for n in lengths]

    # The check only means something if the source has voiced and unvoiced samples.
    with torch.inference_mode():
        voiced = torch.cat([reference.f0_predictor(m[None])[0] > CONFIG["nsf_voiced_threshold"] for m in mels])
    assert voiced.any() and not voiced.all()

    # Garbage in the padded frames must not matter either.
    audio, samples = run_batch(ours, mels, seeds, pad_value=3.0)
    assert audio.shape == (3, HOP * max(lengths))
    assert samples.tolist() == [HOP * n for n in lengths]
    for i, (mel, seed) in enumerate(zip(mels, seeds, strict=True)):
        expected = upstream_single(reference, mel, seed)
        assert expected.shape == (HOP * lengths[i],)
        item = audio[i, : samples[i]]
        assert item.abs().max() > 0.01
        diff = (item - expected).abs().max().item()
        assert diff <= 1e-4, f"item {i} (L={lengths[i]}): max abs diff {diff}"
        # The end of the item, where batching effects live, is covered by the same bound.
        tail = (item[-HOP:] - expected[-HOP:]).abs().max().item()
        assert tail <= 1e-4, f"item {i} tail: max abs diff {tail}"
        assert torch.all(audio[i, samples[i] :] == 0)


@pytest.mark.slow
def test_item_does_not_depend_on_batch_partners(ours):
    gen = torch.Generator().manual_seed(8)
    item = torch.randn(80, 20, generator=gen)
    alone, _ = run_batch(ours, [item], [5])
    first, n_first = run_batch(
        ours, [item, torch.randn(80, 37, generator=gen), torch.randn(80, 5, generator=gen)], [5, 6, 7]
    )
    last, n_last = run_batch(ours, [torch.randn(80, 9, generator=gen), item], [9, 5], pad_value=1.0)
    assert n_first[0] == n_last[1] == alone.shape[1] == HOP * 20
    assert (first[0, : HOP * 20] - alone[0]).abs().max().item() <= 1e-5
    assert (last[1] - alone[0]).abs().max().item() <= 1e-5
    # A different seed gives different audio: the noise really comes from the item's generator.
    reseeded, _ = run_batch(ours, [item], [6])
    assert (reseeded[0] - alone[0]).abs().max().item() > 1e-4


@pytest.mark.slow
def test_source_ignores_f0_past_the_item_end(ours):
    # forward zeroes F0 on padded frames; the source must not depend on that to end each item as alone.
    gen = torch.Generator().manual_seed(12)
    f0 = 100 + 80 * torch.rand(2, 15, generator=gen)
    lengths = torch.tensor([15, 6])
    with torch.inference_mode():
        batch = ours.m_source(f0, lengths, [torch.Generator().manual_seed(s) for s in (1, 2)])
        alone = ours.m_source(f0[1:, :6], lengths[1:], [torch.Generator().manual_seed(2)])
    assert batch.shape == (2, 1, 15 * HOP)
    assert (batch[1, :, : 6 * HOP] - alone[0]).abs().max().item() <= 1e-6


@pytest.mark.slow
def test_vocode_matches_forward(ours):
    gen = torch.Generator().manual_seed(9)
    mels = [torch.randn(80, 11, generator=gen), torch.randn(80, 4, generator=gen)]
    outputs = ours.vocode(mels, [3, 4])
    audio, _ = run_batch(ours, mels, [3, 4])
    assert [o.shape[0] for o in outputs] == [HOP * 11, HOP * 4]
    assert torch.equal(outputs[0], audio[0])
    assert torch.equal(outputs[1], audio[1, : HOP * 4])


def _old_style_state(reference) -> dict[str, torch.Tensor]:
    """``generator.``-prefixed weight_g/weight_v keys whose v differs from upstream's but folds to the same weight."""
    gen = torch.Generator().manual_seed(10)
    state = {}
    for key, value in reference.state_dict().items():
        if key.endswith(".parametrizations.weight.original0"):
            continue
        if key.endswith(".parametrizations.weight.original1"):
            prefix = key[: -len(".parametrizations.weight.original1")]
            weight = reference.get_submodule(prefix).weight.detach()  # the parametrised g * v / ||v||
            row_norm = weight.flatten(1).norm(dim=1).view(-1, *[1] * (weight.dim() - 1))
            scale = torch.rand(row_norm.shape, generator=gen) + 0.5
            state[f"generator.{prefix}.weight_g"] = row_norm
            state[f"generator.{prefix}.weight_v"] = weight * scale
        else:
            state[f"generator.{key}"] = value
    return state


@pytest.mark.slow
def test_loads_both_weight_norm_styles_and_prefix(reference, ours):
    old = HiFT(**CONFIG, f0_predictor=dict(F0_CONFIG)).eval()
    load_hift_state(old, _old_style_state(reference))
    # Every folded weight equals what upstream's parametrisation computes.
    for model in (ours, old):
        for name, param in model.state_dict().items():
            prefix, _, leaf = name.rpartition(".")
            expected = getattr(reference.get_submodule(prefix), leaf)
            torch.testing.assert_close(param, expected.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert any(".weight_g" in k for k in _old_style_state(reference))
    assert any(".parametrizations.weight.original0" in k for k in reference.state_dict())

    gen = torch.Generator().manual_seed(11)
    mels = [torch.randn(80, 6, generator=gen)]
    a, _ = run_batch(ours, mels, [1])
    b, _ = run_batch(old, mels, [1])
    assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_mismatched_state_is_named(reference):
    model = HiFT(**CONFIG, f0_predictor=dict(F0_CONFIG))
    state = dict(reference.state_dict())
    state["conv_pre.bogus"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"conv_pre\.bogus"):
        load_hift_state(model, state)
    state = dict(reference.state_dict())
    del state["conv_post.bias"]
    with pytest.raises(ValueError, match=r"conv_post\.bias"):
        load_hift_state(model, state)
    state = dict(reference.state_dict())
    state["m_source.l_linear.bias"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"m_source\.l_linear\.bias"):
        load_hift_state(model, state)


def test_only_the_22k_and_24k_sources_are_supported():
    # 22050 Hz is CosyVoice-300M's vocoder (tests/test_cosyvoice_v1_flow.py); any other rate is refused.
    with pytest.raises(ValueError, match="24000"):
        HiFT(**{**CONFIG, "sampling_rate": 16000})
