"""CosyVoice2's speech-token language model, decoding whole batches at once.

Architecture after upstream's ``Qwen2LM`` (FunAudioLLM/CosyVoice, Apache-2.0): a Qwen2 decoder
(Qwen2.5-0.5B in CosyVoice2-0.5B) reads ``[sos, prompt text + text, task id, prompt speech tokens]``
as embeddings and predicts speech tokens (6561 ids, then 3 control ids: the first stops) through
its own head, ``llm_decoder``. The Qwen2 blocks are our own small torch implementation (RMSNorm,
rotary positions, grouped-query attention, SwiGLU), so no transformers version can change them.

Upstream decodes one utterance at a time and samples in Python from the global random generator.
Here B utterances decode together: prompts are left-padded, a 2-D padding mask and per-row
position ids keep every row equal to its single-row run, a pre-allocated KV cache grows by one
position per step, each row stops on its own (stop token, or 20x its text tokens; the stop token
is refused before 2x), and repetition-aware sampling (top-p 0.8, top-k 25, window 10, tau 0.1)
runs for the whole batch at once on uniforms drawn from each row's own generator, seeded per
item, so a row's tokens do not depend on its batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

SPEECH_TOKENS = 6561
SOS, TASK_ID = 0, 1  # rows of llm_embedding


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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, mask: Tensor) -> Tensor:
        """x: (B, T, H) new positions; cache holds earlier ones; mask: (B, 1, T, total) bool."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = cache.append(layer, k, v)
        # Under autocast the cache holds the low-precision dtype; keep q in it too.
        out = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask,
                                             enable_gqa=self.heads != self.kv_heads)
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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, mask: Tensor) -> Tensor:
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

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache, mask: Tensor) -> Tensor:
        """x: (B, T, H) embeddings at ``positions`` (B, T); returns the final hidden states."""
        freqs = positions[:, :, None].float() * self.inv_freq[None, None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, mask)
        cache.advance(x.size(1))
        return self.norm(x)


class KVCache:
    """Pre-allocated keys and values for every layer: (B, kv_heads, capacity, head_dim)."""

    def __init__(self, c: Qwen2Config, batch: int, capacity: int, device: torch.device, dtype: torch.dtype):
        shape = (batch, c.num_key_value_heads, capacity, c.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)]
        self.length = 0

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = self.length + k.size(2)
        if end > self.k[layer].size(2):
            raise RuntimeError(f"KV cache full ({self.k[layer].size(2)} positions)")
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, steps: int) -> None:
        self.length += steps

    def keep(self, rows: Tensor) -> None:
        """Drop finished rows (indices of the rows to keep), one layer at a time so that at most
        one layer is held twice."""
        for cache in (self.k, self.v):
            for i in range(len(cache)):
                cache[i] = cache[i].index_select(0, rows)


class _CausalLM(nn.Module):
    """Holds the Qwen2 model under upstream's attribute path ``llm.model.model``."""

    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.model = Qwen2Model(c)


class _Encoder(nn.Module):
    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.model = _CausalLM(c)


@dataclass
class Sampling:
    """Repetition-aware sampling (upstream's ras_sampling defaults); ``greedy`` takes the argmax."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    greedy: bool = False


@dataclass
class LMRequest:
    """One utterance to decode: its text tokens, an optional zero-shot prompt, its random seed."""

    text: Sequence[int]
    prompt_text: Sequence[int] = ()
    prompt_speech: Sequence[int] = ()
    seed: int = 0
    min_tokens: int | None = None  # default: min_ratio x len(text)
    max_tokens: int | None = None  # default: max_ratio x len(text)
    tokens: list[int] = field(default_factory=list)  # filled by generate()


class SpeechLM(nn.Module):
    """Upstream's Qwen2LM parameters (``llm.model.model.*``, ``llm_embedding``, ``llm_decoder``,
    ``speech_embedding``) and batched generation."""

    def __init__(self, config: Qwen2Config, speech_token_size: int = SPEECH_TOKENS):
        super().__init__()
        self.config = config
        self.speech_token_size = speech_token_size
        self.llm = _Encoder(config)
        h = config.hidden_size
        self.llm_embedding = nn.Embedding(2, h)
        self.llm_decoder = nn.Linear(h, speech_token_size + 3)
        self.speech_embedding = nn.Embedding(speech_token_size + 3, h)

    @property
    def qwen(self) -> Qwen2Model:
        return self.llm.model.model

    def prompt_embeddings(self, req: LMRequest, device: torch.device) -> Tensor:
        text = torch.tensor([*req.prompt_text, *req.text], dtype=torch.long, device=device)
        speech = torch.tensor(list(req.prompt_speech), dtype=torch.long, device=device)
        w = self.llm_embedding.weight
        return torch.cat(
            [w[SOS][None], self.qwen.embed_tokens(text), w[TASK_ID][None], self.speech_embedding(speech)], dim=0
        )

    def forward_full(self, embeds: Tensor) -> Tensor:
        """Log-probabilities over speech ids at every position of one unpadded sequence (no cache).

        The reference the cached batched decoder is tested against."""
        c = self.config
        t = embeds.size(0)
        cache = KVCache(c, 1, t, embeds.device, embeds.dtype)
        mask = torch.ones(t, t, dtype=torch.bool, device=embeds.device).tril()[None, None]
        positions = torch.arange(t, device=embeds.device)[None]
        hidden = self.qwen(embeds[None], positions, cache, mask)
        return self.llm_decoder(hidden[0]).log_softmax(-1)

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[LMRequest],
        sampling: Sampling | None = None,
        min_ratio: float = 2.0,
        max_ratio: float = 20.0,
    ) -> list[list[int]]:
        """Speech tokens for every request (stop token excluded); also stored in ``request.tokens``."""
        sampling = sampling or Sampling()
        device = self.llm_decoder.weight.device
        dtype = self.llm_decoder.weight.dtype
        n = len(requests)
        if n == 0:
            return []
        limits = [r.max_tokens if r.max_tokens is not None else int(len(r.text) * max_ratio) for r in requests]
        if min(limits) <= 0:  # nothing to generate for these: decode the others only
            live = [i for i, limit in enumerate(limits) if limit > 0]
            decoded = self.generate([requests[i] for i in live], sampling, min_ratio, max_ratio)
            out = [[] for _ in requests]
            for i, tokens in zip(live, decoded, strict=True):
                out[i] = tokens
            for req, tokens in zip(requests, out, strict=True):
                req.tokens = tokens
            return out
        cache_dtype = dtype
        if device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            cache_dtype = torch.get_autocast_dtype("cuda")
        prompts = [self.prompt_embeddings(r, device) for r in requests]
        lengths = torch.tensor([p.size(0) for p in prompts], device=device)
        width = int(lengths.max())
        lo = [r.min_tokens if r.min_tokens is not None else int(len(r.text) * min_ratio) for r in requests]
        hi = limits
        steps = max(hi)
        # Left padding: every row's last prompt position sits at column width - 1.
        x = torch.zeros(n, width, self.config.hidden_size, device=device, dtype=dtype)
        valid = torch.zeros(n, width + steps, dtype=torch.bool, device=device)
        for i, p in enumerate(prompts):
            x[i, width - p.size(0) :] = p
            valid[i, width - p.size(0) : width] = True
        positions = (valid[:, :width].long().cumsum(-1) - 1).clamp(min=0)
        cache = KVCache(self.config, n, width + steps, device, cache_dtype)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        mask = causal[None, None] & valid[:, None, None, :width]
        # A padded query row would attend to nothing; let it see itself so softmax stays finite.
        mask = mask | torch.eye(width, dtype=torch.bool, device=device)[None, None]
        hidden = self.qwen(x, positions, cache, mask)[:, -1]

        rows = torch.arange(n, device=device)  # original index of each live row
        rngs = [np.random.default_rng([int(r.seed) & 0xFFFFFFFFFFFFFFFF, 0x5EED]) for r in requests]
        out: list[list[int]] = [[] for _ in range(n)]
        history = torch.full((n, sampling.win_size), -1, dtype=torch.long, device=device)
        next_pos = lengths.clone()
        lo_t = torch.tensor(lo, device=device)
        hi_t = torch.tensor(hi, device=device)
        for step in range(steps):
            logp = self.llm_decoder(hidden).float().log_softmax(-1)
            # Ids past the stop token are never emitted (upstream skips them and repeats the step).
            logp[:, self.speech_token_size + 1 :] = -math.inf
            too_early = step < lo_t[rows]
            logp[:, self.speech_token_size] = torch.where(
                too_early, torch.full_like(too_early, -math.inf, dtype=logp.dtype), logp[:, self.speech_token_size]
            )
            uniforms = torch.from_numpy(np.stack([rngs[int(r)].random(2) for r in rows.tolist()])).to(device)
            ids = sample(logp, history, uniforms, sampling)
            stop = (ids == self.speech_token_size) | (step + 1 >= hi_t[rows])
            for row, token in zip(rows.tolist(), ids.tolist(), strict=True):
                if token != self.speech_token_size:
                    out[row].append(token)
            history = torch.cat([history[:, 1:], ids[:, None]], dim=1)
            keep = (~stop).nonzero().flatten()
            if keep.numel() == 0:
                break
            if keep.numel() < rows.numel():
                rows, ids, history, next_pos = rows[keep], ids[keep], history[keep], next_pos[keep]
                cache.keep(keep)
                valid = valid[keep]
            column = width + step
            valid[:, column] = True
            mask = valid[:, None, None, : column + 1]
            embeds = self.speech_embedding(ids)[:, None]
            hidden = self.qwen(embeds, next_pos[:, None], cache, mask)[:, -1]
            next_pos = next_pos + 1
        for req, tokens in zip(requests, out, strict=True):
            req.tokens = tokens
        return out


def sample(logp: Tensor, history: Tensor, uniforms: Tensor, s: Sampling) -> Tensor:
    """Repetition-aware sampling for a batch: (B, V) log-probs, (B, W) recent tokens, (B, 2) uniforms.

    Per row: nucleus sampling (the most likely ids while their cumulative probability is below
    top_p, at most top_k of them); if the pick already occurs ``win_size * tau_r`` times or more in
    the last ``win_size`` tokens, sample from the whole distribution instead (upstream's RAS).
    """
    if s.greedy:
        return logp.argmax(-1)
    probs = logp.softmax(-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p
    rank = torch.arange(probs.size(-1), device=probs.device)[None]
    kept = torch.where((before < s.top_p) & (rank < s.top_k), sorted_p, torch.zeros_like(sorted_p))
    nucleus = order.gather(-1, pick(kept, uniforms[:, 0])[:, None])[:, 0]
    repeats = (history == nucleus[:, None]).sum(-1)
    fallback = pick(probs, uniforms[:, 1])
    return torch.where(repeats >= s.win_size * s.tau_r, fallback, nucleus)


def pick(weights: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw per row from unnormalised non-negative weights, with uniforms u in [0, 1)."""
    cdf = weights.double().cumsum(-1)
    target = u.double()[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    return index.clamp(max=weights.size(-1) - 1)


def load_llm(model_dir: str | Path, device: torch.device | str = "cpu") -> SpeechLM:
    """Build the LM from ``CosyVoice-BlankEN/config.json`` and load ``llm.pt`` strictly.

    The Qwen2 text head (``llm.model.lm_head.weight``) is unused for speech and is not loaded.
    """
    from .model import ModelDirError, load_state, load_strict

    model_dir = Path(model_dir)
    try:
        config = Qwen2Config.from_dir(model_dir / "CosyVoice-BlankEN")
    except ValueError as exc:
        raise ModelDirError(str(exc)) from None
    lm = SpeechLM(config)
    path = model_dir / "llm.pt"
    state = load_state(path)
    state.pop("llm.model.lm_head.weight", None)
    load_strict(lm, state, path)
    return lm.to(device).eval()
