"""Write a CosyVoice2 model directory in the official layout with random weights.

Model weights cannot be downloaded here, so the tests, the benchmarks and anyone trying cosybatch
without the real model use a directory written by this module. The layout, file formats and key
names are those of the official ``CosyVoice2-0.5B`` download; only the sizes are small (``tiny``,
the default) or the real ones (``real``), and the weights are random, so the speech is noise.

    python -m cosybatch.cosyvoice.tiny --family v2 [--size tiny|real] [--seed N] OUT_DIR
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..flow.v2 import build_flow
from ..hift.generator import HiFT
from ..model import read_config
from .assets import write_blank_en, write_campplus_onnx, write_speech_tokenizer_onnx
from .random_weights import randomise, stop_soon, weight_norm_state

SPEECH_TOKENS = 6561


@dataclass(frozen=True)
class Sizes:
    llm_hidden: int
    llm_layers: int
    llm_heads: int
    llm_kv_heads: int
    llm_ffn: int
    encoder_units: int
    encoder_blocks: int
    decoder_channels: int
    decoder_head_dim: int
    decoder_heads: int
    decoder_blocks: int
    decoder_mid_blocks: int
    hift_channels: int


SIZES = {
    # Encoder width stays 512: upstream's encoder hard-codes it, and the tests load this directory
    # into upstream's classes too.
    "tiny": Sizes(64, 2, 4, 2, 128, 64, 1, 64, 16, 2, 1, 2, 32),
    "real": Sizes(896, 24, 14, 2, 4864, 2048, 6, 256, 64, 8, 4, 12, 512),
}

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
llm: !new:cosyvoice.llm.llm.Qwen2LM
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

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {tokens}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: 512
        attention_heads: 8
        linear_units: {s.encoder_units}
        num_blocks: {s.encoder_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: 512
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
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
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{s.decoder_channels}]
            dropout: 0.0
            attention_head_dim: {s.decoder_head_dim}
            n_blocks: {s.decoder_blocks}
            num_mid_blocks: {s.decoder_mid_blocks}
            num_heads: {s.decoder_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
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
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {s.hift_channels}

# processor functions
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
"""

def llm_state(s: Sizes, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights under upstream Qwen2LM's key names (Qwen2ForCausalLM inside ``llm.model``)."""
    h, head_dim = s.llm_hidden, s.llm_hidden // s.llm_heads
    kv = s.llm_kv_heads * head_dim

    def mat(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])

    def vec(n: int, around: float = 0.0) -> torch.Tensor:
        return around + 0.1 * torch.randn(n, generator=gen)

    state = {"llm.model.model.embed_tokens.weight": torch.randn(vocab, h, generator=gen) * 0.5}
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
    state["llm_embedding.weight"] = torch.randn(2, h, generator=gen) * 0.5
    state["llm_decoder.weight"] = mat(SPEECH_TOKENS + 3, h)
    state["llm_decoder.bias"] = vec(SPEECH_TOKENS + 3)
    state["speech_embedding.weight"] = torch.randn(SPEECH_TOKENS + 3, h, generator=gen) * 0.5
    return state


def write_model_dir(
    out: str | Path, size: str = "tiny", seed: int = 0, speakers: tuple[str, ...] = ("alice", "bob"), llm: bool = True,
    short: bool = False,
) -> Path:
    """Write the whole directory (without ``llm.pt`` if ``llm`` is false); returns its path.

    ``short``: the LM's stop id is made likely (random_weights.SHORT_STOP_BIAS), so rows end a few
    tokens after their minimum length instead of at the length cap, where random weights take them."""
    if size not in SIZES:
        raise ValueError(f"size {size!r}: choose one of {', '.join(SIZES)}")
    s = SIZES[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    (out / "cosyvoice2.yaml").write_text(YAML.format(s=s, tokens=SPEECH_TOKENS), encoding="utf-8")
    write_blank_en(
        out / "CosyVoice-BlankEN", hidden_size=s.llm_hidden, num_layers=s.llm_layers, num_heads=s.llm_heads,
        num_kv_heads=s.llm_kv_heads, intermediate_size=s.llm_ffn, seed=seed,
    )
    write_campplus_onnx(out / "campplus.onnx", seed=seed)
    write_speech_tokenizer_onnx(out / "speech_tokenizer_v2.onnx", seed=seed)
    config = read_config(out)

    flow = build_flow(config.flow)
    randomise(flow, gen)
    torch.save({k: v.clone() for k, v in flow.state_dict().items()}, out / "flow.pt")
    del flow

    hift_params = dict(config.hift.kwargs)
    hift_params["f0_predictor"] = hift_params["f0_predictor"].kwargs
    hift = HiFT(**hift_params)
    randomise(hift, gen)
    with torch.no_grad():
        # Lift the f0 predictor's output into the voiced range so the harmonic source is exercised.
        hift.f0_predictor.classifier.bias.fill_(40.0)
    torch.save(weight_norm_state(hift.state_dict()), out / "hift.pt")
    del hift

    if llm:
        state = llm_state(s, vocab_size_of(out), gen)
        if short:
            stop_soon(state, SPEECH_TOKENS)  # the first id after the speech ids ends a row
        torch.save(state, out / "llm.pt")
    torch.save(
        {name: {"embedding": torch.randn(1, 192, generator=gen)} for name in speakers},
        out / "spk2info.pt",
    )
    return out


def vocab_size_of(model_dir: Path) -> int:
    return int(json.loads((model_dir / "CosyVoice-BlankEN" / "config.json").read_text())["vocab_size"])
