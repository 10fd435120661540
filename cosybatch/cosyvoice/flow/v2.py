"""CosyVoice2's flow-matching model (speech tokens -> mel), batch-native.

Architecture after upstream's ``CausalMaskedDiffWithXvec`` (FunAudioLLM/CosyVoice, Apache-2.0):
token embedding, speaker-embedding projection, an upsampling Conformer encoder (a 3-token
look-ahead conv, 6 blocks, x2 upsampling, 4 more blocks, relative-position attention), and a
conditional flow-matching decoder (a 1-D U-Net of causal conv ResNet blocks and transformer blocks)
solved with Euler steps on a cosine time schedule and classifier-free guidance.

Attribute names follow upstream's so an official ``flow.pt`` loads with strict key checks.
Upstream runs one utterance at a time; here one call takes a padded batch of different lengths
and every item's mel equals what the item gives alone:

- the look-ahead conv reads 3 frames to the right, so padded frames are zeroed before it (a lone
  item sees zero padding there);
- attention masks padded keys; every other layer is causal or pointwise, so padding never
  reaches a real frame;
- the decoder's starting noise is upstream's fixed noise (seed 0, a prefix of one buffer per
  item), so an item's noise does not depend on its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..yamlconf import Call, expect
from .cfm import CausalConditionalCFM, FlowInput, TimestepMLP, TransformerBlock, length_mask, timestep_features
from .conformer import ConformerLayer, LinearEmbed

# Upstream's decoder noise: torch.manual_seed(0); torch.randn(1, 80, 50 * 300).
NOISE_SEED = 0
NOISE_FRAMES = 50 * 300


class PreLookahead(nn.Module):
    """Residual conv that reads ``lookahead`` frames ahead, then a causal conv of width 3."""

    def __init__(self, channels: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, channels, lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = F.pad(x.transpose(1, 2), (0, self.lookahead))
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


class RepeatUpsample(nn.Module):
    """Nearest-neighbour x``stride`` upsampling followed by a causal conv."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, stride * 2 + 1)

    def forward(self, x: Tensor) -> Tensor:
        x = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(x, (self.stride * 2, 0)))


class UpsampleConformerEncoder(nn.Module):
    def __init__(
        self,
        input_size: int = 512,
        output_size: int = 512,
        attention_heads: int = 8,
        linear_units: int = 2048,
        num_blocks: int = 6,
        num_up_blocks: int = 4,
        pre_lookahead_len: int = 3,
        upsample_stride: int = 2,
        key_bias: bool = True,
    ):
        super().__init__()
        self.embed = LinearEmbed(input_size, output_size)
        self.pre_lookahead_layer = PreLookahead(output_size, pre_lookahead_len)
        self.encoders = nn.ModuleList(
            ConformerLayer(output_size, attention_heads, linear_units, key_bias) for _ in range(num_blocks)
        )
        self.up_layer = RepeatUpsample(output_size, upsample_stride)
        self.up_embed = LinearEmbed(input_size, output_size)
        self.up_encoders = nn.ModuleList(
            ConformerLayer(output_size, attention_heads, linear_units, key_bias) for _ in range(num_up_blocks)
        )
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)

    def forward(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """x: (B, T, D) with zeros past each length -> (B, stride*T, D), stride * lengths."""
        mask = length_mask(lengths, x.size(1))
        x, pos = self.embed(x)
        x = self.pre_lookahead_layer(x * mask[..., None])
        for layer in self.encoders:
            x = layer(x, mask, pos)
        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        lengths = lengths * self.up_layer.stride
        mask = length_mask(lengths, x.size(1))
        x, pos = self.up_embed(x)
        for layer in self.up_encoders:
            x = layer(x, mask, pos)
        return self.after_norm(x), lengths


class CausalConv1d(nn.Conv1d):
    """Conv1d padded on the left only, so no output frame reads a later input frame."""

    def __init__(self, cin: int, cout: int, kernel: int):
        super().__init__(cin, cout, kernel)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class _ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over channels of a (B, C, T) tensor."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class CausalBlock(nn.Module):
    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        # Indices 0 and 2 carry weights, as upstream's Sequential(conv, transpose, norm, transpose, mish).
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), nn.Identity(), _ChannelLayerNorm(dim_out), nn.Identity(), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.block(x * mask) * mask


class CausalResnetBlock(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock(dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, t: Tensor) -> Tensor:
        h = self.block1(x, mask) + self.mlp(t)[:, :, None]
        return self.block2(h, mask) + self.res_conv(x * mask)


class CausalConditionalDecoder(nn.Module):
    """1-D U-Net estimating the flow's velocity from (x, mu, speaker, prompt condition, t)."""

    def __init__(
        self,
        in_channels: int = 320,
        out_channels: int = 80,
        channels: Sequence[int] = (256,),
        attention_head_dim: int = 64,
        n_blocks: int = 4,
        num_mid_blocks: int = 12,
        num_heads: int = 8,
        act_fn: str = "gelu",
    ):
        super().__init__()
        if act_fn != "gelu":
            raise ValueError(f"decoder act_fn {act_fn!r} is not supported (CosyVoice2 uses 'gelu')")
        if len(channels) != 1:
            # Downsampling levels would need per-item handling of odd lengths; CosyVoice2 has one level.
            raise ValueError(f"decoder channels {list(channels)}: only one level is supported, as in CosyVoice2")
        width = channels[0]
        self.in_channels = in_channels
        time_dim = width * 4
        self.time_mlp = TimestepMLP(in_channels, time_dim)

        def transformers() -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(width, num_heads, attention_head_dim) for _ in range(n_blocks))

        # One level (channels has one entry): resnet, transformers, then a causal conv in place of resampling.
        down = [CausalResnetBlock(in_channels, width, time_dim), transformers(), CausalConv1d(width, width, 3)]
        self.down_blocks = nn.ModuleList([nn.ModuleList(down)])
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock(width, width, time_dim), transformers()]) for _ in range(num_mid_blocks)
        )
        up = [CausalResnetBlock(2 * width, width, time_dim), transformers(), CausalConv1d(width, width, 3)]
        self.up_blocks = nn.ModuleList([nn.ModuleList(up)])
        self.final_block = CausalBlock(width, width)
        self.final_proj = nn.Conv1d(width, out_channels, 1)

    @staticmethod
    def _attend(x: Tensor, blocks: nn.ModuleList, bias: Tensor) -> Tensor:
        x = x.transpose(1, 2)
        for block in blocks:
            x = block(x, bias)
        return x.transpose(1, 2)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        """x, mu, cond: (B, 80, T); mask: (B, 1, T); t: (B,) (any float dtype); spks: (B, 80)."""
        temb = self.time_mlp(timestep_features(t.float(), self.in_channels).to(x.dtype))
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.size(2)), cond], dim=1)
        # Additive attention bias: 0 on real keys, -1e10 on padded ones (as upstream's mask_to_bias);
        # in fp16, whose range ends at 65504, -1e10 would become -inf (a row of only -inf is NaN),
        # so the most negative finite fp16 value instead.
        hidden = -min(1.0e10, torch.finfo(x.dtype).max)
        bias = torch.zeros_like(mask, dtype=x.dtype).masked_fill(mask == 0, hidden)[:, :, None, :]
        resnet, blocks, down = self.down_blocks[0]
        h = self._attend(resnet(h, mask, temb), blocks, bias)
        skip = h
        h = down(h * mask)
        for resnet, blocks in self.mid_blocks:
            h = self._attend(resnet(h, mask, temb), blocks, bias)
        resnet, blocks, up = self.up_blocks[0]
        h = self._attend(resnet(torch.cat([h[:, :, : skip.size(2)], skip], dim=1), mask, temb), blocks, bias)
        h = up(h * mask)
        h = self.final_block(h, mask)
        return self.final_proj(h * mask) * mask


class CausalMaskedDiffWithXvec(nn.Module):
    def __init__(
        self,
        encoder: UpsampleConformerEncoder,
        decoder: CausalConditionalCFM,
        input_size: int = 512,
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
        self.encoder = encoder
        self.encoder_proj = nn.Linear(encoder.after_norm.normalized_shape[0], output_size)
        self.decoder = decoder
        self._noise: Tensor | None = None

    def mel_frames(self, n_tokens: int) -> int:
        """Mel frames this flow makes from ``n_tokens`` speech tokens (a fixed ratio here; not so in v1)."""
        return self.token_mel_ratio * n_tokens

    def noise(self, frames: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Upstream's fixed starting noise, (1, 80, frames); past its 300 s, further seeded blocks."""
        blocks = max(1, math.ceil(frames / NOISE_FRAMES))
        if self._noise is None or self._noise.size(2) < blocks * NOISE_FRAMES:
            parts = []
            for k in range(blocks):
                gen = torch.Generator().manual_seed(NOISE_SEED + k)
                parts.append(torch.randn([1, self.output_size, NOISE_FRAMES], generator=gen))
            self._noise = torch.cat(parts, dim=2)
        return self._noise[:, :, :frames].to(device=device, dtype=dtype)

    @torch.inference_mode()
    def inference(self, items: Sequence[FlowInput], seeds: Sequence[int] | None = None) -> list[Tensor]:
        """Mel spectrograms (80, token_mel_ratio * T) of each item, prompt frames removed. ``seeds``
        is unused (every item starts from upstream's fixed noise); every family's flow takes it."""
        device = self.input_embedding.weight.device
        dtype = self.spk_embed_affine_layer.weight.dtype
        empty_tokens = torch.zeros(0, dtype=torch.long)
        empty_mel = torch.zeros(0, self.output_size)
        tokens, prompt_frames = [], []
        for item in items:
            prompt = item.prompt_tokens if item.prompt_tokens is not None else empty_tokens
            tokens.append(torch.cat([prompt.long().cpu(), item.tokens.long().cpu()]))
            prompt_frames.append(0 if item.prompt_mel is None else item.prompt_mel.size(0))
        lengths = torch.tensor([len(t) for t in tokens], device=device)
        padded = nn.utils.rnn.pad_sequence(tokens, batch_first=True).to(device)
        token_mask = length_mask(lengths, padded.size(1))

        spks = F.normalize(torch.stack([item.embedding.reshape(-1) for item in items]).to(device, dtype), dim=1)
        spks = self.spk_embed_affine_layer(spks)
        x = self.input_embedding(padded.clamp(0, self.vocab_size - 1)) * token_mask[..., None].to(dtype)
        h, mel_lengths = self.encoder(x, lengths)
        mu = self.encoder_proj(h).transpose(1, 2).contiguous()
        frames = mu.size(2)
        mask = length_mask(mel_lengths, frames)[:, None, :].to(dtype)
        cond = torch.zeros_like(mu)
        for i, item in enumerate(items):
            mel = item.prompt_mel if item.prompt_mel is not None else empty_mel
            cond[i, :, : mel.size(0)] = mel.to(device, dtype).t()
        z = self.noise(frames, device, torch.float32).expand(len(items), -1, -1)
        mel = self.decoder(z, mu, mask, spks, cond, self.n_timesteps)
        return [mel[i, :, prompt_frames[i] : int(mel_lengths[i])] for i in range(len(items))]


def build_flow(node: Call) -> CausalMaskedDiffWithXvec:
    """Construct the flow from the ``flow:`` section of cosyvoice2.yaml (parsed, never executed)."""
    flow = expect(node, "CausalMaskedDiffWithXvec", where="flow")
    enc = expect(flow.kwargs.get("encoder"), "UpsampleConformerEncoder", where="flow.encoder").kwargs
    cfm = expect(flow.kwargs.get("decoder"), "CausalConditionalCFM", where="flow.decoder")
    est = expect(cfm.kwargs.get("estimator"), "CausalConditionalDecoder", where="flow.decoder.estimator").kwargs
    params = cfm.kwargs.get("cfm_params")
    if isinstance(params, Call):  # !new:omegaconf.DictConfig {content: {...}}
        params = params.kwargs.get("content", params.kwargs)
    params = params or {}
    for key, want in (("input_layer", "linear"), ("pos_enc_layer_type", "rel_pos_espnet"),
                      ("selfattention_layer_type", "rel_selfattn"), ("normalize_before", True)):
        if enc.get(key, want) != want:
            raise ValueError(f"flow.encoder.{key}={enc[key]!r} is not supported (CosyVoice2 uses {want!r})")
    if enc.get("use_cnn_module", False) or enc.get("macaron_style", False):
        raise ValueError("flow.encoder with a conv module or macaron feed-forward is not supported")
    if params.get("solver", "euler") != "euler":
        raise ValueError(f"flow solver {params['solver']!r} is not supported")
    encoder = UpsampleConformerEncoder(
        input_size=int(enc.get("input_size", 512)),
        output_size=int(enc.get("output_size", 512)),
        attention_heads=int(enc.get("attention_heads", 8)),
        linear_units=int(enc.get("linear_units", 2048)),
        num_blocks=int(enc.get("num_blocks", 6)),
        pre_lookahead_len=int(flow.kwargs.get("pre_lookahead_len", 3)),
        key_bias=bool(enc.get("key_bias", True)),
    )
    estimator = CausalConditionalDecoder(
        in_channels=int(est.get("in_channels", 320)),
        out_channels=int(est.get("out_channels", 80)),
        channels=tuple(est.get("channels", (256,))),
        attention_head_dim=int(est.get("attention_head_dim", 64)),
        n_blocks=int(est.get("n_blocks", 4)),
        num_mid_blocks=int(est.get("num_mid_blocks", 12)),
        num_heads=int(est.get("num_heads", 8)),
        act_fn=str(est.get("act_fn", "gelu")),
    )
    decoder = CausalConditionalCFM(
        estimator,
        t_scheduler=str(params.get("t_scheduler", "cosine")),
        inference_cfg_rate=float(params.get("inference_cfg_rate", 0.7)),
    )
    return CausalMaskedDiffWithXvec(
        encoder,
        decoder,
        input_size=int(flow.kwargs.get("input_size", 512)),
        output_size=int(flow.kwargs.get("output_size", 80)),
        spk_embed_dim=int(flow.kwargs.get("spk_embed_dim", 192)),
        vocab_size=int(flow.kwargs.get("vocab_size", 6561)),
        token_mel_ratio=int(flow.kwargs.get("token_mel_ratio", 2)),
    )
