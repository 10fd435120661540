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
from .features import MelSettings
from .hift import HiFT, load_hift_state
from .yamlconf import Call, expect, load_yaml


class ModelDirError(ValueError):
    """The model directory is missing a file or holds something we cannot load; says which."""


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
        token_mel_ratio=None if family.version == 1 else int(raw.get("token_mel_ratio", 2)),
        mel=mel,
        flow=flow,
        hift=hift,
        llm=llm,
        raw=raw,
    )


def load_state(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint as a flat dict of tensors; never unpickles arbitrary objects."""
    if not path.is_file():
        raise ModelDirError(f"{path}: missing; the model directory is incomplete")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for corrupt or unsafe files
        raise ModelDirError(f"{path}: cannot be loaded as weights ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelDirError(f"{path}: expected a state dict of tensors")
    return state


def load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if keys:
                parts.append(f"{label}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}")
        raise ModelDirError(f"{path}: does not match the folder's yaml ({'; '.join(parts)})")
    module.load_state_dict(state, strict=True)


def build_hift(config: ModelConfig) -> torch.nn.Module:
    params = dict(config.hift.kwargs)
    try:
        if config.family.version == 3:
            from .hift_v3 import build_hift_v3

            return build_hift_v3(config.hift, config.flow)  # its noise tables follow the flow's draws
        f0 = params.get("f0_predictor")
        if isinstance(f0, Call):
            params["f0_predictor"] = expect(f0, "ConvRNNF0Predictor", where="hift.f0_predictor").kwargs
        return HiFT(**params)
    except (TypeError, ValueError) as exc:
        raise ModelDirError(f"{config.yaml_path}: hift: {exc}") from None


def build_flow_module(config: ModelConfig) -> torch.nn.Module:
    """The family's flow, built from the yaml's ``flow`` node (random weights)."""
    try:
        if config.family.version == 1:
            from .flow_v1 import build_flow_v1

            return build_flow_v1(config.flow)
        if config.family.version == 3:
            from .flow_v3 import build_flow_v3

            return build_flow_v3(config.flow)
        from .flow import build_flow

        return build_flow(config.flow)
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
        if isinstance(hift, HiFT):
            load_hift_state(hift, load_state(path))
        else:
            hift.load_checkpoint(load_state(path), path)
    except ValueError as exc:
        raise ModelDirError(f"{path}: {exc}") from None
    return hift.to(device).eval()


def load_lm(config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """The family's speech-token LM (a :class:`~.llm.DecoderLM`), weights loaded strictly and
    converted once to ``dtype``."""
    version = config.family.version
    if version == 1:
        from .llm_v1 import load_llm_v1

        return load_llm_v1(config.path, device, dtype)
    if version == 3:
        from .llm_v3 import load_llm_v3

        return load_llm_v3(config.path, device, dtype)
    from .llm import load_llm

    return load_llm(config.path, device, dtype)


def load_text_tokenizer(config: ModelConfig):
    """The family's text tokenizer: openai-whisper's multilingual BPE for CosyVoice-300M (its folder
    ships none), ``CosyVoice-BlankEN/`` (Qwen2) for CosyVoice2 and 3."""
    if config.family.text_tokenizer == "whisper":
        from .text_v1 import WhisperTextTokenizer

        return WhisperTextTokenizer()
    from .text import UPSTREAM_EXTRA_SPECIALS, V3_SPECIALS, QwenTextTokenizer

    specials = V3_SPECIALS if config.family.version == 3 else UPSTREAM_EXTRA_SPECIALS
    return QwenTextTokenizer(config.path / "CosyVoice-BlankEN", specials)
