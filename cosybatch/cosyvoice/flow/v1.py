"""CosyVoice-300M's flow-matching model (50 Hz speech tokens -> 22,050 Hz mel), batch-native.

Architecture after upstream's ``MaskedDiffWithXvec`` (FunAudioLLM/CosyVoice, Apache-2.0): token
embedding, a Conformer encoder (relative-position attention, no upsampling), a projection to 80
channels, an ``InterpolateRegulator`` that stretches the token rate to the mel rate, and a conditional
flow-matching decoder (a non-causal 1-D U-Net of conv ResNet blocks with GroupNorm, transformer
blocks, one x2 down/up level) solved with Euler steps, a cosine time schedule and classifier-free
guidance. Attribute names follow upstream's so an official ``flow.pt`` loads with strict key checks.

Upstream runs one utterance at a time; here one call takes a padded batch and every item's mel
equals the item's alone (within float rounding):

- the mel length is not a fixed multiple of the token count (``int(n / 50 * 22050 / 256)``), so
  the regulator's interpolation runs per item, the prompt's tokens and, above 40 tokens, the first
  20, the middle and the last 20 tokens each on their own, as upstream does;
- GroupNorm statistics are taken over each item's real frames only (:class:`MaskedGroupNorm`), and
  every convolution reads zeros past an item's end, as a lone item's zero padding gives;
- attention masks padded keys;
- the starting noise is drawn per item from its own seeded generator, with the shape and order of
  upstream's ``randn_like(mu)``: seed ``s`` gives the noise upstream draws right after
  ``torch.manual_seed(s)``. (Upstream draws from the global generator on every call.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..yamlconf import Call, expect
from .cfm import CausalConditionalCFM, FlowInput, TimestepMLP, TransformerBlock, length_mask, timestep_features
from .conformer import ConformerLayer, LinearEmbed

__all__ = ["NOISE_SEED", "ConditionalDecoder", "ConformerEncoder", "FlowInput", "InterpolateRegulator",
           "MaskedDiffWithXvec", "MaskedGroupNorm", "build_flow_v1", "mel_frames"]

# Upstream hard-codes the mel rate in the flow (not read from the yaml's sample_rate): 22,050 Hz, hop 256.
MEL_SAMPLE_RATE_HZ = 22050
MEL_HOP = 256
# Above this many tokens the regulator stretches head, middle and tail separately (upstream's overlap).
SPLIT_ABOVE_TOKENS = 40
EDGE_TOKENS = 20
# Default per-item noise seed when the caller gives none.
NOISE_SEED = 0


def mel_frames(n_tokens: int, token_rate_hz: int = 50) -> int:
    """Mel frames upstream's flow makes from ``n_tokens`` speech tokens (prompt tokens excluded)."""
    return int(n_tokens / token_rate_hz * MEL_SAMPLE_RATE_HZ / MEL_HOP)


# --------------------------------------------------------------------------------------------
# Masked normalisation


class MaskedGroupNorm(nn.GroupNorm):
    """GroupNorm over (channels / groups, real frames) of each item; padded frames do not count.

    Upstream normalises a lone utterance over all its frames; in a padded batch plain GroupNorm would
    also average the padding. Statistics are computed in fp32 whatever the input dtype.
    """

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:  # type: ignore[override]
        if mask is None:
            return super().forward(x)
        b, c, t = x.shape
        g = self.num_groups
        xf = x.float().view(b, g, c // g, t)
        m = mask.float().view(b, 1, 1, t)
        count = m.sum(dim=(2, 3), keepdim=True) * (c // g)
        mean = (xf * m).sum(dim=(2, 3), keepdim=True) / count
        var = (((xf - mean) * m) ** 2).sum(dim=(2, 3), keepdim=True) / count
        y = ((xf - mean) * torch.rsqrt(var + self.eps)).view(b, c, t)
        if self.affine:
            y = y * self.weight.float()[None, :, None] + self.bias.float()[None, :, None]
        return y.to(x.dtype)


# --------------------------------------------------------------------------------------------
# Encoder and length regulator


class ConformerEncoder(nn.Module):
    """Linear embedding, ``num_blocks`` pre-norm Conformer layers (no conv module), final LayerNorm."""

    def __init__(
        self,
        input_size: int = 512,
        output_size: int = 512,
        attention_heads: int = 8,
        linear_units: int = 2048,
        num_blocks: int = 6,
        key_bias: bool = True,
    ):
        super().__init__()
        self.embed = LinearEmbed(input_size, output_size)
        self.encoders = nn.ModuleList(
            ConformerLayer(output_size, attention_heads, linear_units, key_bias) for _ in range(num_blocks)
        )
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        """x: (B, T, D) -> (B, T, output_size); only attention crosses frames, and it masks padded keys."""
        mask = length_mask(lengths, x.size(1))
        x, pos = self.embed(x)
        for layer in self.encoders:
            x = layer(x, mask, pos)
        return self.after_norm(x)


class InterpolateRegulator(nn.Module):
    """Linear interpolation from token rate to mel rate, then (conv k=3, GroupNorm, Mish) x n and a 1x1 conv."""

    def __init__(self, channels: int = 80, sampling_ratios: Sequence[int] = (1, 1, 1, 1), groups: int = 1,
                 out_channels: int | None = None):
        super().__init__()
        layers: list[nn.Module] = []
        for _ in sampling_ratios:
            layers += [nn.Conv1d(channels, channels, 3, 1, 1), MaskedGroupNorm(groups, channels), nn.Mish()]
        layers.append(nn.Conv1d(channels, out_channels or channels, 1, 1))
        self.model = nn.Sequential(*layers)

    @staticmethod
    def stretch(prompt: Tensor, tokens: Tensor, prompt_frames: int, frames: int, token_rate_hz: int) -> Tensor:
        """One item: prompt (P, C) and tokens (T, C) encodings -> (C, prompt_frames + frames), as upstream's
        ``inference`` cuts them."""
        def lerp(x: Tensor, size: int) -> Tensor:
            return F.interpolate(x.t()[None].contiguous(), size=size, mode="linear")[0]

        if tokens.size(0) > SPLIT_ABOVE_TOKENS:
            edge = mel_frames(EDGE_TOKENS, token_rate_hz)
            parts = [lerp(tokens[:EDGE_TOKENS], edge), lerp(tokens[EDGE_TOKENS:-EDGE_TOKENS], frames - 2 * edge),
                     lerp(tokens[-EDGE_TOKENS:], edge)]
        else:
            parts = [lerp(tokens, frames)]
        if prompt.size(0):
            parts.insert(0, lerp(prompt, prompt_frames))
        return torch.cat(parts, dim=1)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x: (B, C, F) stretched encodings, zero past each item's frames; mask (B, 1, F) -> (B, C_out, F)."""
        for layer in self.model:
            if isinstance(layer, MaskedGroupNorm):
                x = layer(x, mask)
            elif isinstance(layer, nn.Conv1d):
                x = layer(x * mask)
            else:
                x = layer(x)
        return x * mask


# --------------------------------------------------------------------------------------------
# Decoder (the flow-matching estimator)


class Block(nn.Module):
    """Conv k=3, GroupNorm, Mish (matcha's Block1D); indices 0 and 1 carry weights, as upstream's Sequential."""

    def __init__(self, dim: int, dim_out: int, groups: int = 8):
        super().__init__()
        self.block = nn.Sequential(nn.Conv1d(dim, dim_out, 3, padding=1), MaskedGroupNorm(groups, dim_out), nn.Mish())

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.block[1](self.block[0](x * mask), mask)
        return self.block[2](h) * mask


class ResnetBlock(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_dim: int, groups: int = 8):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = Block(dim, dim_out, groups)
        self.block2 = Block(dim_out, dim_out, groups)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, t: Tensor) -> Tensor:
        h = self.block1(x, mask) + self.mlp(t)[:, :, None]
        return self.block2(h, mask) + self.res_conv(x * mask)


class Downsample(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class ConditionalDecoder(nn.Module):
    """Non-causal 1-D U-Net estimating the flow's velocity from (x, mu, speaker, prompt condition, t).

    ``channels`` has one entry per level; every level but the last halves the frame rate on the way
    down (stride-2 conv) and doubles it on the way up (transposed conv), as upstream's decoder.
    """

    def __init__(
        self,
        in_channels: int = 320,
        out_channels: int = 80,
        channels: Sequence[int] = (256, 256),
        attention_head_dim: int = 64,
        n_blocks: int = 4,
        num_mid_blocks: int = 12,
        num_heads: int = 8,
        act_fn: str = "gelu",
    ):
        super().__init__()
        if act_fn != "gelu":
            raise ValueError(f"decoder act_fn {act_fn!r} is not supported (CosyVoice uses 'gelu')")
        channels = tuple(int(c) for c in channels)
        if not channels:
            raise ValueError("decoder channels must name at least one level")
        self.in_channels = in_channels
        time_dim = channels[0] * 4
        self.time_mlp = TimestepMLP(in_channels, time_dim)

        def transformers(width: int) -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(width, num_heads, attention_head_dim) for _ in range(n_blocks))

        self.down_blocks = nn.ModuleList()
        width_in = in_channels
        for i, width in enumerate(channels):
            last = i == len(channels) - 1
            down = nn.Conv1d(width, width, 3, padding=1) if last else Downsample(width)
            self.down_blocks.append(nn.ModuleList([ResnetBlock(width_in, width, time_dim), transformers(width), down]))
            width_in = width
        mid = channels[-1]
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([ResnetBlock(mid, mid, time_dim), transformers(mid)]) for _ in range(num_mid_blocks)
        )
        ups = (*channels[::-1], channels[0])
        self.up_blocks = nn.ModuleList()
        for i in range(len(ups) - 1):
            last = i == len(ups) - 2
            width = ups[i + 1]
            up = nn.Conv1d(width, width, 3, padding=1) if last else Upsample(width)
            self.up_blocks.append(nn.ModuleList([ResnetBlock(2 * ups[i], width, time_dim), transformers(width), up]))
        self.final_block = Block(ups[-1], ups[-1])
        self.final_proj = nn.Conv1d(ups[-1], out_channels, 1)

    @staticmethod
    def _attend(x: Tensor, blocks: nn.ModuleList, mask: Tensor) -> Tensor:
        # Additive bias, 0 on real keys; -1e10 (as upstream's mask_to_bias) or fp16's most negative finite value.
        hidden = -min(1.0e10, torch.finfo(x.dtype).max)
        bias = torch.zeros_like(mask, dtype=x.dtype).masked_fill(mask == 0, hidden)[:, :, None, :]
        x = x.transpose(1, 2)
        for block in blocks:
            x = block(x, bias)
        return x.transpose(1, 2)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        """x, mu, cond: (B, 80, T); mask: (B, 1, T); t: (B,) (any float dtype); spks: (B, 80)."""
        temb = self.time_mlp(timestep_features(t.float(), self.in_channels).to(x.dtype))
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.size(2)), cond], dim=1)
        skips, masks = [], [mask]
        for resnet, blocks, down in self.down_blocks:
            level = masks[-1]
            h = self._attend(resnet(h, level, temb), blocks, level)
            skips.append(h)
            h = down(h * level)
            masks.append(level[:, :, ::2])
        masks.pop()
        level = masks[-1]
        for resnet, blocks in self.mid_blocks:
            h = self._attend(resnet(h, level, temb), blocks, level)
        for resnet, blocks, up in self.up_blocks:
            level = masks.pop()
            skip = skips.pop()
            h = torch.cat([h[:, :, : skip.size(2)], skip], dim=1)
            h = self._attend(resnet(h, level, temb), blocks, level)
            h = up(h * level)
        h = self.final_block(h, level)
        return self.final_proj(h * level) * mask


# --------------------------------------------------------------------------------------------
# The whole flow


class MaskedDiffWithXvec(nn.Module):
    def __init__(
        self,
        encoder: ConformerEncoder,
        length_regulator: InterpolateRegulator,
        decoder: CausalConditionalCFM,
        input_size: int = 512,
        output_size: int = 80,
        spk_embed_dim: int = 192,
        vocab_size: int = 4096,
        input_frame_rate: int = 50,
        n_timesteps: int = 10,
    ):
        super().__init__()
        self.output_size = output_size
        self.vocab_size = vocab_size
        self.input_frame_rate = input_frame_rate
        self.n_timesteps = n_timesteps
        self.input_embedding = nn.Embedding(vocab_size, input_size)
        self.spk_embed_affine_layer = nn.Linear(spk_embed_dim, output_size)
        self.encoder = encoder
        self.encoder_proj = nn.Linear(encoder.after_norm.normalized_shape[0], output_size)
        self.length_regulator = length_regulator
        self.decoder = decoder

    def mel_frames(self, n_tokens: int) -> int:
        """Mel frames this flow makes from ``n_tokens`` speech tokens (the same rule for prompt-less output)."""
        return mel_frames(n_tokens, self.input_frame_rate)

    def noise(self, frames: int, seed: int) -> Tensor:
        """(1, 80, frames) fp32 starting noise: what upstream's ``randn_like(mu)`` gives after ``manual_seed(seed)``."""
        gen = torch.Generator().manual_seed(int(seed))
        return torch.randn(1, self.output_size, frames, generator=gen)

    @torch.inference_mode()
    def inference(self, items: Sequence[FlowInput], seeds: Sequence[int] | None = None) -> list[Tensor]:
        """Mel spectrograms (80, ``mel_frames(len(tokens))``) of each item, prompt frames removed.

        ``seeds`` (one per item, default :data:`NOISE_SEED` for all) seed each item's starting noise.
        """
        if seeds is None:
            seeds = [NOISE_SEED] * len(items)
        if len(seeds) != len(items):
            raise ValueError(f"{len(items)} items but {len(seeds)} seeds")
        if not items:
            return []
        device = self.input_embedding.weight.device
        dtype = self.spk_embed_affine_layer.weight.dtype
        tokens, prompt_tokens, prompt_frames, frames = [], [], [], []
        for item in items:
            prompt = item.prompt_tokens if item.prompt_tokens is not None else torch.zeros(0, dtype=torch.long)
            mel_count = 0 if item.prompt_mel is None else item.prompt_mel.size(0)
            if (len(prompt) == 0) != (mel_count == 0):
                raise ValueError(f"a prompt needs both its tokens and its mel: got {len(prompt)} tokens and "
                                 f"{mel_count} mel frames")
            if len(item.tokens) == 0:
                raise ValueError("an item without speech tokens has no mel; drop it before the flow")
            prompt_tokens.append(len(prompt))
            tokens.append(torch.cat([prompt.long().cpu(), item.tokens.long().cpu()]))
            prompt_frames.append(mel_count)
            frames.append(self.mel_frames(len(item.tokens)))
        lengths = torch.tensor([len(t) for t in tokens], device=device)
        padded = nn.utils.rnn.pad_sequence(tokens, batch_first=True).to(device)
        token_mask = length_mask(lengths, padded.size(1))

        spks = F.normalize(torch.stack([item.embedding.reshape(-1) for item in items]).to(device, dtype), dim=1)
        spks = self.spk_embed_affine_layer(spks)
        x = self.input_embedding(padded.clamp(0, self.vocab_size - 1)) * token_mask[..., None].to(dtype)
        h = self.encoder_proj(self.encoder(x, lengths))

        totals = [p + f for p, f in zip(prompt_frames, frames, strict=True)]
        width = max(totals)
        mel_lengths = torch.tensor(totals, device=device)
        mask = length_mask(mel_lengths, width)[:, None, :].to(dtype)
        stretched = h.new_zeros(len(items), self.output_size, width)
        cond = torch.zeros_like(stretched)
        z = torch.zeros(len(items), self.output_size, width, device=device)
        for i, item in enumerate(items):
            n, p = len(tokens[i]), prompt_tokens[i]
            stretched[i, :, : totals[i]] = self.length_regulator.stretch(
                h[i, :p], h[i, p:n], prompt_frames[i], frames[i], self.input_frame_rate
            )
            if prompt_frames[i]:
                cond[i, :, : prompt_frames[i]] = item.prompt_mel.to(device, dtype).t()
            z[i, :, : totals[i]] = self.noise(totals[i], seeds[i])[0].to(device)
        mu = self.length_regulator(stretched, mask)
        mel = self.decoder(z, mu, mask, spks, cond, self.n_timesteps)
        return [mel[i, :, prompt_frames[i] : totals[i]] for i in range(len(items))]


def _cfm_params(cfm: Call) -> dict:
    params = cfm.kwargs.get("cfm_params")
    if isinstance(params, Call):  # !new:omegaconf.DictConfig {content: {...}}
        params = params.kwargs.get("content", params.kwargs)
    return dict(params or {})


def build_flow_v1(node: Call) -> MaskedDiffWithXvec:
    """Construct the flow from the ``flow:`` section of CosyVoice-300M's cosyvoice.yaml (parsed, never executed)."""
    flow = expect(node, "MaskedDiffWithXvec", where="flow")
    enc = expect(flow.kwargs.get("encoder"), "ConformerEncoder", where="flow.encoder").kwargs
    reg = expect(flow.kwargs.get("length_regulator"), "InterpolateRegulator", where="flow.length_regulator").kwargs
    cfm = expect(flow.kwargs.get("decoder"), "ConditionalCFM", where="flow.decoder")
    est = expect(cfm.kwargs.get("estimator"), "ConditionalDecoder", where="flow.decoder.estimator").kwargs
    params = _cfm_params(cfm)
    for key, want in (("input_layer", "linear"), ("pos_enc_layer_type", "rel_pos_espnet"),
                      ("selfattention_layer_type", "rel_selfattn"), ("normalize_before", True)):
        if enc.get(key, want) != want:
            raise ValueError(f"flow.encoder.{key}={enc[key]!r} is not supported (CosyVoice-300M uses {want!r})")
    if enc.get("use_cnn_module", False) or enc.get("macaron_style", False):
        raise ValueError("flow.encoder with a conv module or macaron feed-forward is not supported")
    if int(enc.get("static_chunk_size", 0)) != 0 or enc.get("use_dynamic_chunk", False):
        raise ValueError("flow.encoder with chunked attention is not supported (CosyVoice-300M attends to all frames)")
    if params.get("solver", "euler") != "euler":
        raise ValueError(f"flow solver {params['solver']!r} is not supported")
    output_size = int(flow.kwargs.get("output_size", 80))
    encoder = ConformerEncoder(
        input_size=int(enc.get("input_size", 512)),
        output_size=int(enc.get("output_size", 512)),
        attention_heads=int(enc.get("attention_heads", 8)),
        linear_units=int(enc.get("linear_units", 2048)),
        num_blocks=int(enc.get("num_blocks", 6)),
        key_bias=bool(enc.get("key_bias", True)),
    )
    regulator = InterpolateRegulator(
        channels=int(reg.get("channels", output_size)),
        sampling_ratios=tuple(reg.get("sampling_ratios", (1, 1, 1, 1))),
        groups=int(reg.get("groups", 1)),
        out_channels=reg.get("out_channels"),
    )
    estimator = ConditionalDecoder(
        in_channels=int(est.get("in_channels", 320)),
        out_channels=int(est.get("out_channels", 80)),
        channels=tuple(est.get("channels", (256, 256))),
        attention_head_dim=int(est.get("attention_head_dim", 64)),
        n_blocks=int(est.get("n_blocks", 4)),
        num_mid_blocks=int(est.get("num_mid_blocks", 12)),
        num_heads=int(est.get("num_heads", 8)),
        act_fn=str(est.get("act_fn", "gelu")),
    )
    decoder = CausalConditionalCFM(
        estimator,  # the Euler loop is the same for the causal and the non-causal estimator
        t_scheduler=str(params.get("t_scheduler", "cosine")),
        inference_cfg_rate=float(params.get("inference_cfg_rate", 0.7)),
    )
    return MaskedDiffWithXvec(
        encoder,
        regulator,
        decoder,
        input_size=int(flow.kwargs.get("input_size", 512)),
        output_size=output_size,
        spk_embed_dim=int(flow.kwargs.get("spk_embed_dim", 192)),
        vocab_size=int(flow.kwargs.get("vocab_size", 4096)),
        input_frame_rate=int(flow.kwargs.get("input_frame_rate", 50)),
    )
