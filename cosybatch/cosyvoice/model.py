"""Load an official CosyVoice2 model directory (as users download it) into our modules.

The directory holds ``cosyvoice2.yaml`` (hyperparameters, read as data by :mod:`.yamlconf`),
``flow.pt`` and ``hift.pt`` (state dicts, loaded with ``weights_only=True`` and strict key checks),
``llm.pt``, ``campplus.onnx``, ``speech_tokenizer_v2.onnx``, ``CosyVoice-BlankEN/`` and optionally
``spk2info.pt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .flow import CausalMaskedDiffWithXvec, build_flow
from .hift import HiFT, load_hift_state
from .yamlconf import Call, expect, load_yaml

CONFIG_NAMES = ("cosyvoice2.yaml",)
REQUIRED_FILES = ("flow.pt", "hift.pt")


class ModelDirError(ValueError):
    """The model directory is missing a file or holds something we cannot load; says which."""


@dataclass
class ModelConfig:
    """What cosybatch reads from ``cosyvoice2.yaml``."""

    path: Path
    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    flow: Call
    hift: Call
    llm: Call | None
    raw: dict[str, Any]

    @property
    def samples_per_token(self) -> int:
        return self.sample_rate // self.token_frame_rate


def read_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelDirError(f"{model_dir}: not a directory; pass the downloaded CosyVoice2-0.5B folder")
    for name in CONFIG_NAMES:
        path = model_dir / name
        if path.is_file():
            break
    else:
        others = sorted(p.name for p in model_dir.glob("*.yaml"))
        hint = f" (found {', '.join(others)}; only CosyVoice2 is supported)" if others else ""
        raise ModelDirError(f"{model_dir}: no cosyvoice2.yaml{hint}")
    try:
        raw = load_yaml(path, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")})
        flow = expect(raw.get("flow"), "CausalMaskedDiffWithXvec", where=f"{path.name}: flow")
        hift = expect(raw.get("hift"), "HiFTGenerator", where=f"{path.name}: hift")
    except ValueError as exc:
        raise ModelDirError(str(exc)) from None
    llm = raw.get("llm") if isinstance(raw.get("llm"), Call) else None
    return ModelConfig(
        path=model_dir,
        sample_rate=int(raw.get("sample_rate", 24000)),
        token_frame_rate=int(raw.get("token_frame_rate", 25)),
        token_mel_ratio=int(raw.get("token_mel_ratio", 2)),
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
        raise ModelDirError(f"{path}: does not match cosyvoice2.yaml ({'; '.join(parts)})")
    module.load_state_dict(state, strict=True)


def build_hift(config: ModelConfig) -> HiFT:
    params = dict(config.hift.kwargs)
    f0 = params.get("f0_predictor")
    if isinstance(f0, Call):
        params["f0_predictor"] = expect(f0, "ConvRNNF0Predictor", where="hift.f0_predictor").kwargs
    try:
        return HiFT(**params)
    except (TypeError, ValueError) as exc:
        raise ModelDirError(f"{config.path / 'cosyvoice2.yaml'}: hift: {exc}") from None


def load_flow(config: ModelConfig, device: torch.device | str = "cpu") -> CausalMaskedDiffWithXvec:
    try:
        flow = build_flow(config.flow)
    except ValueError as exc:
        raise ModelDirError(f"{config.path / 'cosyvoice2.yaml'}: {exc}") from None
    path = config.path / "flow.pt"
    load_strict(flow, load_state(path), path)
    return flow.to(device).eval()


def load_hift(config: ModelConfig, device: torch.device | str = "cpu") -> HiFT:
    hift = build_hift(config)
    path = config.path / "hift.pt"
    try:
        load_hift_state(hift, load_state(path))
    except ValueError as exc:
        raise ModelDirError(f"{path}: {exc}") from None
    return hift.to(device).eval()
