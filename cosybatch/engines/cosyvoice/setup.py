"""What ``run --check`` verifies of a CosyVoice setup without loading weights, and the flow
backend's refusals (shared by the check and the engine's start)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ...errors import UsageError


def check_flow_backend(backend: str, device: Optional[str], family=None) -> None:
    """UsageError when ``backend`` cannot run ``family``'s flow (the ONNX export covers CosyVoice2's
    estimator only) or cannot run on ``device`` (a missing provider or package; None: not checked)."""
    if backend == "torch":
        return
    if family is not None and not family.onnx_flow:
        raise UsageError(f"--engine-opt flow_backend={backend}: the ONNX export covers CosyVoice2's flow "
                         f"estimator only, not {family.name}'s; use torch")
    if device is None:
        return
    from ...cosyvoice.flow.onnx import FlowBackendError, check_backend

    try:
        check_backend(backend, device)
    except FlowBackendError as exc:
        raise UsageError(f"--engine-opt flow_backend={backend}: {exc}") from None


def check_setup(model: Path, speaker: Optional[str], prompt_wav: Optional[Path], prompt_text: Optional[str],
                instruct: Optional[str] = None, flow_backend: str = "torch") -> dict:
    """What ``run --check`` verifies without loading weights: which CosyVoice the folder holds, its
    files and yaml, the default speaker, the default prompt audio."""
    from ...cosyvoice.family import variant
    from ...cosyvoice.frontend.features import PromptError, VoiceBank, load_audio
    from ...cosyvoice.model import read_config
    from ...cosyvoice.weights import ModelDirError

    try:
        config = read_config(model)
    except ModelDirError as exc:
        raise UsageError(f"--model {model}: {exc}") from None
    family = config.family
    check_flow_backend(flow_backend, None, family)
    missing = [name for name in family.files if not (Path(model) / name).is_file()]
    if missing:
        raise UsageError(f"--model {model}: missing {', '.join(missing)}; {family.yaml} says this is a "
                         f"{family.name} folder, which holds them")
    kind = variant(Path(model), family)
    if family.text_tokenizer == "whisper":
        from ...cosyvoice.frontend.whisper import TokenizerNotInstalled, whisper_vocab_path

        try:
            whisper_vocab_path()
        except TokenizerNotInstalled as exc:
            raise UsageError(f"--model {model}: {exc}") from None
    if instruct is not None and family.instruct == "speaker" and "Instruct" not in kind:
        raise UsageError(f"--instruct: this {kind} folder cannot follow instructions; use CosyVoice-300M-Instruct, "
                         "CosyVoice2 or CosyVoice3")
    bank = VoiceBank(model)  # reads spk2info.pt only; its ONNX sessions open on first use
    if speaker is not None:
        try:
            bank.speaker(speaker)
        except PromptError as exc:
            raise UsageError(f"--speaker: {exc}") from None
    prompt = None
    if prompt_wav is not None:
        try:
            audio, rate = load_audio(prompt_wav)
        except PromptError as exc:
            raise UsageError(str(exc)) from None
        prompt = {"path": str(prompt_wav), "seconds": round(len(audio) / rate, 3), "text": prompt_text}
    return {"model": str(model), "family": kind, "version": family.version, "sample_rate": config.sample_rate,
            "speakers": bank.speakers, "speaker": speaker, "prompt": prompt, "instruct": instruct}
