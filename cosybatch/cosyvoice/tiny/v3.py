"""Write a Fun-CosyVoice3-0.5B model folder in the official layout, tiny and with random weights.

The v3 sibling of :mod:`.v2`: ``cosyvoice3.yaml`` (upstream's layout and classes, small sizes),
``llm.pt``, ``flow.pt``, ``hift.pt`` (state dicts under upstream's key names), ``campplus.onnx``,
``speech_tokenizer_v3.onnx``, ``configuration.json`` and ``CosyVoice-BlankEN/``. Upstream's own
classes load it strictly (``tests/golden/make_v3_golden.py`` does), so tests of our v3 modules
against upstream's run on it.

Two things are real-sized on purpose. The Qwen2 vocabulary keeps its 151,936 rows and the tokenizer
its 151,643 ordinary ids, so ``<|endofprompt|>`` gets id 151646 from upstream's tokenizer as from
the real one (upstream's LM checks for that id); the rows are narrow (hidden size 32), so the
folder stays about 40 MB. The yaml keeps the real token rates, mel settings and vocoder rates.

    python -m cosybatch.cosyvoice.tiny --family v3 [--seed N] OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..flow.v3 import build_flow_v3
from ..hift.causal import build_hift_v3
from ..yamlconf import load_yaml
from .assets import (
    QWEN_SPECIALS,
    _qwen2_weights,
    _write_json,
    _write_safetensors,
    train_byte_bpe,
    training_text,
    write_campplus_onnx,
    write_speech_tokenizer_onnx,
)
from .random_weights import randomise, weight_norm_state

SPEECH_TOKENS = 6561
CONTROL_TOKENS = 200
QWEN_ORDINARY_IDS = 151_643  # Qwen2's byte-level BPE ids; <|endoftext|> is the next one
QWEN_VOCAB_SIZE = 151_936  # rows of Qwen2-0.5B's embedding (padded beyond the tokenizer)
YAML_NAME = "cosyvoice3.yaml"
CONV_POST_SCALE = 0.03  # see _hift_state

@dataclass(frozen=True)
class Sizes:
    llm_hidden: int = 32
    llm_layers: int = 2
    llm_heads: int = 4
    llm_kv_heads: int = 2
    llm_ffn: int = 64
    lookahead_channels: int = 32  # PreLookaheadLayer (1024 in the real model)
    dit_dim: int = 64  # DiT width (1024); a multiple of 16 (its position conv has 16 groups)
    dit_depth: int = 2  # (22)
    dit_heads: int = 2  # (16)
    dit_head_dim: int = 32  # (64)
    hift_channels: int = 32  # HiFT and f0-predictor width (512)


TINY = Sizes()

YAML = """\
# set random seed, so that you may reproduce your result.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

# fixed params
sample_rate: 24000
llm_input_size: {s.llm_hidden}
llm_output_size: {s.llm_hidden}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2

# stream related params
chunk_size: 25 # streaming inference chunk size, in token
num_decoding_left_chunks: -1 # streaming inference flow decoder left chunk size, <0 means use all left chunks

# model params
llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {tokens}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {tokens}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {s.lookahead_channels}
        pre_lookahead_len: 3
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {s.dit_dim}
            depth: {s.dit_depth}
            heads: {s.dit_heads}
            dim_head: {s.dit_head_dim}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: 80
    base_channels: {s.hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {s.hift_channels}

# processor functions
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False
"""


def _generator(seed: int, part: str) -> torch.Generator:
    """One generator per file, so a file's weights do not depend on which other files are written."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{part}".encode()))


def llm_state(s: Sizes, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights under upstream CosyVoice3LM's key names (Qwen2ForCausalLM in ``llm.model``)."""
    h, head_dim = s.llm_hidden, s.llm_hidden // s.llm_heads
    kv = s.llm_kv_heads * head_dim

    def mat(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])

    def vec(n: int, around: float = 0.0) -> torch.Tensor:
        return around + 0.1 * torch.randn(n, generator=gen)

    state = {"llm.model.model.embed_tokens.weight": torch.randn(QWEN_VOCAB_SIZE, h, generator=gen) * 0.5}
    for i in range(s.llm_layers):
        p = f"llm.model.model.layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": mat(h, h), p + "self_attn.q_proj.bias": vec(h),
            p + "self_attn.k_proj.weight": mat(kv, h), p + "self_attn.k_proj.bias": vec(kv),
            p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.v_proj.bias": vec(kv),
            p + "self_attn.o_proj.weight": mat(h, h),
            p + "mlp.gate_proj.weight": mat(s.llm_ffn, h), p + "mlp.up_proj.weight": mat(s.llm_ffn, h),
            p + "mlp.down_proj.weight": mat(h, s.llm_ffn),
            p + "input_layernorm.weight": vec(h, 1.0), p + "post_attention_layernorm.weight": vec(h, 1.0),
        }
    state["llm.model.model.norm.weight"] = vec(h, 1.0)
    state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]  # tied, as saved upstream
    state["llm_decoder.weight"] = mat(SPEECH_TOKENS + CONTROL_TOKENS, h)
    state["speech_embedding.weight"] = torch.randn(SPEECH_TOKENS + CONTROL_TOKENS, h, generator=gen) * 0.5
    return state


def write_blank_en_v3(folder: str | Path, s: Sizes = TINY, seed: int = 0) -> Path:
    """``CosyVoice-BlankEN/`` as CosyVoice3 ships it (Qwen2's files), with a tiny BPE padded to
    Qwen2's 151,643 ordinary ids so that every special token gets its real id.

    The padding entries (``<|pad_N|>``) are in ``vocab.json`` only; no merge produces them, so text
    never maps to them. ``tokenizer_config.json`` declares Qwen2's three special tokens, as the real
    file does; upstream adds :data:`V3_SPECIALS` at load time."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = train_byte_bpe(training_text(), 1000)
    for i in range(len(vocab), QWEN_ORDINARY_IDS):
        vocab[f"<|pad_{i}|>"] = i
    special_ids = {token: QWEN_ORDINARY_IDS + i for i, token in enumerate(QWEN_SPECIALS)}
    eos_id = special_ids["<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_text = "#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in merges)
    (folder / "merges.txt").write_text(merges_text, encoding="utf-8")
    added = {
        str(token_id): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
        for token, token_id in special_ids.items()
    }
    _write_json(folder / "tokenizer_config.json", {
        "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
        "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    })
    _write_json(folder / "config.json", {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": eos_id,
        "eos_token_id": eos_id, "hidden_act": "silu", "hidden_size": s.llm_hidden, "initializer_range": 0.02,
        "intermediate_size": s.llm_ffn, "max_position_embeddings": 32768, "max_window_layers": s.llm_layers,
        "model_type": "qwen2", "num_attention_heads": s.llm_heads, "num_hidden_layers": s.llm_layers,
        "num_key_value_heads": s.llm_kv_heads, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "float32", "use_cache": True,
        "use_sliding_window": False, "vocab_size": QWEN_VOCAB_SIZE,
    })
    _write_json(folder / "generation_config.json",
                {"bos_token_id": eos_id, "do_sample": False, "eos_token_id": eos_id, "max_new_tokens": 2048})
    weights = _qwen2_weights(np.random.default_rng(seed), QWEN_VOCAB_SIZE, s.llm_hidden, s.llm_layers,
                             s.llm_heads, s.llm_kv_heads, s.llm_ffn)
    _write_safetensors(folder / "model.safetensors", weights)
    return folder


def _flow_state(raw: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    flow = build_flow_v3(raw["flow"])
    randomise(flow, gen)
    return {k: v.clone() for k, v in flow.state_dict().items()}


def _hift_state(raw: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    hift = build_hift_v3(raw["hift"], raw["flow"])
    randomise(hift, gen)
    with torch.no_grad():
        # Lift the f0 predictor's output into the voiced range so the harmonic source is exercised.
        hift.f0_predictor.classifier.bias.fill_(40.0)
    state = weight_norm_checkpoint(hift.state_dict())
    # Random weights put exp(conv_post) far above 1, so nearly every sample would hit the clamp
    # at +-0.99 and a waveform comparison would see only the clamp: shrink the last conv.
    state["conv_post.weight_g"] *= CONV_POST_SCALE
    state["conv_post.bias"] *= CONV_POST_SCALE
    return state


def weight_norm_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HiFT's weight-normed convs as ``weight_g``/``weight_v``, the layout of the official v2
    ``hift.pt`` (whether v3's official file uses it or torch's newer
    ``parametrizations.weight.original0/1`` is not known; upstream loads either). Accepts a module
    that keeps plain conv weights or torch's parametrizations."""
    out = {}
    for key, value in state.items():
        if ".parametrizations.weight.original" in key:
            base, which = key.split(".parametrizations.weight.original")
            out[f"{base}.weight_{'g' if which == '0' else 'v'}"] = value.clone()
        else:
            out[key] = value
    return weight_norm_state(out)


PARTS = ("llm", "flow", "hift")


def write_model_dir(out: str | Path, seed: int = 0, parts: tuple[str, ...] = PARTS) -> Path:
    """Write the whole folder (``parts`` says which of llm.pt, flow.pt, hift.pt); returns its path.

    Each file's weights come from its own generator (seeded from ``seed`` and the file's name), so
    leaving a part out changes nothing in the others."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"parts {unknown}: choose from {', '.join(PARTS)}")
    s = TINY
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / YAML_NAME).write_text(YAML.format(s=s, tokens=SPEECH_TOKENS), encoding="utf-8")
    _write_json(out / "configuration.json", {"framework": "pytorch", "task": "text-to-speech",
                                             "model": {"type": "cosyvoice3"}, "pipeline": {"type": "cosyvoice3-tts"}})
    write_blank_en_v3(out / "CosyVoice-BlankEN", s, seed=seed)
    write_campplus_onnx(out / "campplus.onnx", seed=seed)
    write_speech_tokenizer_onnx(out / "speech_tokenizer_v3.onnx", seed=seed)
    raw = load_yaml(out / YAML_NAME)
    if "llm" in parts:
        torch.save(llm_state(s, _generator(seed, "llm")), out / "llm.pt")
    if "flow" in parts:
        torch.save(_flow_state(raw, _generator(seed, "flow")), out / "flow.pt")
    if "hift" in parts:
        torch.save(_hift_state(raw, _generator(seed, "hift")), out / "hift.pt")
    return out


def tensor_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names, dtypes, shapes and values (independent of pickling)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def folder_digests(model_dir: str | Path) -> dict[str, str]:
    """A digest per file of the folder: weights (``*.pt``) by :func:`tensor_digest`, the rest by
    their bytes. Relative paths as keys."""
    model_dir = Path(model_dir)
    out = {}
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(model_dir).as_posix()
        if path.suffix == ".pt":
            out[rel] = tensor_digest(torch.load(path, map_location="cpu", weights_only=True))
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out
