"""What every family's flow shares: its input, the Euler solver of conditional flow matching
(upstream's ``CausalConditionalCFM``, with classifier-free guidance), and the estimator's
timestep and transformer blocks (used by the v1 and v2 U-Nets; v3's DiT has its own).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def length_mask(lengths: Tensor, size: int) -> Tensor:
    """(B,) lengths -> (B, size) bool, True on real frames."""
    return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]


@dataclass
class FlowInput:
    """One utterance for the flow: speech tokens and the voice to speak them in."""

    tokens: Tensor  # (T,) speech token ids
    embedding: Tensor  # (192,) speaker embedding (campplus x-vector)
    prompt_tokens: Tensor | None = None  # (P,) tokens of the prompt audio (zero-shot), else None
    prompt_mel: Tensor | None = None  # (F, 80) mel of the prompt audio, normally F == 2 * P


def timestep_features(t: Tensor, dim: int, scale: float = 1000.0) -> Tensor:
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    angle = scale * t[:, None] * freq[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class TimestepMLP(nn.Module):
    def __init__(self, in_channels: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class Attention(nn.Module):
    """Bias-free multi-head self-attention with an output projection (diffusers' layout)."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


class GeluProj(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))


class TransformerFF(nn.Module):
    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.ModuleList([GeluProj(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](self.net[0](x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = TransformerFF(dim)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.attn1(self.norm1(x), bias)
        return x + self.ff(self.norm3(x))


class CausalConditionalCFM(nn.Module):
    """Euler solver for the conditional flow, with classifier-free guidance."""

    def __init__(
        self, estimator: nn.Module, t_scheduler: str = "cosine", inference_cfg_rate: float = 0.7
    ):
        super().__init__()
        if t_scheduler not in ("cosine", "linear"):
            raise ValueError(f"t_scheduler {t_scheduler!r} is not supported")
        self.estimator = estimator
        # Called in place of the estimator when set (same arguments): an ONNX Runtime session, see flow/onnx.py.
        self.runner: Callable[..., Tensor] | None = None
        self.t_scheduler = t_scheduler
        self.inference_cfg_rate = inference_cfg_rate

    def forward(self, z: Tensor, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, n_timesteps: int) -> Tensor:
        # The solver's state and time stay fp32 whatever the estimator's dtype: ten Euler steps
        # accumulate, and the state is small (80 x frames).
        t_span = torch.linspace(0, 1, n_timesteps + 1, device=mu.device, dtype=torch.float32)
        if self.t_scheduler == "cosine":
            t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        b, dtype = mu.size(0), mu.dtype
        # The guided and the unconditioned pass run as one batch of 2B.
        mask_in = torch.cat([mask, mask])
        mu_in = torch.cat([mu, torch.zeros_like(mu)])
        spks_in = torch.cat([spks, torch.zeros_like(spks)])
        cond_in = torch.cat([cond, torch.zeros_like(cond)])
        x, t, dt = z.float(), t_span[0], t_span[1] - t_span[0]
        estimator = self.runner or self.estimator
        for step in range(1, n_timesteps + 1):
            x_in = torch.cat([x, x]).to(dtype)
            velocity = estimator(x_in, mask_in, mu_in, t.expand(2 * b), spks_in, cond_in).float()
            guided, free = velocity[:b], velocity[b:]
            x = x + dt * ((1.0 + self.inference_cfg_rate) * guided - self.inference_cfg_rate * free)
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t
        return x.float()
