"""A Qwen2 decoder as a speech-token LM body: what CosyVoice2's and CosyVoice3's LMs share.

The Qwen2 blocks are our own small torch implementation (RMSNorm, rotary positions, grouped-query
attention, SwiGLU), so no transformers version can change them. Attribute names follow upstream's
(``llm.model.model.*``) so an official ``llm.pt`` loads with strict key checks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .decoder import SPEECH_TOKENS, Cache, DecoderLM


@dataclass(frozen=True)
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    @classmethod
    def from_dir(cls, folder: str | Path) -> Qwen2Config:
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read the Qwen2 config ({exc})") from None
        if raw.get("model_type", "qwen2") != "qwen2":
            raise ValueError(f"{path}: model_type {raw.get('model_type')!r}; only qwen2 is supported")
        names = [f for f in cls.__dataclass_fields__]
        missing = [n for n in names[:6] if n not in raw]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        return cls(**{n: raw[n] for n in names if n in raw})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def folded_bias(mask: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """A (B or 1, 1, T, keys) bool mask (True: attend) as the additive bias of folded grouped-query
    attention: (B or 1, 1, groups * T, keys) in ``dtype``, 0 where attended and -inf elsewhere,
    query row ``g * T + t`` of a key head's fold being query head ``g`` of that group at position t.
    Built once per forward and shared by every layer."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)
    if groups == 1:
        return bias
    b, _, t, keys = bias.shape
    return bias[:, :, None].expand(b, 1, groups, t, keys).reshape(b, 1, groups * t, keys)


def rotate_half(x: Tensor) -> Tensor:
    half = x.size(-1) // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Qwen2Attention(nn.Module):
    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: Cache, layer: int, mask: Tensor) -> Tensor:
        """x: (B, T, H) new positions; the cache stores them and returns every key the rows see;
        mask: (B or 1, 1, groups * T, keys) additive float bias, from :func:`folded_bias`."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = cache.update(layer, k, v)
        # Grouped-query attention as plain attention: the query heads that share a key head are
        # folded into the query axis, so q, k and v have equal head counts and no K/V repeat or
        # enable_gqa is needed, and the mask is a float bias: a shape the fused CUDA kernels take.
        groups = self.heads // self.kv_heads
        q = q.reshape(b, self.kv_heads, groups * t, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.reshape(b, self.heads, t, self.head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Qwen2MLP(nn.Module):
    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2Layer(nn.Module):
    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.self_attn = Qwen2Attention(c)
        self.mlp = Qwen2MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: Cache, layer: int, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Qwen2Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, positions: Tensor, cache: Cache, mask: Tensor) -> Tensor:
        """x: (B, T, H) embeddings at ``positions`` (B or 1, T), mask (B or 1, 1, T, keys) bool
        (True: attend); returns the final hidden states.

        Rotary angles are computed in fp32 and cast to the compute dtype, as upstream does."""
        freqs = positions[:, :, None].float() * self.inv_freq.float()[None, None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]
        c = self.config
        bias = folded_bias(mask, c.num_attention_heads // c.num_key_value_heads, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, bias)
        return self.norm(x)


class _CausalLM(nn.Module):
    """Holds the Qwen2 model under upstream's attribute path ``llm.model.model``."""

    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.model = Qwen2Model(c)


class _Encoder(nn.Module):
    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.model = _CausalLM(c)


class Qwen2SpeechLM(DecoderLM):
    """A Qwen2 decoder under upstream's attribute path ``llm.model.model`` as the LM body; what
    CosyVoice2's and CosyVoice3's LMs share. Subclasses add their speech embedding and head."""

    def __init__(self, config: Qwen2Config, speech_token_size: int = SPEECH_TOKENS):
        super().__init__()
        self.config = config
        self.speech_token_size = speech_token_size
        self.llm = _Encoder(config)

    @property
    def qwen(self) -> Qwen2Model:
        return self.llm.model.model

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def body(self, x: Tensor, positions: Tensor, cache, mask: Tensor) -> Tensor:
        return self.qwen(x, positions, cache, mask)

    def to_precision(self, dtype: torch.dtype) -> Qwen2SpeechLM:
        """Convert every weight to ``dtype`` once (the rotary frequencies stay fp32)."""
        inv_freq = self.qwen.inv_freq
        self._pool = None  # its CUDA graphs point at the old weights
        self.to(dtype=dtype)
        self.qwen.inv_freq = inv_freq
        return self
