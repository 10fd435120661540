"""CosyVoice2's speech-token language model (upstream's ``Qwen2LM``, FunAudioLLM/CosyVoice, Apache-2.0).

A Qwen2 decoder (Qwen2.5-0.5B in CosyVoice2-0.5B, :mod:`.qwen2`) reads ``[sos, prompt text + text,
task id, prompt speech tokens]`` as embeddings and predicts speech tokens (6561 ids, then 3 control
ids: the first stops) through its own head, ``llm_decoder``; it decodes in the shared slot pool
(:mod:`.pool`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from ..weights import ModelDirError, load_state, load_strict
from .decoder import SPEECH_TOKENS
from .qwen2 import Qwen2Config, Qwen2SpeechLM
from .slots import LMRequest

SOS, TASK_ID = 0, 1  # rows of llm_embedding


class SpeechLM(Qwen2SpeechLM):
    """Upstream's Qwen2LM parameters (``llm.model.model.*``, ``llm_embedding``, ``llm_decoder``,
    ``speech_embedding``) and batched generation."""

    def __init__(self, config: Qwen2Config, speech_token_size: int = SPEECH_TOKENS):
        super().__init__(config, speech_token_size)
        h = config.hidden_size
        self.llm_embedding = nn.Embedding(2, h)
        self.llm_decoder = nn.Linear(h, speech_token_size + 3)
        self.speech_embedding = nn.Embedding(speech_token_size + 3, h)

    def prompt_embeddings(self, req: LMRequest, device: torch.device) -> Tensor:
        text = torch.tensor([*req.prompt_text, *req.text], dtype=torch.long, device=device)
        speech = torch.tensor(list(req.prompt_speech), dtype=torch.long, device=device)
        w = self.llm_embedding.weight
        return torch.cat(
            [w[SOS][None], self.qwen.embed_tokens(text), w[TASK_ID][None], self.speech_embedding(speech)], dim=0
        )


def load_llm(model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> SpeechLM:
    """Build the LM from ``CosyVoice-BlankEN/config.json`` and load ``llm.pt`` strictly, with its
    weights converted once to ``dtype``.

    The Qwen2 text head (``llm.model.lm_head.weight``) is unused for speech and is not loaded.
    """
    model_dir = Path(model_dir)
    try:
        config = Qwen2Config.from_dir(model_dir / "CosyVoice-BlankEN")
    except ValueError as exc:
        raise ModelDirError(str(exc)) from None
    lm = SpeechLM(config)
    path = model_dir / "llm.pt"
    state = load_state(path)
    state.pop("llm.model.lm_head.weight", None)
    load_strict(lm, state, path)
    return lm.to(device).to_precision(dtype).eval()
