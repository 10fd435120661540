"""The relative-position Conformer layers of the flows' encoders (and of CosyVoice-300M's LM).

After upstream's ESPnet-derived ``ConformerEncoderLayer`` with ``RelPositionMultiHeadedAttention``
(FunAudioLLM/CosyVoice, Apache-2.0), without the conv module; attribute names follow upstream's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def relative_positions(size: int, dim: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """ESPnet-style relative sinusoidal table for distances size-1 ... -(size-1): (1, 2*size-1, dim).

    Computed per distance exactly as upstream's cached table, so values do not depend on ``size``.
    """
    position = torch.arange(size, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim))
    ahead = torch.zeros(size, dim)
    behind = torch.zeros(size, dim)
    ahead[:, 0::2] = torch.sin(position * freq)
    ahead[:, 1::2] = torch.cos(position * freq)
    behind[:, 0::2] = torch.sin(-1 * position * freq)
    behind[:, 1::2] = torch.cos(-1 * position * freq)
    table = torch.cat([ahead.flip(0), behind[1:]], dim=0)
    return table[None].to(device=device, dtype=dtype)


class LinearEmbed(nn.Module):
    """Linear + LayerNorm, scaled by sqrt(dim) (upstream's LinearNoSubsampling + rel. pos. encoding)."""

    def __init__(self, idim: int, odim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.scale = math.sqrt(odim)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        x = self.out(x) * self.scale
        return x, relative_positions(x.size(1), x.size(2), x.device, x.dtype)


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with Transformer-XL relative positions (biases u and v)."""

    def __init__(self, heads: int, dim: int, key_bias: bool = True):
        super().__init__()
        self.h, self.d_k = heads, dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim, bias=key_bias)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d_k))

    def forward(self, x: Tensor, key_mask: Tensor, pos: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d_k)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos).view(1, -1, self.h, self.d_k).transpose(1, 2)
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))
        # Column j of row i holds distance i - j: table index (t - 1) - i + j.
        index = (t - 1) - torch.arange(t, device=x.device)[:, None] + torch.arange(t, device=x.device)[None, :]
        position = position.gather(-1, index.expand(b, self.h, t, t))
        scores = (content + position) / math.sqrt(self.d_k)
        hidden = key_mask[:, None, None, :].logical_not()
        attn = torch.softmax(scores.masked_fill(hidden, -float("inf")), dim=-1).masked_fill(hidden, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.h * self.d_k)
        return self.linear_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm block: relative-position self-attention, then a feed-forward (no conv module)."""

    def __init__(self, dim: int, heads: int, hidden: int, key_bias: bool = True):
        super().__init__()
        self.self_attn = RelPositionAttention(heads, dim, key_bias)
        self.feed_forward = FeedForward(dim, hidden)
        self.norm_ff = nn.LayerNorm(dim, eps=1e-12)
        self.norm_mha = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: Tensor, key_mask: Tensor, pos: Tensor) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), key_mask, pos)
        return x + self.feed_forward(self.norm_ff(x))
