"""CosyVoice-300M's speech-token language model, decoded in the shared slot pool.

Architecture after upstream's v1 ``TransformerLM`` (FunAudioLLM/CosyVoice, Apache-2.0): text ids
-> embedding -> a causal Conformer text encoder (linear input layer, ESPnet relative positions, no
conv module) -> an affine layer; then a Transformer LM (linear + LayerNorm + ReLU input layer,
ESPnet relative positions) reads ``[sos, speaker, encoded text, task id, prompt speech tokens]``
and predicts speech tokens (4096 ids at 50 Hz, then one stop id) through ``llm_decoder``. The
speaker slot is the normalised x-vector through ``spk_embed_affine_layer``; a request without an
embedding has no speaker slot at all (upstream's instruct mode drops it, and an empty embedding
yields an empty slot, not a zero vector). Parameter names are upstream's, so ``llm.pt`` loads with
strict key checks.

Decoding goes through :class:`~.llm.SlotPool` like every other :class:`~.llm.DecoderLM`. The one
thing v1 adds to a decode step is the relative-position term of attention: a row's query at
position ``pos`` scores key ``j`` with ``(q + v_bias) . P[pos - j]``, ``P`` the sinusoidal
distance table through the layer's ``linear_pos``. ``P`` is projected once per layer (up to the
pool's capacity) and each step multiplies the queries with the whole window of it and gathers
every row's distances, so shapes stay fixed and nothing is read back to the host. Upstream's
cached decode computes the same numbers through its ``rel_shift`` trick (it slices the table at the
cache's offset); both equal the full-sequence forward.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..flow import conformer
from ..weights import ModelDirError, load_state, load_strict
from ..yamlconf import Call, expect, load_yaml
from .decoder import Cache, DecoderLM
from .slots import CHECK_EVERY, LMRequest, Sampling, SlotPool

__all__ = ["SPEECH_TOKENS_V1", "YAML_NAME", "TransformerSpeechLM", "build_llm_v1", "load_llm_v1"]

SPEECH_TOKENS_V1 = 4096
YAML_NAME = "cosyvoice.yaml"
SOS, TASK_ID = 0, 1  # rows of llm_embedding
_ACTIVATIONS = {"relu": nn.ReLU, "swish": nn.SiLU, "gelu": nn.GELU, "tanh": nn.Tanh}


def distance_table(size: int, dim: int) -> Tensor:
    """(size, dim) sinusoids for distances 0..size-1 (sin on even, cos on odd features), computed
    in fp32 per distance as upstream's ESPnet table, so a value does not depend on ``size``."""
    distance = torch.arange(size, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim))
    table = torch.zeros(size, dim)
    table[:, 0::2] = torch.sin(distance * freq)
    table[:, 1::2] = torch.cos(distance * freq)
    return table


class RelPositionAttention(conformer.RelPositionAttention):
    """Multi-head self-attention with Transformer-XL relative positions (ESPnet's ``rel_selfattn``).

    ``forward`` takes each query's absolute position and a projected distance table ``(heads, N,
    d_k)`` (N at least the number of keys); keys sit at positions 0..K-1. Distances below zero
    only occur where the mask hides the key, so they are clamped to 0 rather than tabulated."""

    def __init__(self, heads: int, dim: int, key_bias: bool = True):
        if dim % heads:
            raise ValueError(f"output_size {dim} is not a multiple of attention_heads {heads}")
        super().__init__(heads, dim, key_bias)  # the flow encoder's parameters, under the same names

    def project(self, table: Tensor) -> Tensor:
        """(N, dim) distance sinusoids -> (heads, N, d_k) through ``linear_pos``."""
        return self.linear_pos(table).view(table.size(0), self.h, self.d_k).transpose(0, 1)

    def forward(self, x: Tensor, positions: Tensor, table: Tensor, mask: Tensor, cache=None, layer: int = 0) -> Tensor:
        """x: (B, T, dim) at ``positions`` (B or 1, T); mask: bool, broadcastable to (B, 1, T, K)."""
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d_k)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        keys = k.size(2)
        # Score of every query against every tabulated distance, then each key's own distance.
        by_distance = torch.matmul((q + self.pos_bias_v).transpose(1, 2), table[:, :keys].transpose(-2, -1))
        distance = positions[:, :, None] - torch.arange(keys, device=x.device)[None, None, :]
        distance = distance.clamp(0, keys - 1)[:, None].expand(b, self.h, t, keys)
        position = by_distance.gather(-1, distance)
        bias = (position / math.sqrt(self.d_k)).masked_fill(~mask, -math.inf)
        out = F.scaled_dot_product_attention((q + self.pos_bias_u).transpose(1, 2), k, v, attn_mask=bias)
        return self.linear_out(out.transpose(1, 2).reshape(b, t, self.h * self.d_k))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, activation: str):
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)
        self.activation = _ACTIVATIONS[activation]()

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.activation(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Upstream's ``ConformerEncoderLayer`` without macaron and conv modules: pre-norm attention,
    then pre-norm feed-forward."""

    def __init__(self, dim: int, heads: int, hidden: int, activation: str, key_bias: bool):
        super().__init__()
        self.self_attn = RelPositionAttention(heads, dim, key_bias)
        self.feed_forward = FeedForward(dim, hidden, activation)
        self.norm_ff = nn.LayerNorm(dim, eps=1e-12)
        self.norm_mha = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: Tensor, positions: Tensor, table: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), positions, table, mask)
        return x + self.feed_forward(self.norm_ff(x))


class TransformerLayer(nn.Module):
    """Upstream's pre-norm ``TransformerEncoderLayer`` (norm1, attention, norm2, feed-forward)."""

    def __init__(self, dim: int, heads: int, hidden: int, activation: str, key_bias: bool):
        super().__init__()
        self.self_attn = RelPositionAttention(heads, dim, key_bias)
        self.feed_forward = FeedForward(dim, hidden, activation)
        self.norm1 = nn.LayerNorm(dim, eps=1e-12)
        self.norm2 = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: Tensor, positions: Tensor, table: Tensor, mask: Tensor, cache, layer: int) -> Tensor:
        x = x + self.self_attn(self.norm1(x), positions, table, mask, cache, layer)
        return x + self.feed_forward(self.norm2(x))


class InputLayer(nn.Module):
    """Upstream's ``linear`` (Linear, LayerNorm) or ``linear_legacy`` (the same, then ReLU) input
    layer; the ESPnet positional encoding then scales by sqrt(dim). Index 2 of ``out`` is the
    (parameterless) dropout, kept so the parameter names match."""

    def __init__(self, idim: int, odim: int, relu: bool):
        super().__init__()
        layers = [nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5), nn.Identity()]
        self.out = nn.Sequential(*layers, nn.ReLU()) if relu else nn.Sequential(*layers)
        self.xscale = math.sqrt(odim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.xscale


# What v1's LM uses of upstream's encoder options, and upstream's defaults for each class (a yaml
# that leaves an option out gets the default, which may be one we refuse).
_ENCODER_FIXED = {
    "pos_enc_layer_type": "rel_pos_espnet",
    "selfattention_layer_type": "rel_selfattn",
    "normalize_before": True,
    "use_cnn_module": False,
    "macaron_style": False,
}
_ENCODER_DEFAULTS = {
    "ConformerEncoder": {"pos_enc_layer_type": "rel_pos", "selfattention_layer_type": "rel_selfattn",
                         "normalize_before": True, "use_cnn_module": True, "macaron_style": True},
    "TransformerEncoder": {"pos_enc_layer_type": "abs_pos", "selfattention_layer_type": "selfattn",
                           "normalize_before": True},
}
_ENCODER_IGNORED = {"dropout_rate", "positional_dropout_rate", "attention_dropout_rate", "use_dynamic_left_chunk",
                    "gradient_checkpointing", "global_cmvn", "positionwise_conv_kernel_size", "cnn_module_kernel",
                    "causal", "cnn_module_norm"}


class EncoderSpec:
    """The arguments of a ``ConformerEncoder``/``TransformerEncoder`` node that shape the network."""

    def __init__(self, node: Call, cls: str, where: str):
        expect(node, cls, where=where)
        conformer = cls == "ConformerEncoder"
        kw = dict(node.kwargs)
        defaults = _ENCODER_DEFAULTS[cls]
        fixed = {k: v for k, v in _ENCODER_FIXED.items() if k in defaults}
        for key, want in fixed.items():
            got = kw.get(key, defaults[key])
            if got != want:
                raise ValueError(f"{where}.{key}: {got!r}; CosyVoice-300M's LM uses {want!r}")
        known = set(fixed) | _ENCODER_IGNORED | {"input_size", "output_size", "attention_heads", "linear_units",
                                                 "num_blocks", "input_layer", "static_chunk_size",
                                                 "use_dynamic_chunk", "activation_type", "key_bias"}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise ValueError(f"{where}: unknown argument {', '.join(unknown)}")
        self.input_layer = kw.get("input_layer", "conv2d")
        want_layer = "linear" if conformer else "linear_legacy"
        if self.input_layer != want_layer:
            raise ValueError(f"{where}.input_layer: {self.input_layer!r}; CosyVoice-300M's LM uses {want_layer!r}")
        self.activation = kw.get("activation_type", "swish" if conformer else "relu")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"{where}.activation_type: {self.activation!r}; one of {', '.join(_ACTIVATIONS)}")
        try:
            self.input_size = int(kw["input_size"])
            self.output_size = int(kw.get("output_size", 256))
            self.heads = int(kw.get("attention_heads", 4))
            self.linear_units = int(kw.get("linear_units", 2048))
            self.num_blocks = int(kw.get("num_blocks", 6))
            self.static_chunk_size = int(kw.get("static_chunk_size", 0))
        except KeyError:
            raise ValueError(f"{where}: missing input_size") from None
        except (TypeError, ValueError):
            raise ValueError(f"{where}: sizes must be integers (got {kw})") from None
        self.use_dynamic_chunk = bool(kw.get("use_dynamic_chunk", False))
        self.key_bias = bool(kw.get("key_bias", True))


class TextEncoder(nn.Module):
    """Upstream's ``ConformerEncoder`` as the v1 LM runs it: one unpadded sequence, attention
    limited to chunks of ``static_chunk_size`` (1: causal) and everything before them."""

    def __init__(self, spec: EncoderSpec):
        super().__init__()
        self.embed = InputLayer(spec.input_size, spec.output_size, relu=False)
        self.encoders = nn.ModuleList(
            ConformerLayer(spec.output_size, spec.heads, spec.linear_units, spec.activation, spec.key_bias)
            for _ in range(spec.num_blocks)
        )
        self.after_norm = nn.LayerNorm(spec.output_size, eps=1e-5)
        # upstream's encode() asks for chunks of 1 when the encoder uses dynamic chunks
        self.chunk = 1 if spec.use_dynamic_chunk else spec.static_chunk_size

    def forward(self, x: Tensor) -> Tensor:
        """x: (T, input_size) -> (T, output_size)."""
        t = x.size(0)
        x = self.embed(x[None])
        index = torch.arange(t, device=x.device)
        if self.chunk > 0:
            mask = index[None, :] < ((index[:, None] // self.chunk + 1) * self.chunk)
        else:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device)
        table = distance_table(t, x.size(-1)).to(device=x.device, dtype=x.dtype)
        for layer in self.encoders:
            x = layer(x, index[None], layer.self_attn.project(table), mask[None, None])
        return self.after_norm(x)[0]


class SpeechDecoder(nn.Module):
    """Upstream's ``TransformerEncoder`` used as the speech LM (``linear_legacy`` input layer)."""

    def __init__(self, spec: EncoderSpec):
        super().__init__()
        self.embed = InputLayer(spec.input_size, spec.output_size, relu=True)
        self.encoders = nn.ModuleList(
            TransformerLayer(spec.output_size, spec.heads, spec.linear_units, spec.activation, spec.key_bias)
            for _ in range(spec.num_blocks)
        )
        self.after_norm = nn.LayerNorm(spec.output_size, eps=1e-5)


class _SpeechEmbedding(nn.Embedding):
    """The speech-token embedding (no row for the stop id). The pool feeds every row's last id
    back in, a stopped row's stop id included; that row's next input is never used, so ids past
    the table are clamped instead of indexing out of range."""

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids.clamp(max=self.num_embeddings - 1))


class TransformerSpeechLM(DecoderLM):
    """Upstream's v1 ``TransformerLM`` parameters and batched generation through the slot pool."""

    def __init__(self, text_encoder: EncoderSpec, llm: EncoderSpec, text_token_size: int,
                 speech_token_size: int = SPEECH_TOKENS_V1, spk_embed_dim: int = 192,
                 text_encoder_input_size: int | None = None, llm_input_size: int | None = None,
                 llm_output_size: int | None = None):
        super().__init__()
        text_width = text_encoder_input_size if text_encoder_input_size is not None else text_encoder.input_size
        width = llm_input_size if llm_input_size is not None else llm.input_size
        out_width = llm_output_size if llm_output_size is not None else llm.output_size
        checks = {"text_encoder.input_size": (text_encoder.input_size, text_width),
                  "llm.input_size": (llm.input_size, width), "llm.output_size": (llm.output_size, out_width)}
        for name, (got, want) in checks.items():
            if got != want:
                raise ValueError(f"llm: {name} {got} differs from {want}")
        if width != out_width:
            raise ValueError(f"llm: llm_input_size {width} != llm_output_size {out_width}; the decode step "
                             "feeds outputs and inputs through buffers of one width")
        self.speech_token_size = speech_token_size
        self.width = width
        self.text_embedding = nn.Embedding(text_token_size, text_width)
        self.text_encoder = TextEncoder(text_encoder)
        self.text_encoder_affine_layer = nn.Linear(text_encoder.output_size, width)
        self.llm_embedding = nn.Embedding(2, width)
        self.llm = SpeechDecoder(llm)
        self.llm_decoder = nn.Linear(out_width, speech_token_size + 1)
        self.speech_embedding = _SpeechEmbedding(speech_token_size, width)
        self.spk_embed_affine_layer = nn.Linear(spk_embed_dim, width)
        self.spk_embed_dim = spk_embed_dim
        self._tables: list[Tensor] | None = None  # per layer: (heads, N, d_k) projected distances
        self.register_load_state_dict_post_hook(lambda module, keys: module._forget_tables())

    # -- DecoderLM ------------------------------------------------------------------------------
    @property
    def kv_layout(self) -> tuple[int, int, int]:
        attn = self.llm.encoders[0].self_attn
        return len(self.llm.encoders), attn.h, attn.d_k

    @property
    def hidden_size(self) -> int:
        return self.width

    def prompt_embeddings(self, req: LMRequest, device: torch.device) -> Tensor:
        """``[sos, speaker (if any), encoded prompt text + text, task id, prompt speech]`` as (P, H)."""
        w = self.llm_embedding.weight
        text = torch.tensor([*req.prompt_text, *req.text], dtype=torch.long, device=device)
        parts = [w[SOS][None]]
        if req.embedding is not None:
            parts.append(self.speaker(torch.as_tensor(req.embedding, device=device)))
        if text.numel():
            parts.append(self.text_encoder_affine_layer(self.text_encoder(self.text_embedding(text))))
        parts.append(w[TASK_ID][None])
        speech = torch.tensor(list(req.prompt_speech), dtype=torch.long, device=device)
        parts.append(self.speech_embedding(speech))
        return torch.cat(parts, dim=0)

    def speaker(self, embedding: Tensor) -> Tensor:
        """A speaker embedding (spk_embed_dim values) -> its (1, H) slot: L2-normalised, projected."""
        flat = embedding.reshape(1, -1).float()
        if flat.size(1) != self.spk_embed_dim:
            raise ValueError(f"speaker embedding has {flat.size(1)} values; the LM takes {self.spk_embed_dim}")
        layer = self.spk_embed_affine_layer
        return layer(F.normalize(flat, dim=1).to(layer.weight.dtype))

    def body(self, x: Tensor, positions: Tensor, cache, mask: Tensor) -> Tensor:
        """Upstream applies the input layer (linear_legacy, x sqrt(H)) to every LM input, the prompt
        and each fed-back token alike, so it is applied here rather than in the embeddings."""
        x = self.llm.embed(x)
        # Without a cache the keys are this forward's positions; a pool's tables cover its capacity.
        tables = self.distance_tables(x.size(1) if isinstance(cache, Cache) else 0, x.device, x.dtype)
        for i, layer in enumerate(self.llm.encoders):
            x = layer(x, positions, tables[i], mask, cache, i)
        return self.llm.after_norm(x)

    # -- the projected distance tables ----------------------------------------------------------
    def distance_tables(self, size: int, device: torch.device, dtype: torch.dtype) -> list[Tensor]:
        """Per layer, ``linear_pos`` of the distance sinusoids 0..N-1 with N >= ``size`` (and at
        least the last pool's capacity), built once and reused by every step.

        A rebuild drops the pool: captured CUDA graphs point at the old tables."""
        tables = self._tables
        if tables is None or tables[0].size(1) < size or tables[0].device != device or tables[0].dtype != dtype:
            pool = self._pool
            size = max(size, pool.capacity if pool is not None else 0)
            self._pool = None
            raw = distance_table(max(size, 1), self.width).to(device=device, dtype=dtype)
            with torch.no_grad():
                tables = [layer.self_attn.project(raw) for layer in self.llm.encoders]
            self._tables = tables
        return tables

    def slot_pool(self, slots: int, capacity: int, max_steps: int, sampling: Sampling, cuda_graphs: bool = True,
                  check_every: int = CHECK_EVERY) -> SlotPool:
        """The base pool, with the distance tables covering its whole capacity before any step runs
        (so no step, captured or not, reallocates them)."""
        pool = super().slot_pool(slots, capacity, max_steps, sampling, cuda_graphs, check_every)
        weight = self.llm_decoder.weight
        self.distance_tables(pool.capacity, weight.device, weight.dtype)
        self._pool = pool  # distance_tables() drops the pool only when it rebuilds for a larger one
        return pool

    def _forget_tables(self) -> None:
        self._tables = None
        self._pool = None

    def _apply(self, fn, recurse: bool = True):
        self._forget_tables()  # device or dtype changes: tables and the pool's cache are stale
        return super()._apply(fn, recurse)

    def to_precision(self, dtype: torch.dtype) -> TransformerSpeechLM:
        """Convert every weight to ``dtype`` once."""
        return self.to(dtype=dtype)


def build_llm_v1(call: Call) -> TransformerSpeechLM:
    """The LM the yaml's ``llm`` node (``TransformerLM``) describes; random weights."""
    expect(call, "TransformerLM", where="llm")
    kw = call.kwargs
    text_encoder = EncoderSpec(kw.get("text_encoder"), "ConformerEncoder", "llm.text_encoder")
    llm = EncoderSpec(kw.get("llm"), "TransformerEncoder", "llm.llm")
    known = {"text_encoder_input_size", "llm_input_size", "llm_output_size", "text_token_size", "speech_token_size",
             "text_encoder", "llm", "sampling", "length_normalized_loss", "lsm_weight", "spk_embed_dim"}
    unknown = sorted(set(kw) - known)
    if unknown:
        raise ValueError(f"llm: unknown argument {', '.join(unknown)}")
    Sampling.from_yaml(call)  # a bad sampling node is refused when the model loads, not at decode time
    try:
        sizes = {k: int(kw[k]) for k in ("text_encoder_input_size", "llm_input_size", "llm_output_size",
                                         "text_token_size", "speech_token_size", "spk_embed_dim") if k in kw}
    except (TypeError, ValueError):
        raise ValueError(f"llm: sizes must be integers (got {kw})") from None
    if "text_token_size" not in sizes:
        raise ValueError("llm: missing text_token_size")
    return TransformerSpeechLM(
        text_encoder, llm, sizes["text_token_size"], sizes.get("speech_token_size", SPEECH_TOKENS_V1),
        sizes.get("spk_embed_dim", 192), sizes.get("text_encoder_input_size"), sizes.get("llm_input_size"),
        sizes.get("llm_output_size"),
    )


def load_llm_v1(model_dir: str | Path, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> TransformerSpeechLM:
    """Build the LM from ``cosyvoice.yaml``, load ``llm.pt`` strictly (``weights_only``), convert
    its weights once to ``dtype``."""
    model_dir = Path(model_dir)
    path = model_dir / YAML_NAME
    if not path.is_file():
        raise ModelDirError(f"{model_dir}: no {YAML_NAME}; pass the downloaded CosyVoice-300M folder")
    try:
        lm = build_llm_v1(load_yaml(path).get("llm"))
    except ValueError as exc:
        raise ModelDirError(f"{path}: {exc}") from None
    weights = model_dir / "llm.pt"
    load_strict(lm, load_state(weights), weights)
    return lm.to(device).to_precision(dtype).eval()
