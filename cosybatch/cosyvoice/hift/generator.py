"""Batch-native HiFT vocoder (CosyVoice2, CosyVoice-300M): NSF harmonic source, HiFi-GAN upsampling, iSTFT head.

The maths follows upstream's ``HiFTGenerator`` (Apache-2.0) so that its ``hift.pt`` loads unchanged, but the
forward pass takes a padded batch. Every item comes out as it would when vocoded on its own:

* each layer that can write into padded frames is followed by a multiply with that resolution's time mask, so
  every convolution sees the same zeros at an item's end that zero padding gives a single-item run;
* the harmonic phase is held at each item's last frame before it is upsampled (a single-item run clamps there);
* the source STFT reflects each item's own last samples, and the iSTFT normalises by each item's own window
  envelope;
* random numbers come from one ``torch.Generator`` per item, drawn in the order and shapes of a single-item run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..yamlconf import Call, expect

__all__ = ["HiFT", "HiFTF0Predictor", "build_hift", "load_hift_state"]

# Upstream picks the harmonic source by sampling rate: CosyVoice-300M's 22,050 Hz vocoder keeps the first
# ``SineGen`` (phase integrated per sample), every other rate uses ``SineGen2`` (phase integrated per frame).
SAMPLE_RATE_SOURCE_HZ = 22050
SUPPORTED_SAMPLING_RATES = (22050, 24000)
SUPPORTED_SAMPLING_RATE = 24000  # CosyVoice2's; kept for callers that name it


def _time_mask(counts: Tensor, size: int, dtype: torch.dtype) -> Tensor:
    """A (B, 1, size) mask that is 1 on each item's first ``counts[b]`` frames and 0 after."""
    steps = torch.arange(size, device=counts.device)
    return (steps[None, :] < counts[:, None]).to(dtype).unsqueeze(1)


class Snake(nn.Module):
    """Periodic activation ``x + sin(alpha * x)^2 / alpha`` with one ``alpha`` per channel (linear scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class MaskedResBlock(nn.Module):
    """HiFi-GAN residual block (Snake, dilated conv, Snake, conv, skip) that keeps padded frames at zero."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int]) -> None:
        super().__init__()

        def conv(dilation: int) -> nn.Conv1d:
            return nn.Conv1d(
                channels, channels, kernel_size, dilation=dilation, padding=dilation * (kernel_size - 1) // 2
            )

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        for act1, conv1, act2, conv2 in zip(
            self.activations1, self.convs1, self.activations2, self.convs2, strict=True
        ):
            y = conv1(act1(x)) * mask
            y = conv2(act2(y)) * mask
            x = x + y
        return x


class HiFTF0Predictor(nn.Module):
    """Mel to F0 in Hz: five (conv k=3, ELU) layers and a linear head, absolute value of the output."""

    def __init__(self, num_class: int = 1, in_channels: int = 80, cond_channels: int = 512) -> None:
        super().__init__()
        if num_class != 1:
            raise ValueError(f"the F0 predictor must have num_class=1 (one F0 value per frame), got {num_class}")
        layers: list[nn.Module] = []
        for index in range(5):
            layers += [nn.Conv1d(in_channels if index == 0 else cond_channels, cond_channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: Tensor, mask: Tensor) -> Tensor:
        """(B, in_channels, T) mel and (B, 1, T) mask -> (B, T) F0, zero on padded frames."""
        x = mel
        for layer in self.condnet:
            x = layer(x)
            if isinstance(layer, nn.Conv1d):
                x = x * mask
        f0 = self.classifier(x.transpose(1, 2)).squeeze(-1).abs()
        return f0 * mask[:, 0]


class HarmonicSource(nn.Module):
    """NSF source for 24 kHz: F0 harmonics plus noise, merged to one excitation channel by ``l_linear``."""

    def __init__(
        self, sampling_rate: int, upsample: int, harmonics: int, sine_amp: float, noise_std: float, threshold: float
    ) -> None:
        super().__init__()
        self.sampling_rate = sampling_rate
        self.upsample = upsample
        self.dim = harmonics + 1
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.threshold = threshold
        self.l_linear = nn.Linear(self.dim, 1)

    def _draw_noise(
        self, lengths: list[int], generators: Sequence[torch.Generator], like: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Per-item initial phases (B, dim) and Gaussian noise (B, dim, N), zero past each item's samples."""
        batch, _, total = like.shape
        phases = like.new_zeros(batch, self.dim)
        noise = like.new_zeros(batch, self.dim, total)
        for index, (frames, gen) in enumerate(zip(lengths, generators, strict=True)):
            # A single-item run draws rand(1, dim), then randn_like of its (1, samples, dim) sines. Those are a
            # transposed view of a (1, dim, samples) buffer and randn_like keeps the strides; the sampler's
            # output depends on that layout (a non-contiguous tensor is filled element by element), so the
            # noise is drawn into the same transposed view.
            ini = torch.rand(1, self.dim, generator=gen, device=gen.device)
            gauss = torch.empty(1, self.dim, frames * self.upsample, device=gen.device).transpose(1, 2)
            gauss.normal_(generator=gen)
            phases[index] = ini[0].to(like.device, like.dtype)
            noise[index, :, : frames * self.upsample] = gauss[0].T.to(like.device, like.dtype)
        phases[:, 0] = 0
        return phases, noise

    def forward(self, f0: Tensor, lengths: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
        """(B, T) frame F0 -> (B, 1, T * upsample) excitation; samples past an item's end are not meaningful."""
        frames = f0.shape[-1]
        f0_up = F.interpolate(f0[:, None], scale_factor=float(self.upsample), mode="nearest")  # (B, 1, N)
        harmonic_index = torch.arange(1, self.dim + 1, device=f0.device, dtype=f0.dtype)[None, :, None]
        rad = (f0_up * harmonic_index / self.sampling_rate) % 1  # (B, dim, N)
        ini, noise = self._draw_noise(lengths.tolist(), generators, rad)
        rad[:, :, 0] = rad[:, :, 0] + ini

        # Integrate the phase at frame rate, then interpolate back up to sample rate.
        rad_frames = F.interpolate(rad, scale_factor=1 / self.upsample, mode="linear")
        phase = torch.cumsum(rad_frames, dim=-1) * 2 * math.pi
        # Hold each item's last frame so the upsampling clamps at the item's end, not at the batch's.
        last = torch.minimum(torch.arange(frames, device=f0.device)[None, :], (lengths - 1)[:, None])
        phase = torch.gather(phase, 2, last[:, None, :].expand(-1, self.dim, -1))
        phase = F.interpolate(phase * self.upsample, scale_factor=float(self.upsample), mode="linear")
        sines = torch.sin(phase) * self.sine_amp

        uv = (f0_up > self.threshold).to(f0.dtype)
        noise = (uv * self.noise_std + (1 - uv) * self.sine_amp / 3) * noise
        excitation = sines * uv + noise
        return torch.tanh(self.l_linear(excitation.transpose(1, 2))).transpose(1, 2)


class SampleSineSource(HarmonicSource):
    """NSF source of the 22,050 Hz vocoder (upstream's first ``SineGen``): the phase is integrated per sample.

    The phase is ``2 pi (cumsum(f0 k / sr) mod 1)`` over the whole utterance in float32, as upstream computes it;
    a running sum over tens of thousands of samples is sensitive to the order of additions, so it is taken over
    each padded row exactly as over a lone item (a row's prefix sums do not depend on what follows them).
    Random draws per item, in the order and shapes of a single-item run: the initial phases
    ``Uniform(-pi, pi)`` as (1, dim, 1), then the Gaussian noise as (1, dim, samples). Upstream then draws one
    more (unused) tensor; each generator here serves one item once, so that draw is skipped.
    """

    def _draw_noise(
        self, lengths: list[int], generators: Sequence[torch.Generator], like: Tensor
    ) -> tuple[Tensor, Tensor]:
        batch, _, total = like.shape
        phases = like.new_zeros(batch, self.dim, 1)
        noise = like.new_zeros(batch, self.dim, total)
        # torch.distributions.Uniform(-pi, pi).sample: low + rand * (high - low), all in float32.
        low = torch.tensor(-math.pi)
        span = torch.tensor(math.pi) - low
        for index, (frames, gen) in enumerate(zip(lengths, generators, strict=True)):
            ini = low + torch.rand(1, self.dim, 1, generator=gen, device=gen.device) * span.to(gen.device)
            gauss = torch.randn(1, self.dim, frames * self.upsample, generator=gen, device=gen.device)
            phases[index] = ini[0].to(like.device, like.dtype)
            noise[index, :, : frames * self.upsample] = gauss[0].to(like.device, like.dtype)
        phases[:, 0] = 0
        return phases, noise

    def forward(self, f0: Tensor, lengths: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
        """(B, T) frame F0 -> (B, 1, T * upsample) excitation; samples past an item's end are not meaningful."""
        f0_up = F.interpolate(f0[:, None], scale_factor=float(self.upsample), mode="nearest")  # (B, 1, N)
        harmonic_index = torch.arange(1, self.dim + 1, device=f0.device, dtype=f0.dtype)[None, :, None]
        step = f0_up * harmonic_index / self.sampling_rate  # (B, dim, N), cycles per sample
        theta = 2 * math.pi * (torch.cumsum(step, dim=-1) % 1)
        phases, noise = self._draw_noise(lengths.tolist(), generators, step)
        sines = self.sine_amp * torch.sin(theta + phases)
        uv = (f0_up > self.threshold).to(f0.dtype)
        noise = (uv * self.noise_std + (1 - uv) * self.sine_amp / 3) * noise
        excitation = sines * uv + noise
        return torch.tanh(self.l_linear(excitation.transpose(1, 2))).transpose(1, 2)


class HiFT(nn.Module):
    """Upstream's HiFTNet vocoder with a padded-batch forward pass.

    The keyword arguments are those of the ``hift:`` section of ``cosyvoice2.yaml`` or ``cosyvoice.yaml``;
    ``f0_predictor`` is the keyword dict of its F0 predictor (or a ready :class:`HiFTF0Predictor`). Parameter
    names match upstream's ``HiFTGenerator`` after weight norm is folded; load official weights with
    :func:`load_hift_state`. A 22,050 Hz vocoder (CosyVoice-300M) gets upstream's first ``SineGen`` source
    (:class:`SampleSineSource`), a 24,000 Hz one (CosyVoice2) the ``SineGen2`` one, as upstream chooses.
    """

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
        f0_predictor: Mapping[str, int] | HiFTF0Predictor | None = None,
    ) -> None:
        super().__init__()
        if sampling_rate not in SUPPORTED_SAMPLING_RATES:
            raise ValueError(
                "HiFT supports the 22050 Hz CosyVoice-300M vocoder (SineGen source) and the 24000 Hz CosyVoice2 one "
                f"(SineGen2 source), got sampling_rate={sampling_rate}"
            )
        istft = dict(istft_params) if istft_params is not None else {"n_fft": 16, "hop_len": 4}
        self.n_fft = int(istft["n_fft"])
        self.hop = int(istft["hop_len"])
        self.in_channels = in_channels
        self.sampling_rate = sampling_rate
        self.upsample_rates = [int(r) for r in upsample_rates]
        self.frame_scales = [math.prod(self.upsample_rates[: i + 1]) for i in range(len(self.upsample_rates))]
        self.samples_per_frame = self.frame_scales[-1] * self.hop
        self.num_kernels = len(resblock_kernel_sizes)
        self.lrelu_slope = lrelu_slope
        self.audio_limit = audio_limit

        source = SampleSineSource if sampling_rate == SAMPLE_RATE_SOURCE_HZ else HarmonicSource
        self.m_source = source(
            sampling_rate, self.samples_per_frame, nb_harmonics, nsf_alpha, nsf_sigma, nsf_voiced_threshold
        )
        self.conv_pre = nn.Conv1d(in_channels, base_channels, 7, padding=3)
        self.ups = nn.ModuleList()
        for i, (rate, kernel) in enumerate(zip(self.upsample_rates, upsample_kernel_sizes, strict=True)):
            self.ups.append(
                nn.ConvTranspose1d(
                    base_channels >> i, base_channels >> (i + 1), kernel, rate, padding=(kernel - rate) // 2
                )
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
                self.source_downs.append(nn.Conv1d(spec_channels, channels, 1))
            else:
                self.source_downs.append(nn.Conv1d(spec_channels, channels, 2 * stride, stride, padding=stride // 2))
            self.source_resblocks.append(MaskedResBlock(channels, kernel, dilations))

        self.resblocks = nn.ModuleList()
        for i in range(len(self.ups)):
            for kernel, dilations in zip(resblock_kernel_sizes, resblock_dilation_sizes, strict=True):
                self.resblocks.append(MaskedResBlock(base_channels >> (i + 1), kernel, dilations))
        self.conv_post = nn.Conv1d(base_channels >> len(self.ups), spec_channels, 7, padding=3)

        if isinstance(f0_predictor, HiFTF0Predictor):
            self.f0_predictor = f0_predictor
        else:
            self.f0_predictor = HiFTF0Predictor(**(f0_predictor or {}))
        window = torch.hann_window(self.n_fft, periodic=True, dtype=torch.float64).float()
        self.register_buffer("window", window, persistent=False)

    # -- source spectrum -----------------------------------------------------------------------------------

    def _source_spectrum(self, source: Tensor, samples: Tensor, frames: int) -> Tensor:
        """(B, N) excitation -> (B, n_fft + 2, frames) real/imag STFT with each item's own reflect padding."""
        half = self.n_fft // 2
        positions = torch.arange(source.shape[-1] + 2 * half, device=source.device)[None, :] - half
        ends = samples[:, None]
        index = torch.where(positions < 0, -positions, positions)
        index = torch.where(index >= ends, 2 * (ends - 1) - index, index)
        valid = positions < ends + half
        padded = torch.gather(source, 1, torch.where(valid, index, 0)) * valid.to(source.dtype)
        spec = torch.stft(
            padded, self.n_fft, self.hop, self.n_fft, window=self.window, center=False, return_complex=True
        )
        spec = torch.view_as_real(spec)
        spec = torch.cat([spec[..., 0], spec[..., 1]], dim=1)
        return spec[..., :frames]

    # -- inverse STFT --------------------------------------------------------------------------------------

    def _istft(self, x: Tensor, frame_mask: Tensor, samples: Tensor, total: int) -> Tensor:
        """conv_post output (B, n_fft + 2, F) -> (B, total) audio, overlap-added over each item's frames only."""
        bins = self.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :bins]).clamp(max=1e2)
        phase = torch.sin(x[:, bins:])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        frames = torch.fft.irfft(spec, n=self.n_fft, dim=1) * self.window[None, :, None] * frame_mask
        envelope = self.window.pow(2)[None, :, None] * frame_mask
        length = self.n_fft + self.hop * (x.shape[-1] - 1)

        def overlap_add(cols: Tensor) -> Tensor:
            return F.fold(cols, (1, length), (1, self.n_fft), stride=(1, self.hop))[:, 0, 0]

        start = self.n_fft // 2
        audio = overlap_add(frames)[:, start : start + total]
        envelope = overlap_add(envelope)[:, start : start + total]
        inside = _time_mask(samples, total, torch.bool)[:, 0]
        return torch.where(inside, audio / torch.where(inside, envelope, 1.0), 0.0)

    # -- forward -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, mel: Tensor, lengths: Tensor, generators: Sequence[torch.Generator]) -> tuple[Tensor, Tensor]:
        """Vocode a padded batch.

        ``mel`` is (B, in_channels, T), ``lengths`` the (B,) valid frame counts, ``generators`` one
        ``torch.Generator`` per item for the source noise. Returns (B, T * samples_per_frame) audio, zero past
        each item's end, and the (B,) sample counts ``lengths * samples_per_frame``.
        """
        if mel.dim() != 3 or mel.shape[1] != self.in_channels:
            raise ValueError(f"mel must be (B, {self.in_channels}, T), got {tuple(mel.shape)}")
        batch, _, frames = mel.shape
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=mel.device)
        if lengths.shape != (batch,):
            raise ValueError(f"lengths must have shape ({batch},), got {tuple(lengths.shape)}")
        if len(generators) != batch:
            raise ValueError(f"need one generator per item: {batch} items, {len(generators)} generators")
        if batch and (int(lengths.min()) < 1 or int(lengths.max()) > frames):
            raise ValueError(f"lengths must lie in [1, {frames}], got {lengths.tolist()}")

        dtype = self.conv_pre.weight.dtype
        mel_mask = _time_mask(lengths, frames, dtype)
        mel = mel.to(dtype) * mel_mask

        f0 = self.f0_predictor(mel, mel_mask)
        source = self.m_source(f0, lengths, generators)[:, 0]
        samples = lengths * self.samples_per_frame
        spec_frames = frames * self.frame_scales[-1] + 1
        spec_mask = _time_mask(lengths * self.frame_scales[-1] + 1, spec_frames, dtype)
        spec = self._source_spectrum(source, samples, spec_frames) * spec_mask

        x = self.conv_pre(mel) * mel_mask
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
                mask = spec_mask
            else:
                mask = _time_mask(lengths * self.frame_scales[i], x.shape[-1], dtype)
            x = x * mask
            x = x + self.source_resblocks[i](self.source_downs[i](spec) * mask, mask)
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            x = sum(block(x, mask) for block in blocks) / self.num_kernels
        x = self.conv_post(F.leaky_relu(x))
        audio = self._istft(x, spec_mask, samples, frames * self.samples_per_frame)
        return audio.clamp(-self.audio_limit, self.audio_limit), samples

    def vocode(self, mels: Sequence[Tensor], seeds: Sequence[int]) -> list[Tensor]:
        """Vocode (in_channels, L_i) mels, item i's noise seeded with ``seeds[i]`` on a CPU generator."""
        if len(mels) != len(seeds):
            raise ValueError(f"{len(mels)} mels but {len(seeds)} seeds")
        if not mels:
            return []
        device = self.conv_pre.weight.device
        lengths = torch.tensor([m.shape[-1] for m in mels], device=device)
        batch = mels[0].new_zeros(len(mels), self.in_channels, int(lengths.max()), device=device)
        for index, m in enumerate(mels):
            batch[index, :, : m.shape[-1]] = m
        generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
        audio, samples = self(batch, lengths, generators)
        return [a[:n] for a, n in zip(audio, samples.tolist(), strict=True)]

    def load_checkpoint(self, state: Mapping[str, Tensor], path: str | Path) -> HiFT:
        """Load a ``hift.pt`` state (any weight-norm key style) strictly; the method every family's
        vocoder offers (``path`` is for messages; ValueError names what does not match)."""
        return load_hift_state(self, state)


# -- checkpoint loading ------------------------------------------------------------------------------------


def _fold_weight(g: Tensor, v: Tensor) -> Tensor:
    """Weight-norm fold ``v * g / ||v||``, the norm taken over every dim but the one ``g`` keeps (dim 0 upstream)."""
    kept = [d for d in range(g.dim()) if g.shape[d] != 1]
    if len(kept) > 1 or g.dim() not in (0, v.dim()):
        raise ValueError(f"cannot fold weight norm with g of shape {tuple(g.shape)} and v of shape {tuple(v.shape)}")
    # torch's own kernel (what weight_norm computes at every upstream call), so the folded weights
    # are bit-identical to upstream's and f0 does not drift by a rounding step.
    return torch._weight_norm(v, g, kept[0] if kept else -1)


def _folded_state(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Strip a leading ``generator.`` and fold both weight-norm key styles into plain ``weight`` tensors."""
    state = {(k[len("generator.") :] if k.startswith("generator.") else k): v for k, v in state_dict.items()}
    styles = ((".weight_g", ".weight_v"), (".parametrizations.weight.original0", ".parametrizations.weight.original1"))
    for g_suffix, v_suffix in styles:
        for key in [k for k in state if k.endswith(g_suffix)]:
            prefix = key[: -len(g_suffix)]
            if prefix + v_suffix in state:
                g = state.pop(key)
                v = state.pop(prefix + v_suffix)
                state[prefix + ".weight"] = _fold_weight(g, v)
    return state


def load_hift_state(module: HiFT, state_dict: Mapping[str, Tensor]) -> HiFT:
    """Load a CosyVoice ``hift.pt`` state dict (any weight-norm key style) into ``module``, strictly.

    Raises ValueError naming missing or unexpected keys, or shape mismatches.
    """
    state = _folded_state(state_dict)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"HiFT state dict does not match: missing keys {missing}, unexpected keys {unexpected}")
    mismatched = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items() if state[k].shape != v.shape
    ]
    if mismatched:
        raise ValueError(f"HiFT state dict shapes do not match the model: {mismatched}")
    module.load_state_dict(state, strict=True)
    return module


def build_hift(node: Call, flow: Call | None = None) -> HiFT:
    """Construct the vocoder from the ``hift:`` section of cosyvoice.yaml or cosyvoice2.yaml (parsed,
    never executed). ``flow`` is unused: the signature every family's vocoder builder shares."""
    params = dict(node.kwargs)
    f0 = params.get("f0_predictor")
    if isinstance(f0, Call):
        params["f0_predictor"] = expect(f0, "ConvRNNF0Predictor", where="hift.f0_predictor").kwargs
    return HiFT(**params)
