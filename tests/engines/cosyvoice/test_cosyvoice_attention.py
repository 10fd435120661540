"""The Qwen2 LMs' attention call is one the fused CUDA kernels accept (issue 25).

torch's flash and memory-efficient SDPA kernels refuse ``enable_gqa`` (the efficient one) or any
mask (flash); with either, a CUDA decode step falls to the math kernel, which repeats K and V per
query group. Ours folds each group of query heads into the query axis instead. On CPU we can check
the call's form (what the kernels' checks in ``sdp_utils.cpp`` look at) and that the fold computes
exactly grouped-query attention; the GPU benchmark runs the step under ``sdpa_kernel`` to prove it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cosybatch.cosyvoice.lm import qwen2
from cosybatch.cosyvoice.lm.slots import LMRequest, Sampling
from cosybatch.cosyvoice.lm.v2 import load_llm


@pytest.mark.parametrize("t", [1, 5])
def test_folded_attention_is_grouped_query_attention(t):
    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, keys, d = 3, 6, 2, 9, 8
    q = torch.randn(b, heads, t, d, generator=gen)
    k = torch.randn(b, kv_heads, keys, d, generator=gen)
    v = torch.randn(b, kv_heads, keys, d, generator=gen)
    mask = torch.rand(b, 1, t, keys, generator=gen) < 0.7
    mask[..., 0] = True  # every query sees a key
    groups = heads // kv_heads
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                               attn_mask=mask)
    bias = qwen2.folded_bias(mask, groups, q.dtype)
    assert bias.shape == (b, 1, groups * t, keys) and bias.dtype == q.dtype
    folded = F.scaled_dot_product_attention(q.reshape(b, kv_heads, groups * t, d), k, v, attn_mask=bias)
    torch.testing.assert_close(folded.reshape(b, heads, t, d), reference, rtol=1e-5, atol=1e-6)


def _check_fused_form(call: dict) -> None:
    """What the flash / memory-efficient kernels' checks need of a call (sdp_utils.cpp)."""
    q, k, v, mask = call["q"], call["k"], call["v"], call["mask"]
    assert not call["enable_gqa"], "enable_gqa: the efficient kernel refuses it, the math kernel repeats K/V"
    assert q.dim() == k.dim() == v.dim() == 4
    assert q.size(0) == k.size(0) == v.size(0), "batch sizes differ"
    assert q.size(1) == k.size(1) == v.size(1), "head counts differ (only enable_gqa allows that)"
    assert k.size(2) == v.size(2) and q.size(3) == k.size(3) == v.size(3)
    assert q.size(3) % 8 == 0, "head_dim must be a multiple of 8"
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    for x in (q, k, v):
        assert x.stride(-1) == 1, "last dimension must be contiguous"
    if mask is not None:
        assert mask.dtype == q.dtype, "an additive float bias in the query dtype, not a bool mask"
        assert mask.dim() == 4 and mask.stride(-1) == 1
        torch.broadcast_shapes(mask.shape, (q.size(0), q.size(1), q.size(2), k.size(2)))


def test_decode_and_prefill_attention_take_a_fused_kernel_form(cosyvoice_dir, monkeypatch):
    calls: list[dict] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, enable_gqa=False, **kwargs):
        calls.append({"q": q, "k": k, "v": v, "mask": attn_mask, "enable_gqa": enable_gqa})
        return real(q, k, v, attn_mask, *args, enable_gqa=enable_gqa, **kwargs)

    lm = load_llm(cosyvoice_dir)
    assert lm.config.num_attention_heads > lm.config.num_key_value_heads  # the fold is exercised
    monkeypatch.setattr(qwen2.F, "scaled_dot_product_attention", spy)
    reqs = [LMRequest(text=[5, 9, 2], seed=1), LMRequest(text=[7, 1], prompt_speech=[3, 4, 5], seed=2)]
    tokens, _ = lm.decode(reqs, Sampling(greedy=True), slots=2, cuda_graphs=False)
    assert all(tokens)
    shapes = {c["q"].size(2) for c in calls}
    groups = lm.config.num_attention_heads // lm.config.num_key_value_heads
    assert groups in shapes and any(s > groups for s in shapes)  # decode steps (T=1) and a prefill
    for call in calls:
        _check_fused_form(call)
