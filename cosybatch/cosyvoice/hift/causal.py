"""Fun-CosyVoice3's causal HiFT vocoder (mel -> 24 kHz audio), batch-native.

After upstream's ``CausalHiFTGenerator`` (FunAudioLLM/CosyVoice, Apache-2.0): a causal F0
predictor run in float64 (``CausalConvRNNF0Predictor``), an NSF harmonic source (``SineGen2``,
causal variant), HiFi-GAN upsampling [8, 5, 3] with causal convs, and an iSTFT head (n_fft 16,
hop 4): 480 samples per mel frame.

Parameter names and the weight-norm parametrisations are upstream's (``torch.nn.utils.
parametrizations.weight_norm``), so ``state_dict()`` has exactly upstream's keys and an official
``hift.pt`` loads strictly in either weight-norm key style (torch converts ``weight_g``/``weight_v``).

Batching: every convolution but three is left-causal, so padded frames never reach a real frame.
The three that read ahead (``conv_pre`` 4 frames, the F0 predictor's first conv 3 frames, the
source down-samplers within one frame) see zeros past each item's end as a lone item does,
because mels are zeroed there and the source spectrum reflects at each item's own end. F0 and
the integrated phase are held at each item's last frame (a lone run clamps there) and the iSTFT
overlap-adds and normalises over each item's own frames.

Randomness: the causal source draws no random numbers at run time. Upstream draws two tables at
construction, ``rand_ini`` [1, 9] and a uniform table [1, 300 * 24000, 9] (~260 MB), from the
global generator right after the flow's CFM reseeds it to 0; every call uses the table's first
samples. :class:`SourceTables` replays the generator from that seed through the same draws
(cheap: the flow's embedding and speaker affine, and the F0 predictor's init, then ``rand_ini``)
and draws only the prefix of the table that the longest item needs, growing it on demand (a
prefix of a CPU ``torch.rand`` draw equals a shorter draw from the same state). Every item reads
the same table from sample 0, so its noise does not depend on its batch partners. Upstream's
second table (``SourceModuleHnNSF.uv``) feeds an output upstream's inference discards; it is
not drawn.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from ..weights import load_state, load_strict
from ..yamlconf import Call, expect
from .generator import Snake

__all__ = [
    "CausalConvRNNF0Predictor",
    "CausalHiFTGenerator",
    "SourceTables",
    "build_hift_v3",
    "load_hift_v3",
    "table_draws",
    "upstream_keys",
]

SUPPORTED_SAMPLING_RATE = 24000
# Upstream's table sizes are literals, whatever the config: 9 columns (8 harmonics + F0) and 300 s at 24 kHz.
TABLE_COLUMNS = 9
TABLE_SAMPLES = 300 * 24000
TABLE_SEED = 0  # CausalConditionalCFM.__init__ calls set_all_random_seed(0)


# --------------------------------------------------------------------------------------------
# Causal convolutions (plain Conv1d weights, padded in forward)


class CausalConv1d(nn.Conv1d):
    """Stride-1 conv padded with zeros on the left (``causal_type='left'``) or on the right (reads ahead)."""

    def __init__(self, cin: int, cout: int, kernel_size: int, dilation: int = 1, causal_type: str = "left"):
        super().__init__(cin, cout, kernel_size, dilation=dilation)
        if causal_type not in ("left", "right"):
            raise ValueError(f"causal_type {causal_type!r}")
        # Upstream's formula: (k - 1) * d for odd k, one more frame for even k.
        self.causal_padding = int((kernel_size * dilation - dilation) / 2) * 2 + (kernel_size + 1) % 2
        self.causal_type = causal_type

    def forward(self, x: Tensor) -> Tensor:
        pad = (self.causal_padding, 0) if self.causal_type == "left" else (0, self.causal_padding)
        return super().forward(F.pad(x, pad))


class CausalConv1dDownSample(nn.Conv1d):
    """Strided conv with ``stride - 1`` zeros on the left (each output reads one stride ahead)."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int):
        super().__init__(cin, cout, kernel_size, stride)
        self.causal_padding = stride - 1

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.causal_padding, 0)))


class CausalConv1dUpsample(nn.Conv1d):
    """Nearest-neighbour upsampling by ``stride``, then a left-causal conv."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int):
        super().__init__(cin, cout, kernel_size)
        self.stride_up = stride
        self.causal_padding = kernel_size - 1

    def forward(self, x: Tensor) -> Tensor:
        x = F.interpolate(x, scale_factor=float(self.stride_up), mode="nearest")
        return super().forward(F.pad(x, (self.causal_padding, 0)))


class CausalResBlock(nn.Module):
    """HiFi-GAN residual block with left-causal dilated convs and Snake activations."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(CausalConv1d(channels, channels, kernel_size, dilation=d)) for d in dilations
        )
        self.convs2 = nn.ModuleList(weight_norm(CausalConv1d(channels, channels, kernel_size)) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        for act1, conv1, act2, conv2 in zip(
            self.activations1, self.convs1, self.activations2, self.convs2, strict=True
        ):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


# --------------------------------------------------------------------------------------------
# F0 predictor


class CausalConvRNNF0Predictor(nn.Module):
    """Mel -> F0 in Hz: a conv reading 3 frames ahead, four left-causal convs (ELU each), a linear head, abs.

    Runs in float64 from the float32 weights, as upstream's inference does (it moves the predictor to
    float64: "f0_predictor precision is crucial for causal inference").
    """

    def __init__(self, num_class: int = 1, in_channels: int = 80, cond_channels: int = 512):
        super().__init__()
        if num_class != 1:
            raise ValueError(f"the F0 predictor must have num_class=1 (one F0 value per frame), got {num_class}")
        layers: list[nn.Module] = [weight_norm(CausalConv1d(in_channels, cond_channels, 4, causal_type="right"))]
        layers.append(nn.ELU())
        for _ in range(4):
            layers += [weight_norm(CausalConv1d(cond_channels, cond_channels, 3)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: Tensor) -> Tensor:
        """(B, in_channels, T) mel, zero past each item's end -> (B, T) F0 in the mel's dtype."""
        x = mel.to(torch.float64)
        for layer in self.condnet:
            if isinstance(layer, CausalConv1d):
                # What upstream's parametrisation computes after .to(float64): the norm of the float64 weights.
                weights = layer.parametrizations.weight
                weight = torch._weight_norm(weights.original1.double(), weights.original0.double(), 0)
                pad = (layer.causal_padding, 0) if layer.causal_type == "left" else (0, layer.causal_padding)
                x = F.conv1d(F.pad(x, pad), weight, layer.bias.double(), dilation=layer.dilation)
            else:
                x = layer(x)
        f0 = F.linear(x.transpose(1, 2), self.classifier.weight.double(), self.classifier.bias.double())
        return f0.squeeze(-1).abs().to(mel.dtype)


# --------------------------------------------------------------------------------------------
# Random tables


def table_draws(flow: Call | None = None, f0_predictor: Call | Mapping[str, Any] | None = None) -> list[tuple]:
    """The global-RNG draws upstream makes between the CFM's reseed and ``SineGen2``'s tables.

    ``(kind, shape)`` in order: the CFM's noise, the flow's embedding and speaker affine (their
    default init), the F0 predictor's convs and head. ``flow`` is the yaml's ``flow:`` node (None:
    Fun-CosyVoice3-0.5B's sizes); ``f0_predictor`` the HiFT's ``f0_predictor`` node or kwargs.
    """
    fk = flow.kwargs if isinstance(flow, Call) else {}
    vocab = int(fk.get("vocab_size", 6561))
    input_size = int(fk.get("input_size", 80))
    spk = int(fk.get("spk_embed_dim", 192))
    out = int(fk.get("output_size", 80))
    pk = f0_predictor.kwargs if isinstance(f0_predictor, Call) else dict(f0_predictor or {})
    cin = int(pk.get("in_channels", 80))
    cond = int(pk.get("cond_channels", 512))
    classes = int(pk.get("num_class", 1))
    draws: list[tuple] = [("normal", (1, 80, 50 * 300))]
    draws += [("normal", (vocab, input_size)), ("uniform", (out, spk)), ("uniform", (out,))]
    draws += [("uniform", (cond, cin, 4)), ("uniform", (cond,))]
    for _ in range(4):
        draws += [("uniform", (cond, cond, 3)), ("uniform", (cond,))]
    draws += [("uniform", (classes, cond)), ("uniform", (classes,))]
    return draws


class SourceTables:
    """Upstream's ``rand_ini`` and the prefix of its sine-noise table, replayed from the same generator stream."""

    def __init__(self, draws: Sequence[tuple]):
        gen = torch.Generator().manual_seed(TABLE_SEED)
        for kind, shape in draws:
            buf = torch.empty(shape)
            if kind == "normal":
                buf.normal_(generator=gen)
            elif kind == "uniform":
                buf.uniform_(generator=gen)
            else:
                raise ValueError(f"unknown draw kind {kind!r}")
        rand_ini = torch.rand(1, TABLE_COLUMNS, generator=gen)
        rand_ini[:, 0] = 0
        self.rand_ini = rand_ini  # (1, 9)
        self._state = gen.get_state()  # right before the sine table
        self._table = torch.zeros(0, TABLE_COLUMNS)
        self._on_device: dict[torch.device, Tensor] = {}

    def sine_noise(self, samples: int, device: torch.device) -> Tensor:
        """The table's first ``samples`` rows (samples, 9) on ``device``.

        Past upstream's 300 s the stream simply continues (upstream cannot vocode that long).
        """
        if self._table.size(0) < samples:
            # Grow in whole 10 s blocks so a run of slightly longer batches redraws rarely.
            block = 10 * SUPPORTED_SAMPLING_RATE
            rows = math.ceil(samples / block) * block
            gen = torch.Generator()
            gen.set_state(self._state)
            self._table = torch.rand(rows, TABLE_COLUMNS, generator=gen)
            self._on_device.clear()
        cached = self._on_device.get(device)
        if cached is None or cached.size(0) < samples:
            cached = self._table.to(device)
            self._on_device[device] = cached
        return cached[:samples]


# --------------------------------------------------------------------------------------------
# Source


class SourceModuleHnNSF(nn.Module):
    """Harmonic source: F0 harmonics (phase integrated at frame rate) plus table noise, merged by ``l_linear``."""

    def __init__(
        self, sampling_rate: int, upsample_scale: int, harmonic_num: int, sine_amp: float, noise_std: float,
        voiced_threshold: float,
    ):
        super().__init__()
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.dim = harmonic_num + 1
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.l_linear = nn.Linear(self.dim, 1)

    def forward(self, f0: Tensor, lengths: Tensor, tables: SourceTables) -> Tensor:
        """(B, T) frame F0 (any values past each item's end) -> (B, 1, T * upsample_scale) excitation."""
        frames = f0.size(1)
        # Hold each item's last frame: nearest upsampling of a lone item clamps there.
        last = torch.minimum(torch.arange(frames, device=f0.device)[None, :], (lengths - 1)[:, None])
        f0 = torch.gather(f0, 1, last)
        f0_up = F.interpolate(f0[:, None], scale_factor=float(self.upsample_scale), mode="nearest").transpose(1, 2)
        samples = f0_up.size(1)
        harmonics = torch.arange(1, self.dim + 1, device=f0.device, dtype=f0.dtype)[None, None, :]
        # Upstream's layout (B, N, dim) and order of operations, so the float results are the same.
        rad = (f0_up * harmonics / self.sampling_rate) % 1
        rad[:, 0, :] = rad[:, 0, :] + tables.rand_ini.to(rad.device, rad.dtype)
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / self.upsample_scale, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi
        phase = torch.gather(phase, 1, last[:, :, None].expand(-1, -1, self.dim))
        phase = F.interpolate(
            phase.transpose(1, 2) * self.upsample_scale, scale_factor=float(self.upsample_scale), mode="nearest"
        ).transpose(1, 2)
        sines = torch.sin(phase) * self.sine_amp
        uv = (f0_up > self.voiced_threshold).to(f0.dtype)
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        noise = noise_amp * tables.sine_noise(samples, f0.device).to(f0.dtype)[None]
        waves = sines * uv + noise
        return torch.tanh(self.l_linear(waves)).transpose(1, 2)


# --------------------------------------------------------------------------------------------
# Generator


def _mask(counts: Tensor, size: int) -> Tensor:
    """(B, size) bool, True on each item's first ``counts[b]`` positions."""
    return torch.arange(size, device=counts.device)[None, :] < counts[:, None]


class CausalHiFTGenerator(nn.Module):
    """Fun-CosyVoice3's vocoder with a padded-batch forward pass; keyword arguments as in cosyvoice3.yaml."""

    def __init__(
        self,
        in_channels: int = 80,
        base_channels: int = 512,
        nb_harmonics: int = 8,
        sampling_rate: int = 24000,
        nsf_alpha: float = 0.1,
        nsf_sigma: float = 0.003,
        nsf_voiced_threshold: float = 10,
        upsample_rates: Sequence[int] = (8, 5, 3),
        upsample_kernel_sizes: Sequence[int] = (16, 11, 7),
        istft_params: Mapping[str, int] | None = None,
        resblock_kernel_sizes: Sequence[int] = (3, 7, 11),
        resblock_dilation_sizes: Sequence[Sequence[int]] = ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
        source_resblock_kernel_sizes: Sequence[int] = (7, 7, 11),
        source_resblock_dilation_sizes: Sequence[Sequence[int]] = ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
        lrelu_slope: float = 0.1,
        audio_limit: float = 0.99,
        conv_pre_look_right: int = 4,
        f0_predictor: Mapping[str, int] | CausalConvRNNF0Predictor | None = None,
        draws: Sequence[tuple] | None = None,
    ):
        super().__init__()
        if sampling_rate != SUPPORTED_SAMPLING_RATE:
            raise ValueError(f"the causal HiFT supports {SUPPORTED_SAMPLING_RATE} Hz only, got {sampling_rate}")
        if nb_harmonics + 1 != TABLE_COLUMNS:
            raise ValueError(
                f"nb_harmonics must be {TABLE_COLUMNS - 1}: upstream's noise table has {TABLE_COLUMNS} columns"
            )
        istft = dict(istft_params) if istft_params is not None else {"n_fft": 16, "hop_len": 4}
        self.n_fft = int(istft["n_fft"])
        self.hop = int(istft["hop_len"])
        self.in_channels = in_channels
        self.sampling_rate = sampling_rate
        self.upsample_rates = [int(r) for r in upsample_rates]
        self.samples_per_frame = math.prod(self.upsample_rates) * self.hop
        self.num_kernels = len(resblock_kernel_sizes)
        self.lrelu_slope = lrelu_slope
        self.audio_limit = audio_limit
        self.conv_pre_look_right = conv_pre_look_right

        self.m_source = SourceModuleHnNSF(
            sampling_rate, self.samples_per_frame, nb_harmonics, nsf_alpha, nsf_sigma, nsf_voiced_threshold
        )
        self.conv_pre = weight_norm(
            CausalConv1d(in_channels, base_channels, conv_pre_look_right + 1, causal_type="right")
        )
        self.ups = nn.ModuleList(
            weight_norm(CausalConv1dUpsample(base_channels >> i, base_channels >> (i + 1), k, u))
            for i, (u, k) in enumerate(zip(self.upsample_rates, upsample_kernel_sizes, strict=True))
        )
        spec_channels = self.n_fft + 2
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        stages = zip(source_resblock_kernel_sizes, source_resblock_dilation_sizes, strict=True)
        for i, (kernel, dilations) in enumerate(stages):
            channels = base_channels >> (i + 1)
            # The source spectrum is at the final frame rate; bring it down to stage i's rate.
            stride = math.prod(self.upsample_rates[i + 1 :])
            if stride == 1:
                self.source_downs.append(CausalConv1d(spec_channels, channels, 1))
            else:
                self.source_downs.append(CausalConv1dDownSample(spec_channels, channels, stride * 2, stride))
            self.source_resblocks.append(CausalResBlock(channels, kernel, dilations))
        self.resblocks = nn.ModuleList()
        for i in range(len(self.ups)):
            for kernel, dilations in zip(resblock_kernel_sizes, resblock_dilation_sizes, strict=True):
                self.resblocks.append(CausalResBlock(base_channels >> (i + 1), kernel, dilations))
        self.conv_post = weight_norm(CausalConv1d(base_channels >> len(self.ups), spec_channels, 7))
        if isinstance(f0_predictor, CausalConvRNNF0Predictor):
            self.f0_predictor = f0_predictor
            f0_kwargs: dict[str, Any] = {
                "in_channels": f0_predictor.condnet[0].in_channels,
                "cond_channels": f0_predictor.condnet[0].out_channels,
                "num_class": f0_predictor.classifier.out_features,
            }
        else:
            f0_kwargs = dict(f0_predictor or {})
            self.f0_predictor = CausalConvRNNF0Predictor(**f0_kwargs)
        window = torch.hann_window(self.n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("stft_window", window, persistent=False)
        self._draws = list(draws) if draws is not None else table_draws(None, f0_kwargs)
        self._tables: SourceTables | None = None

    @property
    def tables(self) -> SourceTables:
        """The replayed random tables, built on first use."""
        if self._tables is None:
            self._tables = SourceTables(self._draws)
        return self._tables

    # -- source spectrum ---------------------------------------------------------------------

    def _source_spectrum(self, source: Tensor, samples: Tensor) -> Tensor:
        """(B, N) excitation -> (B, n_fft + 2, N / hop + 1) STFT, reflect-padded at each item's own end."""
        half = self.n_fft // 2
        positions = torch.arange(source.size(1) + 2 * half, device=source.device)[None, :] - half
        ends = samples[:, None]
        index = torch.where(positions < 0, -positions, positions)
        index = torch.where(index >= ends, 2 * (ends - 1) - index, index)
        valid = positions < ends + half
        padded = torch.gather(source, 1, torch.where(valid, index, 0)) * valid.to(source.dtype)
        spec = torch.stft(
            padded, self.n_fft, self.hop, self.n_fft, window=self.stft_window, center=False, return_complex=True
        )
        spec = torch.view_as_real(spec)
        return torch.cat([spec[..., 0], spec[..., 1]], dim=1)

    # -- inverse STFT ------------------------------------------------------------------------

    def _istft(self, x: Tensor, frame_counts: Tensor, samples: Tensor) -> Tensor:
        """conv_post output (B, n_fft + 2, F) -> (B, hop * (F - 1)) audio, each item over its own frames."""
        bins = self.n_fft // 2 + 1
        magnitude = torch.clip(torch.exp(x[:, :bins]), max=1e2)
        phase = torch.sin(x[:, bins:])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        frame_mask = _mask(frame_counts, x.size(2))[:, :, None].to(x.dtype)  # (B, F, 1)
        # Laid out and overlap-added as torch.istft does (irfft on the last dim, unfold_backward), so a
        # lone item comes out bit-identical to upstream's torch.istft; masked frames add exact zeros.
        frames = torch.fft.irfft(spec.transpose(1, 2), n=self.n_fft, dim=-1) * self.stft_window * frame_mask
        envelope = (self.stft_window.pow(2) * frame_mask).expand(-1, x.size(2), -1)
        length = self.n_fft + self.hop * (x.size(2) - 1)

        def overlap_add(cols: Tensor) -> Tensor:
            return torch.ops.aten.unfold_backward(cols, [cols.size(0), length], 1, self.n_fft, self.hop)

        start = self.n_fft // 2
        total = self.hop * (x.size(2) - 1)
        audio = overlap_add(frames)[:, start : start + total]
        envelope = overlap_add(envelope)[:, start : start + total]
        inside = _mask(samples, total)
        return torch.where(inside, audio / torch.where(inside, envelope, 1.0), 0.0)

    # -- forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, mel: Tensor, lengths: Tensor, generators: Sequence[torch.Generator] | None = None):
        """Vocode a padded batch: (B, in_channels, T) mel and (B,) frame counts.

        Returns (B, T * samples_per_frame) audio, zero past each item's end, and the (B,) sample counts.
        ``generators`` is accepted for the CosyVoice2 vocoder's interface and ignored: this source draws
        nothing at run time.
        """
        if mel.dim() != 3 or mel.size(1) != self.in_channels:
            raise ValueError(f"mel must be (B, {self.in_channels}, T), got {tuple(mel.shape)}")
        batch, _, frames = mel.shape
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=mel.device)
        if lengths.shape != (batch,):
            raise ValueError(f"lengths must have shape ({batch},), got {tuple(lengths.shape)}")
        if batch and (int(lengths.min()) < 1 or int(lengths.max()) > frames):
            raise ValueError(f"lengths must lie in [1, {frames}], got {lengths.tolist()}")
        dtype = self.conv_pre.parametrizations.weight.original1.dtype
        mel = mel.to(dtype) * _mask(lengths, frames)[:, None, :].to(dtype)
        samples = lengths * self.samples_per_frame

        with parametrize.cached():
            f0 = self.f0_predictor(mel)
            source = self.m_source(f0, lengths, self.tables)[:, 0]
            spec = self._source_spectrum(source, samples)
            x = self.conv_pre(mel)
            for i, up in enumerate(self.ups):
                x = up(F.leaky_relu(x, self.lrelu_slope))
                if i == len(self.ups) - 1:
                    x = F.pad(x, (1, 0), mode="reflect")
                x = x + self.source_resblocks[i](self.source_downs[i](spec))
                blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
                x = sum(block(x) for block in blocks) / self.num_kernels
            x = self.conv_post(F.leaky_relu(x))
        audio = self._istft(x, samples // self.hop + 1, samples)
        return audio.clamp(-self.audio_limit, self.audio_limit), samples

    def load_checkpoint(self, state: Mapping[str, Tensor], path: str | Path) -> CausalHiFTGenerator:
        """Load a ``hift.pt`` state (either weight-norm key style, optional ``generator.`` prefix) strictly.

        Raises :class:`~cosybatch.cosyvoice.weights.ModelDirError` naming missing, unexpected or mis-shaped keys.
        """
        load_strict(self, upstream_keys(state), Path(path))
        return self

    def vocode(self, mels: Sequence[Tensor], seeds: Sequence[int] | None = None) -> list[Tensor]:
        """Vocode (in_channels, L_i) mels; ``seeds`` is ignored (no run-time randomness)."""
        if not mels:
            return []
        device = self.conv_pre.parametrizations.weight.original1.device
        lengths = torch.tensor([m.size(-1) for m in mels], device=device)
        batch = mels[0].new_zeros(len(mels), self.in_channels, int(lengths.max()), device=device)
        for i, m in enumerate(mels):
            batch[i, :, : m.size(-1)] = m
        audio, samples = self(batch, lengths)
        return [a[:n] for a, n in zip(audio, samples.tolist(), strict=True)]


def build_hift_v3(node: Call, flow: Call | None = None) -> CausalHiFTGenerator:
    """Construct the vocoder from the ``hift:`` section of cosyvoice3.yaml (parsed, never executed).

    ``flow`` is the same file's ``flow:`` node: its sizes decide how far upstream's generator has
    advanced when the noise tables are drawn. Without it, Fun-CosyVoice3-0.5B's sizes are assumed
    (right for the official folder; a folder with other flow sizes needs it for upstream's noise).
    """
    hift = expect(node, "CausalHiFTGenerator", where="hift")
    params = dict(hift.kwargs)
    f0 = params.get("f0_predictor")
    f0_kwargs: dict[str, Any] = {}
    if isinstance(f0, Call):
        f0_kwargs = dict(expect(f0, "CausalConvRNNF0Predictor", where="hift.f0_predictor").kwargs)
    elif isinstance(f0, Mapping):
        f0_kwargs = dict(f0)
    params["f0_predictor"] = f0_kwargs
    params["draws"] = table_draws(flow, f0_kwargs)
    return CausalHiFTGenerator(**params)


def upstream_keys(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A hift.pt state in the module's key layout: ``generator.`` prefix stripped (as upstream's loader
    does) and old-style ``weight_g``/``weight_v`` renamed to torch's ``parametrizations.weight.original0/1``."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        key = key.removeprefix("generator.")
        for old, new in ((".weight_g", ".parametrizations.weight.original0"),
                         (".weight_v", ".parametrizations.weight.original1")):
            if key.endswith(old):
                key = key[: -len(old)] + new
        out[key] = value
    return out


def load_hift_v3(module: CausalHiFTGenerator, path: str | Path) -> CausalHiFTGenerator:
    """Load a v3 ``hift.pt`` (either weight-norm key style) into ``module`` with strict key and shape checks.

    Raises :class:`~cosybatch.cosyvoice.weights.ModelDirError` naming missing, unexpected or mis-shaped keys.
    """
    return module.load_checkpoint(load_state(Path(path)), path)
