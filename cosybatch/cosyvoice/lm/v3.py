"""Fun-CosyVoice3-0.5B's speech-token language model, decoded in the slot pool of :mod:`.llm`.

Architecture after upstream's ``CosyVoice3LM`` (FunAudioLLM/CosyVoice, Apache-2.0, commit ace7c47):
the same Qwen2 decoder as CosyVoice2's (``llm.model.model.*``, our own blocks from :mod:`.llm`),
with its speech side widened to 200 control ids after the 6561 speech ids:

- ``speech_embedding`` and ``llm_decoder`` cover 6561 + 200 ids; the decoder has no bias, and there
  is no ``llm_embedding``: the start and task rows are speech-embedding rows 6561 and 6563.
- The input is ``[sos, prompt text + text, task id, prompt speech tokens]``; the speaker embedding
  is not an input (upstream takes it and ignores it).
- A request must hold ``<|endofprompt|>`` (Qwen id 151646) in its text or prompt text; upstream
  asserts it, here :class:`MissingEndOfPrompt` says which requests lack it before any decoding.
- Stop rule, kept as upstream has it: decoding stops on any id 6561..6760, but the "no stop before
  the minimum length" mask covers id 6561 only (upstream masks ``speech_token_size``, which in v3 is
  the start id, not its end id 6562). So a row can stop before its minimum length on 6562..6760.
  This is upstream's bug, kept so that our tokens are upstream's.

Upstream's ``CosyVoice3Model.llm_job`` then drops silent tokens beyond 5 in a row; that is
post-processing of the finished tokens, :func:`drop_long_silences`, which the engine applies to
each request's tokens through :meth:`SpeechLM3.finish_tokens` before the flow.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from ..weights import ModelDirError, load_state, load_strict
from ..yamlconf import Call, expect, load_yaml
from .qwen2 import Qwen2Config, Qwen2SpeechLM
from .slots import LMRequest, PoolStats, Sampling

SPEECH_TOKENS = 6561
CONTROL_TOKENS = 200  # ids after the speech ids, in the decoder and the speech embedding
# Offsets from SPEECH_TOKENS of upstream's control ids (sos, eos, task id; fill is +3).
SOS_OFFSET, EOS_OFFSET, TASK_OFFSET = 0, 1, 2
ENDOFPROMPT = "<|endofprompt|>"
# Upstream hard-codes this id (the first token CosyVoice3Tokenizer adds after Qwen2's 151646 ids).
ENDOFPROMPT_ID = 151646
# Upstream's "FSQ silent and breath" tokens, and how many of them in a row it keeps.
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
MAX_SILENT_RUN = 5
YAML_NAME = "cosyvoice3.yaml"


class MissingEndOfPrompt(ValueError):
    """A CosyVoice3 request has no ``<|endofprompt|>`` in its text or prompt text.

    CosyVoice3 was trained with an instruction before ``<|endofprompt|>`` (upstream's examples use
    ``"You are a helpful assistant.<|endofprompt|>"`` as the prompt text's start); upstream refuses
    such a request outright."""


def drop_long_silences(tokens: Iterable[int], silent: frozenset[int] = SILENT_TOKENS,
                       keep: int = MAX_SILENT_RUN) -> list[int]:
    """``tokens`` without the silent tokens beyond ``keep`` in a row (upstream's ``llm_job`` rule).

    A run counts any mix of silent ids; a non-silent token ends it. Upstream filters after the LM
    has seen the tokens, so the LM's own history (its KV cache, the sampler's window) still holds
    them: this is post-processing, never part of decoding."""
    out, run = [], 0
    for token in tokens:
        token = int(token)
        if token in silent:
            run += 1
            if run > keep:
                continue
        else:
            run = 0
        out.append(token)
    return out


def has_endofprompt(req: LMRequest, endofprompt_id: int = ENDOFPROMPT_ID) -> bool:
    return endofprompt_id in req.text or endofprompt_id in req.prompt_text


class SpeechLM3(Qwen2SpeechLM):
    """Upstream CosyVoice3LM's parameters (``llm.model.model.*``, ``llm_decoder`` without bias,
    ``speech_embedding``) and batched generation through the slot pool."""

    def __init__(self, config: Qwen2Config, speech_token_size: int = SPEECH_TOKENS,
                 endofprompt_id: int = ENDOFPROMPT_ID):
        super().__init__(config, speech_token_size)
        self.endofprompt_id = endofprompt_id
        h = config.hidden_size
        self.llm_decoder = nn.Linear(h, speech_token_size + CONTROL_TOKENS, bias=False)
        self.speech_embedding = nn.Embedding(speech_token_size + CONTROL_TOKENS, h)

    # -- the stop rule: upstream's, quirk included (see the module docstring) -------------------
    @property
    def stop_from(self) -> int:
        return self.speech_token_size  # every control id stops a row

    @property
    def emit_limit(self) -> int:
        return self.speech_token_size + CONTROL_TOKENS  # the whole decoder: nothing else is masked

    @property
    def min_len_masked(self) -> slice:
        # Upstream masks speech_token_size (v3's start id), not its end id: kept, see above.
        return slice(self.speech_token_size, self.speech_token_size + 1)

    def prompt_embeddings(self, req: LMRequest, device: torch.device) -> Tensor:
        text = torch.tensor([*req.prompt_text, *req.text], dtype=torch.long, device=device)
        speech = torch.tensor(list(req.prompt_speech), dtype=torch.long, device=device)
        w = self.speech_embedding.weight
        sos, task = self.speech_token_size + SOS_OFFSET, self.speech_token_size + TASK_OFFSET
        return torch.cat([w[sos][None], self.qwen.embed_tokens(text), w[task][None], self.speech_embedding(speech)])

    def check_requests(self, requests: Sequence[LMRequest]) -> None:
        """Raise :class:`MissingEndOfPrompt` naming every request without ``<|endofprompt|>``."""
        bad = [i for i, r in enumerate(requests) if not has_endofprompt(r, self.endofprompt_id)]
        if bad:
            shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
            raise MissingEndOfPrompt(
                f"CosyVoice3 needs {ENDOFPROMPT} (id {self.endofprompt_id}) in the text or prompt text; "
                f"request(s) {shown} of {len(requests)} have none. Start the prompt text with an instruction "
                f"ending in it, e.g. 'You are a helpful assistant.{ENDOFPROMPT}'"
            )

    def decode(self, requests: Sequence[LMRequest], sampling: Sampling | None = None,
               **options) -> tuple[list[list[int]], PoolStats]:
        """:meth:`DecoderLM.decode` after checking every request for ``<|endofprompt|>``.

        The tokens are the LM's raw output, as upstream's ``CosyVoice3LM.inference`` yields them;
        the engine applies :meth:`finish_tokens` before the flow."""
        self.check_requests(requests)
        return super().decode(requests, sampling, **options)

    def finish_tokens(self, tokens: list[int]) -> list[int]:
        """What upstream's ``CosyVoice3Model.llm_job`` passes on to the flow: the long silences go."""
        return drop_long_silences(tokens)


def build_llm_v3(llm: Call, config: Qwen2Config) -> SpeechLM3:
    """The LM the yaml's ``llm`` node (``CosyVoice3LM``) describes, over the Qwen2 ``config`` of
    ``CosyVoice-BlankEN/``; random weights."""
    expect(llm, "CosyVoice3LM", where="llm")
    kw = llm.kwargs
    encoder = kw.get("llm")
    if encoder is not None:
        expect(encoder, "Qwen2Encoder", where="llm.llm")
    try:
        size = int(kw.get("speech_token_size", SPEECH_TOKENS))
        widths = {k: int(kw[k]) for k in ("llm_input_size", "llm_output_size") if k in kw}
    except (TypeError, ValueError):
        raise ValueError(f"llm: sizes must be integers (got {kw})") from None
    if size != SPEECH_TOKENS:
        raise ValueError(f"llm: speech_token_size {size}; CosyVoice3 has {SPEECH_TOKENS}")
    wrong = {k: v for k, v in widths.items() if v != config.hidden_size}
    if wrong:
        raise ValueError(f"llm: {wrong} differ from CosyVoice-BlankEN's hidden_size {config.hidden_size}")
    return SpeechLM3(config, size)


def load_llm_v3(model_dir: str | Path, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> SpeechLM3:
    """Build the LM from ``cosyvoice3.yaml`` and ``CosyVoice-BlankEN/config.json``, load ``llm.pt``
    strictly (``weights_only``), convert its weights once to ``dtype``.

    The Qwen2 text head (``llm.model.lm_head.weight``, tied to the text embedding) is unused for
    speech and is not loaded."""
    model_dir = Path(model_dir)
    path = model_dir / YAML_NAME
    if not path.is_file():
        raise ModelDirError(f"{model_dir}: no {YAML_NAME}; pass the downloaded Fun-CosyVoice3-0.5B folder")
    try:
        raw = load_yaml(path, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")})
        config = Qwen2Config.from_dir(model_dir / "CosyVoice-BlankEN")
        lm = build_llm_v3(raw.get("llm"), config)
    except ValueError as exc:
        raise ModelDirError(f"{path}: {exc}") from None
    weights = model_dir / "llm.pt"
    state = load_state(weights)
    state.pop("llm.model.lm_head.weight", None)
    load_strict(lm, state, weights)
    return lm.to(device).to_precision(dtype).eval()
