"""Speech tokens -> waveforms for whole batches: the flow, then the HiFT vocoder."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from .flow import FlowInput
from .model import ModelConfig, load_flow, load_hift, read_config

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Token2Wav:
    """The flow and the vocoder of one CosyVoice model directory (any family).

    ``precision`` bf16 or fp16 converts the flow's weights once, at load; the flow's Euler state,
    its time features and its starting noise stay fp32, and the vocoder stays fp32 (as upstream's
    fp16 mode keeps it).

    ``flow_backend`` onnx or tensorrt runs the flow's estimator (the U-Net called at each Euler step)
    through ONNX Runtime instead of torch, see :mod:`.flow_onnx`; ``onnx_cache`` overrides the cache
    folder (default ``$XDG_CACHE_HOME/cosybatch``).
    """

    def __init__(
        self, model_dir: str | Path | ModelConfig, device: str | torch.device = "cpu", precision: str = "fp32",
        flow_backend: str = "torch", onnx_cache: str | Path | None = None,
    ):
        self.config = model_dir if isinstance(model_dir, ModelConfig) else read_config(model_dir)
        self.device = torch.device(device)
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
        self.precision = precision
        self.flow = load_flow(self.config, self.device)
        self.flow_backend = flow_backend
        if flow_backend != "torch":
            from .flow_onnx import attach

            # Exported from the fp32 weights, before any conversion below.
            attach(self.flow, self.config, flow_backend, self.device, precision, folder=onnx_cache)
        if PRECISIONS[precision] is not None:
            self.flow.to(dtype=PRECISIONS[precision])
        self.hift = load_hift(self.config, self.device)
        self.sample_rate = self.config.sample_rate
        self.samples_per_frame = self.config.samples_per_frame

    @torch.inference_mode()
    def mels(self, items: Sequence[FlowInput], seeds: Sequence[int] | None = None) -> list[torch.Tensor]:
        """One (80, frames) fp32 mel per item, on the model's device. ``seeds``: each item's noise
        seed, for CosyVoice-300M's flow (upstream draws fresh noise per call; ours per item, from
        its seed); CosyVoice2's and 3's flows start every item from upstream's fixed noise table."""
        if self.config.family.version == 1:
            return [m.float() for m in self.flow.inference(items, seeds)]
        return [m.float() for m in self.flow.inference(items)]

    @torch.inference_mode()
    def vocode(self, mels: Sequence[torch.Tensor], seeds: Sequence[int]) -> list[np.ndarray]:
        """Waveforms (float32, ``samples_per_frame`` per mel frame) for mels (80, L_i)."""
        lengths = torch.tensor([m.size(1) for m in mels], device=self.device)
        batch = torch.zeros(len(mels), mels[0].size(0), int(lengths.max()), device=self.device)
        for i, mel in enumerate(mels):
            batch[i, :, : mel.size(1)] = mel
        generators = [torch.Generator(device=self.device).manual_seed(int(s)) for s in seeds]
        audio, audio_lengths = self.hift(batch, lengths, generators)
        audio = audio.float().cpu().numpy()
        return [audio[i, : int(n)].copy() for i, n in enumerate(audio_lengths.tolist())]

    def __call__(self, items: Sequence[FlowInput], seeds: Sequence[int]) -> list[np.ndarray]:
        if len(items) != len(seeds):
            raise ValueError("one seed per item")
        if not items:
            return []
        return self.vocode(self.mels(items, seeds), seeds)
