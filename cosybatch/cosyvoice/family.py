"""Which CosyVoice a model folder holds, and how each family builds its stages: one table.

Users pick a model by the folder they downloaded; nothing asks them to say which it is. A folder
is recognised by its yaml (``cosyvoice.yaml``, ``cosyvoice2.yaml`` or ``cosyvoice3.yaml``) and,
inside it, the classes it builds: the LM, the flow and the vocoder must be those of one family.
Anything else is refused with what was found.

To add a family: write its stage modules (``lm/``, ``flow/``, ``hift/``, a text tokenizer in
``frontend/`` if it needs a new one), then one :class:`Family` entry below, added to
:data:`FAMILIES`. Nothing else dispatches on the family.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from .flow.v1 import build_flow_v1
from .flow.v2 import build_flow
from .flow.v3 import build_flow_v3
from .frontend.text import UPSTREAM_EXTRA_SPECIALS, V3_SPECIALS, QwenTextTokenizer
from .frontend.whisper import WhisperTextTokenizer
from .hift.causal import build_hift_v3
from .hift.generator import build_hift
from .lm.v1 import load_llm_v1
from .lm.v2 import load_llm
from .lm.v3 import load_llm_v3
from .yamlconf import Call


def _whisper_tokenizer(model_dir: Path) -> WhisperTextTokenizer:
    return WhisperTextTokenizer()  # CosyVoice-300M folders ship none: openai-whisper's multilingual BPE


def _qwen_tokenizer(model_dir: Path, specials: tuple[str, ...]) -> QwenTextTokenizer:
    return QwenTextTokenizer(model_dir / "CosyVoice-BlankEN", specials)


@dataclass(frozen=True)
class Family:
    """One CosyVoice release: its yaml, the classes that yaml builds, what its folder holds, and a
    builder per stage."""

    version: int
    name: str  # as the official download is named
    yaml: str
    llm: str  # the classes the yaml's llm, flow and hift nodes build
    flow: str
    hift: str
    speech_tokenizer: str
    text_tokenizer: str  # "whisper" (openai-whisper's multilingual BPE) or "qwen" (CosyVoice-BlankEN/)
    token_rate: int  # speech tokens per second
    instruct: str  # how it takes instructions: "speaker" (300M-Instruct), "prompt" (v2, v3)
    # The stages: (model folder, device, dtype) -> the LM with llm.pt loaded; the yaml's flow node
    # -> the flow (random weights); the yaml's hift and flow nodes -> the vocoder (random weights);
    # the model folder -> the text tokenizer.
    load_lm: Callable[..., Any]
    build_flow: Callable[[Call], Any]
    build_hift: Callable[[Call, Call], Any]
    load_text_tokenizer: Callable[[Path], Any]
    # Mel frames per speech token come from the yaml (token_mel_ratio), except where the flow
    # interpolates its encoder output to the mel length (CosyVoice-300M).
    fixed_mel_per_token: bool = True
    # The ONNX estimator export (flow/onnx.py) covers this family's flow.
    onnx_flow: bool = False
    # Text every v3 prompt opens with: upstream's LM refuses a prompt without <|endofprompt|>.
    system_prompt: str = ""

    @property
    def files(self) -> tuple[str, ...]:
        """What ``run --check`` expects besides the yaml (spk2info.pt is optional everywhere)."""
        common = ("llm.pt", "flow.pt", "hift.pt", "campplus.onnx", self.speech_tokenizer)
        return common + (("CosyVoice-BlankEN/config.json",) if self.text_tokenizer == "qwen" else ())


V1 = Family(1, "CosyVoice-300M", "cosyvoice.yaml", "TransformerLM", "MaskedDiffWithXvec", "HiFTGenerator",
            "speech_tokenizer_v1.onnx", "whisper", 50, "speaker",
            load_lm=load_llm_v1, build_flow=build_flow_v1, build_hift=build_hift,
            load_text_tokenizer=_whisper_tokenizer, fixed_mel_per_token=False)
V2 = Family(2, "CosyVoice2-0.5B", "cosyvoice2.yaml", "Qwen2LM", "CausalMaskedDiffWithXvec", "HiFTGenerator",
            "speech_tokenizer_v2.onnx", "qwen", 25, "prompt",
            load_lm=load_llm, build_flow=build_flow, build_hift=build_hift,
            load_text_tokenizer=partial(_qwen_tokenizer, specials=UPSTREAM_EXTRA_SPECIALS), onnx_flow=True)
V3 = Family(3, "Fun-CosyVoice3-0.5B", "cosyvoice3.yaml", "CosyVoice3LM", "CausalMaskedDiffWithDiT",
            "CausalHiFTGenerator", "speech_tokenizer_v3.onnx", "qwen", 25, "prompt",
            # Its noise tables follow the flow's draws, so the vocoder reads the flow node too.
            load_lm=load_llm_v3, build_flow=build_flow_v3, build_hift=build_hift_v3,
            load_text_tokenizer=partial(_qwen_tokenizer, specials=V3_SPECIALS),
            system_prompt="You are a helpful assistant.")
FAMILIES = (V1, V2, V3)
ENDOFPROMPT = "<|endofprompt|>"
# What CosyVoice-300M-Instruct's released frontend ends an instruction with (a plain-text marker:
# whisper's tokenizer has no <|endofprompt|> token).
V1_ENDOFPROMPT = "<endofprompt>"


class UnknownModel(ValueError):
    """The folder is not a CosyVoice model folder cosybatch can load; the message says what it holds."""


def yaml_of(model_dir: Path) -> tuple[Family, Path]:
    """The family whose yaml the folder holds (by file name alone)."""
    if not model_dir.is_dir():
        raise UnknownModel(f"{model_dir}: not a directory; pass the model folder as downloaded")
    present = [f for f in FAMILIES if (model_dir / f.yaml).is_file()]
    if len(present) > 1:
        raise UnknownModel(f"{model_dir}: holds {' and '.join(f.yaml for f in present)}; a model folder holds one")
    if not present:
        raise UnknownModel(not_a_model_folder(model_dir))
    return present[0], model_dir / present[0].yaml


def not_a_model_folder(model_dir: Path) -> str:
    """What a folder without a family's yaml should have held, in two lines (not what it holds: a
    wrong folder may hold thousands of files). Points at a sub-folder that is a model folder."""
    expected = ", ".join(f.yaml for f in FAMILIES)
    inside = sorted(sub.name for sub in model_dir.iterdir()
                    if sub.is_dir() and any((sub / f.yaml).is_file() for f in FAMILIES))
    hint = f"; {model_dir / inside[0]} is one: pass that folder" if inside else ""
    return (f"{model_dir}: no CosyVoice yaml ({expected}), so not a CosyVoice model folder{hint}.\n"
            "A model folder as downloaded (e.g. pretrained_models/CosyVoice2-0.5B) holds one of them with llm.pt, "
            "flow.pt, hift.pt, campplus.onnx, its speech_tokenizer_v*.onnx and, for v2 and v3, CosyVoice-BlankEN/")


def check_classes(family: Family, raw: dict[str, Any], where: str) -> None:
    """The yaml's llm, flow and hift nodes must build ``family``'s classes; else say what they build
    and which family that looks like."""
    found = {part: (node.name if isinstance(node := raw.get(part), Call) else None) for part in ("llm", "flow", "hift")}
    wanted = {"llm": family.llm, "flow": family.flow, "hift": family.hift}
    if found == wanted:
        return
    wrong = ", ".join(f"{part} builds {found[part] or 'nothing'} (expected {wanted[part]})"
                      for part in wanted if found[part] != wanted[part])
    like = next((f.name for f in FAMILIES if found == {"llm": f.llm, "flow": f.flow, "hift": f.hift}), None)
    hint = f"; those are {like}'s classes, whose folder names its yaml {_yaml_name(like)}" if like else ""
    raise UnknownModel(f"{where}: not a {family.name} model: {wrong}{hint}")


def _yaml_name(name: str) -> str:
    return next(f.yaml for f in FAMILIES if f.name == name)


VARIANTS = (("-instruct", "Instruct"), ("-sft", "SFT"), ("-25hz", "25Hz"))


def variant(model_dir: Path, family: Family) -> str:
    """The release variant the folder's path says (CosyVoice-300M-SFT, -Instruct, -25Hz): its own
    name first, then the folders above it as given (a Hugging Face snapshot is named by a commit
    hash under models--FunAudioLLM--CosyVoice-300M-Instruct/), then the name a symlink resolves
    to. The variants' yaml is the same, so this is for reports and for whether a v1 folder takes
    instructions (upstream checks '-Instruct' in the path too)."""
    names = [*reversed(Path(os.path.abspath(model_dir)).parts), model_dir.resolve().name]
    for name in names:
        for marker, label in VARIANTS:
            if marker in name.lower():
                return f"{family.name}-{label}"
    return family.name
