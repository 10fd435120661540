"""Upstream CosyVoice's module code as a test oracle.

PyPI carries the upstream modules inside ``cosyvoice2-eu`` (Apache-2.0), installed with
``pip install --no-deps cosyvoice2-eu==0.2.8`` (its declared dependencies pin numpy 1.26 and pull
deepspeed, lightning and more, none of which the modules below need). Two imports on the way are
only used by training or file loading (``matcha.utils`` pulls lightning/hydra, ``torchaudio`` is
used by ``load_wav``), so they are replaced by empty modules before the oracle is imported.
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types

INSTALL_HINT = "pip install --no-deps cosyvoice2-eu==0.2.8"


def _empty_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


def load() -> types.SimpleNamespace:
    """Import the upstream classes, or fail with the command that installs them."""
    if "matcha.utils" not in sys.modules:
        utils = _empty_module("matcha.utils")
        utils.__path__ = []
        sys.modules["matcha.utils"] = utils
        sys.modules["matcha.utils.pylogger"] = _empty_module("matcha.utils.pylogger", get_pylogger=logging.getLogger)
    # The torchaudio stand-in lives only while upstream's modules import: left in sys.modules, it
    # passes for an installed torchaudio to every later test in the process (lhotse then asks it
    # for a __version__ it does not have).
    stub = None if "torchaudio" in sys.modules else _empty_module("torchaudio")
    if stub is not None:
        sys.modules["torchaudio"] = stub
    try:
        from cosyvoice.flow.decoder import CausalConditionalDecoder
        from cosyvoice.flow.flow import CausalMaskedDiffWithXvec
        from cosyvoice.flow.flow_matching import CausalConditionalCFM
        from cosyvoice.hifigan.f0_predictor import ConvRNNF0Predictor
        from cosyvoice.hifigan.generator import HiFTGenerator
        from cosyvoice.transformer.upsample_encoder import UpsampleConformerEncoder
    except ImportError as exc:  # pragma: no cover - a set-up error, reported as such
        raise RuntimeError(f"the upstream CosyVoice oracle is not installed ({exc}); run: {INSTALL_HINT}") from exc
    finally:
        if stub is not None and sys.modules.get("torchaudio") is stub:
            del sys.modules["torchaudio"]
    return types.SimpleNamespace(
        CausalMaskedDiffWithXvec=CausalMaskedDiffWithXvec,
        CausalConditionalCFM=CausalConditionalCFM,
        CausalConditionalDecoder=CausalConditionalDecoder,
        UpsampleConformerEncoder=UpsampleConformerEncoder,
        HiFTGenerator=HiFTGenerator,
        ConvRNNF0Predictor=ConvRNNF0Predictor,
    )


def token2wav_models(model_dir, device="cpu"):
    """Upstream's flow and HiFT built from a model directory's yaml, holding its flow.pt and hift.pt.

    Built the way upstream's ``CosyVoice2`` does it (the yaml's arguments, strict loading, the
    ``generator.`` prefix stripped from hift keys), without the LLM and frontend.
    """
    from pathlib import Path

    import torch
    from omegaconf import DictConfig

    from cosybatch.cosyvoice.model import read_config

    u = load()
    config = read_config(model_dir)
    fk = config.flow.kwargs
    cfm = fk["decoder"]
    decoder = u.CausalConditionalCFM(
        in_channels=cfm.kwargs["in_channels"],
        n_spks=cfm.kwargs["n_spks"],
        spk_emb_dim=cfm.kwargs["spk_emb_dim"],
        cfm_params=DictConfig(cfm.kwargs["cfm_params"].kwargs["content"]),
        estimator=u.CausalConditionalDecoder(**cfm.kwargs["estimator"].kwargs),
    )
    rest = {k: v for k, v in fk.items() if k not in ("encoder", "decoder")}
    encoder = u.UpsampleConformerEncoder(**fk["encoder"].kwargs)
    flow = u.CausalMaskedDiffWithXvec(encoder=encoder, decoder=decoder, **rest)
    flow.load_state_dict(torch.load(Path(model_dir) / "flow.pt", map_location="cpu", weights_only=True), strict=True)
    hk = dict(config.hift.kwargs)
    hk["f0_predictor"] = u.ConvRNNF0Predictor(**hk["f0_predictor"].kwargs)
    hift = u.HiFTGenerator(**hk)
    state = torch.load(Path(model_dir) / "hift.pt", map_location="cpu", weights_only=True)
    hift.load_state_dict({k.replace("generator.", ""): v for k, v in state.items()}, strict=True)
    return flow.to(device).eval(), hift.to(device).eval()


def flow_inference(flow, item, device="cpu"):
    """Upstream's single-item, non-streaming flow call for one :class:`FlowInput` -> (80, frames)."""
    import torch

    p = 0 if item.prompt_tokens is None else len(item.prompt_tokens)
    prompt_tokens = item.prompt_tokens if p else torch.zeros(0, dtype=torch.long)
    prompt_mel = item.prompt_mel if p else torch.zeros(0, 80)
    mel, _ = flow.inference(
        token=item.tokens[None].to(device),
        token_len=torch.tensor([len(item.tokens)], device=device),
        prompt_token=prompt_tokens[None].to(device),
        prompt_token_len=torch.tensor([p], device=device),
        prompt_feat=prompt_mel[None].to(device),
        prompt_feat_len=torch.tensor([prompt_mel.size(0)], device=device),
        embedding=item.embedding.reshape(1, -1).to(device),
        streaming=False,
        finalize=True,
    )
    return mel[0]


def load_v1() -> types.SimpleNamespace:
    """Upstream's CosyVoice-300M flow classes (and the shared HiFT ones), stubbed as :func:`load` does."""
    base = load()
    try:
        from cosyvoice.flow.decoder import ConditionalDecoder
        from cosyvoice.flow.flow import MaskedDiffWithXvec
        from cosyvoice.flow.flow_matching import ConditionalCFM
        from cosyvoice.flow.length_regulator import InterpolateRegulator
        from cosyvoice.transformer.encoder import ConformerEncoder
    except ImportError as exc:  # pragma: no cover - a set-up error, reported as such
        raise RuntimeError(f"the upstream CosyVoice oracle is not installed ({exc}); run: {INSTALL_HINT}") from exc
    return types.SimpleNamespace(
        **vars(base),
        MaskedDiffWithXvec=MaskedDiffWithXvec,
        ConditionalCFM=ConditionalCFM,
        ConditionalDecoder=ConditionalDecoder,
        InterpolateRegulator=InterpolateRegulator,
        ConformerEncoder=ConformerEncoder,
    )


def flow_v1_model(flow_node):
    """Upstream's ``MaskedDiffWithXvec`` built from a parsed cosyvoice.yaml ``flow`` node (random weights)."""
    from omegaconf import DictConfig

    u = load_v1()
    fk = flow_node.kwargs
    cfm = fk["decoder"]
    decoder = u.ConditionalCFM(
        in_channels=cfm.kwargs["in_channels"],
        n_spks=cfm.kwargs["n_spks"],
        spk_emb_dim=cfm.kwargs["spk_emb_dim"],
        cfm_params=DictConfig(cfm.kwargs["cfm_params"].kwargs["content"]),
        estimator=u.ConditionalDecoder(**cfm.kwargs["estimator"].kwargs),
    )
    rest = {k: v for k, v in fk.items() if k not in ("encoder", "decoder", "length_regulator")}
    return u.MaskedDiffWithXvec(
        encoder=u.ConformerEncoder(**fk["encoder"].kwargs),
        length_regulator=u.InterpolateRegulator(**fk["length_regulator"].kwargs),
        decoder=decoder,
        **rest,
    ).eval()


def flow_v1_inference(flow, item, seed: int):
    """Upstream v1's single-item flow call for one :class:`FlowInput`, its noise drawn after
    ``torch.manual_seed(seed)`` -> (80, frames)."""
    import torch

    p = 0 if item.prompt_tokens is None else len(item.prompt_tokens)
    prompt_tokens = item.prompt_tokens if p else torch.zeros(0, dtype=torch.long)
    prompt_mel = item.prompt_mel if p else torch.zeros(0, 80)
    torch.manual_seed(seed)
    mel, _ = flow.inference(
        token=item.tokens[None],
        token_len=torch.tensor([len(item.tokens)]),
        prompt_token=prompt_tokens[None],
        prompt_token_len=torch.tensor([p]),
        prompt_feat=prompt_mel[None],
        prompt_feat_len=torch.tensor([prompt_mel.size(0)]),
        embedding=item.embedding.reshape(1, -1),
        flow_cache=torch.zeros(1, 80, 0, 2),
    )
    return mel[0]


def lm_v1_model(llm_node, sampling):
    """Upstream's CosyVoice-300M ``TransformerLM`` built from a parsed cosyvoice.yaml ``llm`` node
    (random weights), sampling with the callable ``sampling(scores, decoded, top_k)``."""
    load()
    try:
        from cosyvoice.llm.llm import TransformerLM
        from cosyvoice.transformer.encoder import ConformerEncoder, TransformerEncoder
    except ImportError as exc:  # pragma: no cover - a set-up error, reported as such
        raise RuntimeError(f"the upstream CosyVoice oracle is not installed ({exc}); run: {INSTALL_HINT}") from exc
    kw = dict(llm_node.kwargs)
    kw["text_encoder"] = ConformerEncoder(**kw["text_encoder"].kwargs)
    kw["llm"] = TransformerEncoder(**kw["llm"].kwargs)
    kw["sampling"] = sampling
    return TransformerLM(**kw).eval()


def lm_v1_inference(lm, request) -> list[int]:
    """Upstream v1's single-item decode of one :class:`~cosybatch.cosyvoice.lm.slots.LMRequest` (no
    speaker embedding: the empty one upstream's instruct mode passes)."""
    import torch

    def ids(values):
        return torch.tensor([list(values)], dtype=torch.int32).reshape(1, -1)

    embedding = torch.zeros(0, 192) if request.embedding is None else torch.as_tensor(request.embedding).reshape(1, -1)
    return list(lm.inference(
        text=ids(request.text), text_len=torch.tensor([len(request.text)], dtype=torch.int32),
        prompt_text=ids(request.prompt_text),
        prompt_text_len=torch.tensor([len(request.prompt_text)], dtype=torch.int32),
        prompt_speech_token=ids(request.prompt_speech),
        prompt_speech_token_len=torch.tensor([len(request.prompt_speech)], dtype=torch.int32),
        embedding=embedding,
    ))
