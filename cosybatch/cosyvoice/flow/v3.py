"""Fun-CosyVoice3's flow-matching model (speech tokens -> mel), batch-native.

Architecture after upstream's ``CausalMaskedDiffWithDiT`` (FunAudioLLM/CosyVoice, Apache-2.0):
token embedding (80 wide), a look-ahead conv (``PreLookaheadLayer``), each token repeated
``token_mel_ratio`` times, then a conditional flow-matching decoder whose estimator is a DiT
(adaLN-zero transformer blocks, rotary positions on the first head, a causal conv position
embedding) solved with Euler steps on a cosine schedule and classifier-free guidance.

Attribute names follow upstream's so an official ``flow.pt`` loads with strict key checks
(including the rotary ``inv_freq`` buffer it stores). One call takes a padded batch of different
lengths and every item's mel equals what the item gives alone, up to float rounding:

- padded tokens embed to zero, so the look-ahead conv sees what zero padding gives a lone item;
- the DiT's convs are causal and every other layer is pointwise or attention over real keys only,
  so padding never reaches a real frame;
- the starting noise is upstream's fixed table (seed 0, ``randn(1, 80, 15000)``), a prefix per item,
  so an item's noise does not depend on its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..weights import load_state, load_strict
from ..yamlconf import Call, expect
from .cfm import CausalConditionalCFM, FlowInput, length_mask

__all__ = [
    "CausalMaskedDiffWithDiT",
    "DiT",
    "PreLookaheadLayer",
    "build_flow_v3",
    "fixed_noise",
    "load_flow_v3",
]

# Upstream's decoder noise (CausalConditionalCFM.__init__): seed 0, then randn(1, 80, 50 * 300).
NOISE_SEED = 0
NOISE_CHANNELS = 80
NOISE_FRAMES = 50 * 300


def fixed_noise(frames: int) -> Tensor:
    """Upstream's starting noise (1, 80, frames) on the CPU; past its 300 s, further blocks seeded 1, 2, ...

    Upstream cannot go past the table (its slice would come out short); the extra blocks only keep
    long items working.
    """
    blocks = max(1, math.ceil(frames / NOISE_FRAMES))
    parts = []
    for k in range(blocks):
        gen = torch.Generator().manual_seed(NOISE_SEED + k)
        parts.append(torch.randn([1, NOISE_CHANNELS, NOISE_FRAMES], generator=gen))
    return torch.cat(parts, dim=2)[:, :, :frames]


# --------------------------------------------------------------------------------------------
# Token side


class PreLookaheadLayer(nn.Module):
    """Residual: a conv reading ``pre_lookahead_len`` frames ahead, leaky ReLU, a causal conv of width 3."""

    def __init__(self, in_channels: int = 80, channels: int = 1024, pre_lookahead_len: int = 3):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(in_channels, channels, pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, 3)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, C) with zeros past each item's length -> (B, T, C)."""
        h = F.pad(x.transpose(1, 2), (0, self.pre_lookahead_len))
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


# --------------------------------------------------------------------------------------------
# DiT estimator


class TimestepEmbedding(nn.Module):
    """Sinusoidal features of t (scaled by 1000) through Linear, SiLU, Linear."""

    def __init__(self, dim: int, freq_embed_dim: int = 256):
        super().__init__()
        self.freq_embed_dim = freq_embed_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_embed_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        """(B,) fp32 times -> (B, dim) in the weights' dtype; the features are computed in fp32."""
        half = self.freq_embed_dim // 2
        freq = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        angle = 1000 * t.float()[:, None] * freq[None, :]
        features = torch.cat([angle.sin(), angle.cos()], dim=-1)
        return self.time_mlp(features.to(self.time_mlp[0].weight.dtype))


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped convs, each padded on the left only and followed by Mish."""

    def __init__(self, dim: int, kernel_size: int = 31, groups: int = 16):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (B, T, D)."""
        h = x.transpose(1, 2)
        h = self.conv1(F.pad(h, (self.kernel_size - 1, 0)))
        h = self.conv2(F.pad(h, (self.kernel_size - 1, 0)))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    """Projects [x, cond, mu, speaker] per frame to the model width, plus a causal conv position embedding."""

    def __init__(self, mel_dim: int, text_dim: int, out_dim: int, spk_dim: int | None = None):
        super().__init__()
        self.spk_dim = spk_dim or 0
        self.proj = nn.Linear(mel_dim * 2 + text_dim + self.spk_dim, out_dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(out_dim)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor | None) -> Tensor:
        parts = [x, cond, mu]
        if self.spk_dim > 0 and spks is not None:
            parts.append(spks[:, None, :].expand(-1, x.size(1), -1))
        h = self.proj(torch.cat(parts, dim=-1))
        return self.conv_pos_embed(h) + h


class RotaryEmbedding(nn.Module):
    """Rotary frequencies for ``dim`` channels, interleaved pairs (x-transformers' layout, no xpos).

    ``inv_freq`` is a persistent buffer because upstream's (x-transformers') is: it is in flow.pt.
    The angles are always computed from an fp32 copy, so converting the flow to bf16/fp16 does not
    round the frequencies (positions run into the thousands).
    """

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)
        self._inv_freq32 = inv_freq.clone()  # not a buffer: .to(dtype) leaves it alone
        self._on_device: dict[torch.device, Tensor] = {}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        loaded = state_dict.get(prefix + "inv_freq")
        if isinstance(loaded, Tensor) and loaded.shape == self._inv_freq32.shape:
            self._inv_freq32 = loaded.detach().float().cpu().clone()
            self._on_device.clear()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def freqs(self, length: int, device: torch.device) -> Tensor:
        """(length, dim) fp32 angles, each frequency twice in a row."""
        inv_freq = self._on_device.get(device)
        if inv_freq is None:
            inv_freq = self._on_device[device] = self._inv_freq32.to(device)
        t = torch.arange(length, device=device).float()
        angles = t[:, None] * inv_freq[None, :]
        return torch.stack((angles, angles), dim=-1).flatten(-2)


def apply_rotary(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate the first ``freqs.size(-1)`` channels of x (B, T, C) pairwise; the rest pass through.

    Upstream applies the rotation before splitting heads, so with rotary width = head width only the
    first head is rotated; kept as is, since the official weights were trained that way.
    """
    width = freqs.size(-1)
    head, rest = x[..., :width], x[..., width:]
    pairs = head.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    head = head * freqs.cos() + rotated * freqs.sin()
    return torch.cat((head, rest), dim=-1).to(x.dtype)


class AdaLayerNormZero(nn.Module):
    """LayerNorm modulated by the time embedding; returns the modulated input and four more modulations."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim * 6)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x: Tensor, emb: Tensor) -> tuple[Tensor, ...]:
        emb = self.linear(F.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = torch.chunk(emb, 6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroFinal(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        scale, shift = torch.chunk(self.linear(F.silu(emb)), 2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


class Attention(nn.Module):
    """Multi-head self-attention with biased projections and rotary positions on q and k."""

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        # Index 1 is upstream's dropout (no weights).
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])

    def forward(self, x: Tensor, attn_mask: Tensor, freqs: Tensor, rows: Tensor) -> Tensor:
        """x (B, T, D); attn_mask (B, 1, T or 1, T) bool, True where a query may read a key; rows (B, T, 1)
        bool, True on real frames (padded rows come out zero, as upstream's, so nothing there can grow)."""
        b, t, _ = x.shape
        q = apply_rotary(self.to_q(x), freqs)
        k = apply_rotary(self.to_k(x), freqs)
        v = self.to_v(x)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        out = out.transpose(1, 2).reshape(b, t, -1).to(q.dtype)
        return self.to_out[0](out).masked_fill(~rows, 0.0)


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: float = 4):
        super().__init__()
        inner = int(dim * mult)
        # Upstream's layout: Sequential(Sequential(Linear, GELU(tanh)), Dropout, Linear).
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")), nn.Identity(), nn.Linear(inner, dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: float = 4):
        super().__init__()
        self.attn_norm = AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, dim_head)
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim, ff_mult)

    def forward(self, x: Tensor, t: Tensor, attn_mask: Tensor, freqs: Tensor, rows: Tensor) -> Tensor:
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, t)
        x = x + gate_msa[:, None] * self.attn(norm, attn_mask, freqs, rows)
        norm = self.ff_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp[:, None] * self.ff(norm)


def chunk_mask(size: int, chunk: int, device: torch.device) -> Tensor:
    """(size, size) bool: frame i reads every frame before the end of its own ``chunk``-frame block."""
    pos = torch.arange(size, device=device)
    return pos[None, :] < ((pos // chunk + 1) * chunk)[:, None]


class DiT(nn.Module):
    """The flow's velocity estimator: (x, mask, mu, t, spks, cond) -> velocity, all (B, 80, T) but t (B,)."""

    def __init__(
        self,
        dim: int = 1024,
        depth: int = 22,
        heads: int = 16,
        dim_head: int = 64,
        ff_mult: float = 2,
        mel_dim: int = 80,
        mu_dim: int | None = 80,
        long_skip_connection: bool = False,
        spk_dim: int | None = 80,
        out_channels: int | None = 80,
        static_chunk_size: int = 50,
        num_decoding_left_chunks: int = -1,
    ):
        super().__init__()
        self.time_embed = TimestepEmbedding(dim)
        self.input_embed = InputEmbedding(mel_dim, mu_dim if mu_dim is not None else mel_dim, dim, spk_dim)
        self.rotary_embed = RotaryEmbedding(dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(dim, heads, dim_head, ff_mult) for _ in range(depth))
        self.long_skip_connection = nn.Linear(dim * 2, dim, bias=False) if long_skip_connection else None
        self.norm_out = AdaLayerNormZeroFinal(dim)
        self.proj_out = nn.Linear(dim, mel_dim)
        self.out_channels = out_channels
        self.static_chunk_size = static_chunk_size
        # Kept for the record: upstream's chunk mask ignores it too (its ONNX-friendly subsequent_chunk_mask).
        self.num_decoding_left_chunks = num_decoding_left_chunks
        # Chunked (streaming) attention as upstream's streaming=True; off for offline synthesis.
        self.streaming = False

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        """x, mu, cond: (B, mel, T); mask: (B, 1, T); t: (B,); spks: (B, spk) -> (B, mel, T)."""
        x, mu, cond = x.transpose(1, 2), mu.transpose(1, 2), cond.transpose(1, 2)
        frames = x.size(1)
        temb = self.time_embed(t)
        h = self.input_embed(x, cond, mu, spks)
        freqs = self.rotary_embed.freqs(frames, x.device)
        keys = mask.bool()  # (B, 1, T)
        rows = keys.transpose(1, 2)  # (B, T, 1)
        if self.streaming and self.static_chunk_size > 0:
            attn_mask = keys & chunk_mask(frames, self.static_chunk_size, x.device)[None]
        else:
            # One row per item, broadcast over queries: SDPA never materialises a (B, T, T) mask.
            attn_mask = keys
        # A query row with no key would be NaN; upstream opens such rows fully (they are padding).
        attn_mask = (attn_mask | ~attn_mask.any(dim=-1, keepdim=True))[:, None]
        residual = h
        for block in self.transformer_blocks:
            h = block(h, temb, attn_mask, freqs, rows)
        if self.long_skip_connection is not None:
            h = self.long_skip_connection(torch.cat((h, residual), dim=-1))
        h = self.norm_out(h, temb)
        return self.proj_out(h).transpose(1, 2)


# --------------------------------------------------------------------------------------------
# The whole flow


class CausalMaskedDiffWithDiT(nn.Module):
    def __init__(
        self,
        pre_lookahead_layer: PreLookaheadLayer,
        decoder: CausalConditionalCFM,
        input_size: int = 80,
        output_size: int = 80,
        spk_embed_dim: int = 192,
        vocab_size: int = 6561,
        token_mel_ratio: int = 2,
        n_timesteps: int = 10,
    ):
        super().__init__()
        self.output_size = output_size
        self.vocab_size = vocab_size
        self.token_mel_ratio = token_mel_ratio
        self.n_timesteps = n_timesteps
        self.input_embedding = nn.Embedding(vocab_size, input_size)
        self.spk_embed_affine_layer = nn.Linear(spk_embed_dim, output_size)
        self.pre_lookahead_layer = pre_lookahead_layer
        self.decoder = decoder
        self._noise: Tensor | None = None

    def mel_frames(self, n_tokens: int) -> int:
        """Mel frames this flow makes from ``n_tokens`` speech tokens (a fixed ratio, as v2's)."""
        return self.token_mel_ratio * n_tokens

    def noise(self, frames: int, device: torch.device) -> Tensor:
        """Upstream's fixed starting noise (1, 80, frames), fp32, cached on the CPU."""
        if self._noise is None or self._noise.size(2) < frames:
            self._noise = fixed_noise(max(frames, NOISE_FRAMES))
        return self._noise[:, :, :frames].to(device)

    @torch.inference_mode()
    def inference(self, items: Sequence[FlowInput], streaming: bool = False,
                  seeds: Sequence[int] | None = None) -> list[Tensor]:
        """Mel spectrograms (80, token_mel_ratio * (P + T) - F) of each item, prompt frames removed.

        ``streaming`` runs the estimator's attention in upstream's chunks (its ``streaming=True``);
        offline synthesis (upstream's non-stream mode) uses full attention. ``seeds`` is unused
        (upstream's fixed noise table); every family's flow takes it.
        """
        if not items:
            return []
        device = self.input_embedding.weight.device
        dtype = self.spk_embed_affine_layer.weight.dtype
        empty_tokens = torch.zeros(0, dtype=torch.long)
        tokens, prompt_frames = [], []
        for i, item in enumerate(items):
            prompt = item.prompt_tokens if item.prompt_tokens is not None else empty_tokens
            tokens.append(torch.cat([prompt.reshape(-1).long().cpu(), item.tokens.reshape(-1).long().cpu()]))
            mel = item.prompt_mel
            frames = 0 if mel is None else mel.size(0)
            if mel is not None and (mel.dim() != 2 or mel.size(1) != self.output_size):
                raise ValueError(f"item {i}: prompt_mel must be (frames, {self.output_size}), got {tuple(mel.shape)}")
            if frames > self.token_mel_ratio * len(tokens[-1]):
                raise ValueError(f"item {i}: prompt_mel has {frames} frames, more than its "
                                 f"{self.token_mel_ratio} x {len(tokens[-1])} tokens give")
            prompt_frames.append(frames)
        # Mel frames per item, known on the host (no device sync to trim the outputs).
        mel_counts = [self.token_mel_ratio * len(t) for t in tokens]
        lengths = torch.tensor([len(t) for t in tokens], device=device)
        padded = nn.utils.rnn.pad_sequence(tokens, batch_first=True).to(device)
        token_mask = length_mask(lengths, padded.size(1))

        spks = F.normalize(torch.stack([item.embedding.reshape(-1) for item in items]).to(device, dtype), dim=1)
        spks = self.spk_embed_affine_layer(spks)
        x = self.input_embedding(padded.clamp(0, self.vocab_size - 1)) * token_mask[..., None].to(dtype)
        h = self.pre_lookahead_layer(x)
        mu = h.repeat_interleave(self.token_mel_ratio, dim=1).transpose(1, 2).contiguous()
        mel_lengths = lengths * self.token_mel_ratio
        frames = mu.size(2)
        mask = length_mask(mel_lengths, frames)[:, None, :].to(dtype)
        cond = torch.zeros_like(mu)
        for i, item in enumerate(items):
            if item.prompt_mel is not None and item.prompt_mel.size(0):
                cond[i, :, : item.prompt_mel.size(0)] = item.prompt_mel.to(device, dtype).t()
        z = self.noise(frames, device).expand(len(items), -1, -1)
        estimator = self.decoder.estimator
        previous = getattr(estimator, "streaming", False)
        estimator.streaming = streaming
        try:
            mel = self.decoder(z, mu, mask, spks, cond, self.n_timesteps)
        finally:
            estimator.streaming = previous
        return [mel[i, :, prompt_frames[i] : mel_counts[i]] for i in range(len(items))]


def _params(cfm: Call) -> dict[str, Any]:
    params = cfm.kwargs.get("cfm_params")
    if isinstance(params, Call):  # !new:omegaconf.DictConfig {content: {...}}
        params = params.kwargs.get("content", params.kwargs)
    return dict(params or {})


def build_flow_v3(node: Call) -> CausalMaskedDiffWithDiT:
    """Construct the flow from the ``flow:`` section of cosyvoice3.yaml (parsed, never executed)."""
    flow = expect(node, "CausalMaskedDiffWithDiT", where="flow")
    look = expect(flow.kwargs.get("pre_lookahead_layer"), "PreLookaheadLayer", where="flow.pre_lookahead_layer")
    cfm = expect(flow.kwargs.get("decoder"), "CausalConditionalCFM", where="flow.decoder")
    est = expect(cfm.kwargs.get("estimator"), "DiT", where="flow.decoder.estimator").kwargs
    params = _params(cfm)
    if params.get("solver", "euler") != "euler":
        raise ValueError(f"flow solver {params['solver']!r} is not supported")
    look_kw = look.kwargs
    pre_lookahead = PreLookaheadLayer(
        in_channels=int(look_kw.get("in_channels", 80)),
        channels=int(look_kw.get("channels", 1024)),
        pre_lookahead_len=int(look_kw.get("pre_lookahead_len", flow.kwargs.get("pre_lookahead_len", 3))),
    )

    def optional_int(value: Any) -> int | None:
        return None if value is None else int(value)

    estimator = DiT(
        dim=int(est["dim"]),
        depth=int(est.get("depth", 8)),
        heads=int(est.get("heads", 8)),
        dim_head=int(est.get("dim_head", 64)),
        ff_mult=float(est.get("ff_mult", 4)),
        mel_dim=int(est.get("mel_dim", 80)),
        mu_dim=optional_int(est.get("mu_dim")),
        long_skip_connection=bool(est.get("long_skip_connection", False)),
        spk_dim=optional_int(est.get("spk_dim")),
        out_channels=optional_int(est.get("out_channels")),
        static_chunk_size=int(est.get("static_chunk_size", 50)),
        num_decoding_left_chunks=int(est.get("num_decoding_left_chunks", 2)),
    )
    decoder = CausalConditionalCFM(
        estimator,  # type: ignore[arg-type]  # same call signature as CosyVoice2's U-Net
        t_scheduler=str(params.get("t_scheduler", "cosine")),
        inference_cfg_rate=float(params.get("inference_cfg_rate", 0.7)),
    )
    return CausalMaskedDiffWithDiT(
        pre_lookahead,
        decoder,
        input_size=int(flow.kwargs.get("input_size", 512)),
        output_size=int(flow.kwargs.get("output_size", 80)),
        spk_embed_dim=int(flow.kwargs.get("spk_embed_dim", 192)),
        vocab_size=int(flow.kwargs.get("vocab_size", 4096)),
        token_mel_ratio=int(flow.kwargs.get("token_mel_ratio", 2)),
    )


def load_flow_v3(module: CausalMaskedDiffWithDiT, path: str | Path) -> CausalMaskedDiffWithDiT:
    """Load a v3 ``flow.pt`` into ``module`` with strict key and shape checks.

    Raises :class:`~cosybatch.cosyvoice.weights.ModelDirError` naming missing, unexpected or mis-shaped keys.
    """
    path = Path(path)
    load_strict(module, load_state(path), path)
    return module
