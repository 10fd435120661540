"""Load an official CosyVoice model folder (as users download it) into our modules.

A folder holds its yaml (``cosyvoice.yaml``, ``cosyvoice2.yaml`` or ``cosyvoice3.yaml``:
hyperparameters, read as data by :mod:`.yamlconf`; which one it is says which family, see
:mod:`.family`), ``llm.pt``, ``flow.pt`` and ``hift.pt`` (state dicts, loaded with
``weights_only=True`` and strict key checks), ``campplus.onnx``, the family's speech tokenizer, for
v2 and v3 ``CosyVoice-BlankEN/``, and optionally ``spk2info.pt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .family import Family, UnknownModel, check_classes, yaml_of
from .frontend.features import MelSettings
from .weights import ModelDirError, load_state, load_strict
from .yamlconf import Call, expect, load_yaml


@dataclass
class ModelConfig:
    """What cosybatch reads from the model folder's yaml."""

    path: Path
    family: Family
    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int | None  # mel frames per speech token; None for v1 (its flow interpolates)
    mel: MelSettings
    flow: Call
    hift: Call
    llm: Call | None
    raw: dict[str, Any]

    @property
    def yaml_path(self) -> Path:
        return self.path / self.family.yaml

    @property
    def samples_per_frame(self) -> int:
        """Waveform samples per mel frame (the vocoder's hop)."""
        return self.mel.hop


def read_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    try:
        family, path = yaml_of(model_dir)
        qwen = family.text_tokenizer == "qwen"
        raw = load_yaml(path, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")} if qwen else {})
        check_classes(family, raw, path.name)
        flow = expect(raw.get("flow"), family.flow, where=f"{path.name}: flow")
        hift = expect(raw.get("hift"), family.hift, where=f"{path.name}: hift")
        sample_rate = int(raw.get("sample_rate", 24000))
        mel = MelSettings.from_yaml(raw, sample_rate)
    except (UnknownModel, ValueError) as exc:
        raise ModelDirError(str(exc)) from None
    llm = raw.get("llm") if isinstance(raw.get("llm"), Call) else None
    return ModelConfig(
        path=model_dir,
        family=family,
        sample_rate=sample_rate,
        token_frame_rate=int(raw.get("token_frame_rate", family.token_rate)),
        token_mel_ratio=int(raw.get("token_mel_ratio", 2)) if family.fixed_mel_per_token else None,
        mel=mel,
        flow=flow,
        hift=hift,
        llm=llm,
        raw=raw,
    )


def build_hift(config: ModelConfig) -> torch.nn.Module:
    try:
        return config.family.build_hift(config.hift, config.flow)
    except (TypeError, ValueError) as exc:
        raise ModelDirError(f"{config.yaml_path}: hift: {exc}") from None


def build_flow_module(config: ModelConfig) -> torch.nn.Module:
    """The family's flow, built from the yaml's ``flow`` node (random weights)."""
    try:
        return config.family.build_flow(config.flow)
    except (TypeError, ValueError) as exc:
        raise ModelDirError(f"{config.yaml_path}: flow: {exc}") from None


def load_flow(config: ModelConfig, device: torch.device | str = "cpu") -> torch.nn.Module:
    flow = build_flow_module(config)
    path = config.path / "flow.pt"
    load_strict(flow, load_state(path), path)
    return flow.to(device).eval()


def load_hift(config: ModelConfig, device: torch.device | str = "cpu") -> torch.nn.Module:
    hift = build_hift(config)
    path = config.path / "hift.pt"
    try:
        hift.load_checkpoint(load_state(path), path)
    except ValueError as exc:
        raise ModelDirError(f"{path}: {exc}") from None
    return hift.to(device).eval()


def load_lm(config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """The family's speech-token LM (a :class:`~.lm.decoder.DecoderLM`), weights loaded strictly and
    converted once to ``dtype``."""
    return config.family.load_lm(config.path, device, dtype)


def load_text_tokenizer(config: ModelConfig):
    """The family's text tokenizer: openai-whisper's multilingual BPE for CosyVoice-300M (its folder
    ships none), ``CosyVoice-BlankEN/`` (Qwen2) for CosyVoice2 and 3."""
    return config.family.load_text_tokenizer(config.path)
