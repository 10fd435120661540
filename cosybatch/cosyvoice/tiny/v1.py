"""Write a CosyVoice-300M (v1) model folder in the official layout with random weights.

The v1 counterpart of :mod:`.v2`: ``cosyvoice.yaml`` (the official layout, after upstream's
``examples/libritts/cosyvoice/conf/cosyvoice.yaml``), ``llm.pt``, ``flow.pt``, ``hift.pt``,
``campplus.onnx``, ``speech_tokenizer_v1.onnx``, ``configuration.json`` and, for the -SFT and
-Instruct variants, ``spk2info.pt``. Sizes are small (``tiny``, the default) or the real ones
(``real``); the weights are random, so the speech is noise. Same arguments, same bytes.

The three releases share one yaml; which one a folder is, cosybatch reads from the folder's name
(see :func:`cosybatch.cosyvoice.family.variant`), so name the folder ``...-SFT`` or ``...-Instruct`` to match.

    python -m cosybatch.cosyvoice.tiny --family v1 [--variant base|sft|instruct] [--size tiny|real] [--seed N] OUT_DIR
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..flow.v1 import build_flow_v1
from ..hift.generator import HiFT
from ..lm.v1 import build_llm_v1
from ..yamlconf import Call, expect, load_yaml
from .assets import write_campplus_onnx, write_speech_tokenizer_onnx
from .random_weights import randomise, stop_soon, weight_norm_state

SPEECH_TOKENS = 4096  # 50 Hz v1 speech vocabulary
TEXT_TOKENS = 51866  # openai-whisper's multilingual tokenizer (num_languages=100), which v1 folders use
FRAMES_PER_TOKEN = 2  # 100 mel frames/s -> 50 tokens/s
_CODE_SIDE = 64  # 64 * 64 == 4096
VARIANTS = ("base", "sft", "instruct")
SPEAKERS = ("alice", "bob", "carol")


@dataclass(frozen=True)
class Sizes:
    text_embed: int  # text_encoder_input_size
    text_encoder_units: int
    text_encoder_heads: int
    text_encoder_ffn: int
    text_encoder_blocks: int
    llm_hidden: int
    llm_heads: int
    llm_ffn: int
    llm_blocks: int
    flow_width: int  # flow input_size and encoder output_size
    flow_heads: int
    flow_ffn: int
    flow_blocks: int
    decoder_channels: int
    decoder_head_dim: int
    decoder_heads: int
    decoder_blocks: int
    decoder_mid_blocks: int
    hift_channels: int


SIZES = {
    "tiny": Sizes(32, 64, 2, 128, 1, 64, 2, 128, 2, 64, 2, 128, 2, 32, 16, 2, 1, 2, 32),
    "real": Sizes(512, 1024, 16, 4096, 6, 1024, 16, 4096, 14, 512, 8, 2048, 6, 256, 64, 8, 4, 12, 512),
}

YAML = """\
# set random seed, so that you may reproduce your result.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

# fixed params
sample_rate: 22050
text_encoder_input_size: {s.text_embed}
llm_input_size: {s.llm_hidden}
llm_output_size: {s.llm_hidden}
spk_embed_dim: 192

# model params
llm: !new:cosyvoice.llm.llm.TransformerLM
    text_encoder_input_size: !ref <text_encoder_input_size>
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    text_token_size: {text_tokens}
    speech_token_size: {speech_tokens}
    length_normalized_loss: True
    lsm_weight: 0
    spk_embed_dim: !ref <spk_embed_dim>
    text_encoder: !new:cosyvoice.transformer.encoder.ConformerEncoder
        input_size: !ref <text_encoder_input_size>
        output_size: {s.text_encoder_units}
        attention_heads: {s.text_encoder_heads}
        linear_units: {s.text_encoder_ffn}
        num_blocks: {s.text_encoder_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.0
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        use_cnn_module: False
        macaron_style: False
        use_dynamic_chunk: False
        use_dynamic_left_chunk: False
        static_chunk_size: 1
    llm: !new:cosyvoice.transformer.encoder.TransformerEncoder
        input_size: !ref <llm_input_size>
        output_size: !ref <llm_output_size>
        attention_heads: {s.llm_heads}
        linear_units: {s.llm_ffn}
        num_blocks: {s.llm_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.0
        input_layer: 'linear_legacy'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        static_chunk_size: 1
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.MaskedDiffWithXvec
    input_size: {s.flow_width}
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {speech_tokens}
    input_frame_rate: 50
    only_mask_loss: True
    encoder: !new:cosyvoice.transformer.encoder.ConformerEncoder
        output_size: {s.flow_width}
        attention_heads: {s.flow_heads}
        linear_units: {s.flow_ffn}
        num_blocks: {s.flow_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {s.flow_width}
        use_cnn_module: False
        macaron_style: False
    length_regulator: !new:cosyvoice.flow.length_regulator.InterpolateRegulator
        channels: 80
        sampling_ratios: [1, 1, 1, 1]
    decoder: !new:cosyvoice.flow.flow_matching.ConditionalCFM
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
        estimator: !new:cosyvoice.flow.decoder.ConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{s.decoder_channels}, {s.decoder_channels}]
            dropout: 0.0
            attention_head_dim: {s.decoder_head_dim}
            n_blocks: {s.decoder_blocks}
            num_mid_blocks: {s.decoder_mid_blocks}
            num_heads: {s.decoder_heads}
            act_fn: 'gelu'

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: 80
    base_channels: {s.hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 8]
    upsample_kernel_sizes: [16, 16]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {s.hift_channels}

# gan related module
mel_spec_transform1: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1024
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 256
    win_size: 1024
    fmin: 0
    fmax: null
    center: False
hifigan: !new:cosyvoice.hifigan.hifigan.HiFiGan
    generator: !ref <hift>
    discriminator: !new:cosyvoice.hifigan.discriminator.MultipleDiscriminator
        mpd: !new:matcha.hifigan.models.MultiPeriodDiscriminator
        mrd: !new:cosyvoice.hifigan.discriminator.MultiResSpecDiscriminator
    mel_spec_transform: [
        !ref <mel_spec_transform1>
    ]

# processor functions
parquet_opener: !name:cosyvoice.dataset.processor.parquet_opener
get_tokenizer: !name:whisper.tokenizer.get_tokenizer
    multilingual: True
    num_languages: 100
    language: 'en'
    task: 'transcribe'
allowed_special: 'all'
tokenize: !name:cosyvoice.dataset.processor.tokenize
    get_tokenizer: !ref <get_tokenizer>
    allowed_special: !ref <allowed_special>
filter: !name:cosyvoice.dataset.processor.filter
    max_length: 40960
    min_length: 0
    token_max_length: 200
    token_min_length: 1
resample: !name:cosyvoice.dataset.processor.resample
    resample_rate: !ref <sample_rate>
truncate: !name:cosyvoice.dataset.processor.truncate
    truncate_length: 24576 # must be a multiplier of hop_size
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1024
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 256
    win_size: 1024
    fmin: 0
    fmax: 8000
    center: False
compute_fbank: !name:cosyvoice.dataset.processor.compute_fbank
    feat_extractor: !ref <feat_extractor>
compute_f0: !name:cosyvoice.dataset.processor.compute_f0
    sample_rate: !ref <sample_rate>
    hop_size: 256
parse_embedding: !name:cosyvoice.dataset.processor.parse_embedding
    normalize: True
shuffle: !name:cosyvoice.dataset.processor.shuffle
    shuffle_size: 1000
sort: !name:cosyvoice.dataset.processor.sort
    sort_size: 500  # sort_size should be less than shuffle_size
batch: !name:cosyvoice.dataset.processor.batch
    batch_type: 'dynamic'
    max_frames_in_batch: 2000
padding: !name:cosyvoice.dataset.processor.padding
    use_spk_embedding: False # change to True during sft

# dataset processor pipeline
data_pipeline: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <compute_fbank>,
    !ref <parse_embedding>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]

# train conf
train_conf:
    optim: adam
    optim_conf:
        lr: 0.001 # change to 1e-5 during sft
    scheduler: warmuplr # change to constantlr during sft
    scheduler_conf:
        warmup_steps: 2500
    max_epoch: 200
    grad_clip: 5
    accum_grad: 2
    log_interval: 100
    save_per_step: -1
"""


def yaml_text(size: str = "tiny") -> str:
    """The folder's ``cosyvoice.yaml`` at ``size``."""
    if size not in SIZES:
        raise ValueError(f"size {size!r}: choose one of {', '.join(SIZES)}")
    return YAML.format(s=SIZES[size], text_tokens=TEXT_TOKENS, speech_tokens=SPEECH_TOKENS)


# ---------------------------------------------------------------------------- ONNX speech tokenizer


def write_speech_tokenizer_v1_onnx(path: str | Path, seed: int = 0) -> Path:
    """A stand-in for ``speech_tokenizer_v1.onnx``: 50 Hz tokens (2 of the 100 Hz frames each) with
    ids in [0, 4096), given as [1, 1, n] (rank 3, as the real v1 tokenizer's)."""
    return write_speech_tokenizer_onnx(path, seed, frames_per_token=FRAMES_PER_TOKEN, code_side=_CODE_SIDE, rank=3)


# ---------------------------------------------------------------------------- weights


def _norms_near_one(module: torch.nn.Module, gen: torch.Generator) -> None:
    """GroupNorm/LayerNorm scales around 1 (``randomise`` recognises norms by name, GroupNorms here are
    Sequential indices)."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None:
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape, generator=gen))


def flow_state(flow_node: Call, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random ``flow.pt`` weights under upstream ``MaskedDiffWithXvec``'s key names."""
    flow = build_flow_v1(flow_node)
    randomise(flow, gen)
    _norms_near_one(flow, gen)
    return {k: v.clone() for k, v in flow.state_dict().items()}


def hift_state(hift_node: Call, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random ``hift.pt`` weights, weight-normed convs stored as (weight_g, weight_v) as the official file."""
    params = dict(hift_node.kwargs)
    params["f0_predictor"] = expect(params["f0_predictor"], "ConvRNNF0Predictor", where="hift.f0_predictor").kwargs
    hift = HiFT(**params)
    randomise(hift, gen)
    with torch.no_grad():
        # Lift the f0 predictor's output into the voiced range so the harmonic source is exercised.
        hift.f0_predictor.classifier.bias.fill_(40.0)
    return weight_norm_state(hift.state_dict())


def llm_state(llm_node: Call, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random ``llm.pt`` weights under upstream ``TransformerLM``'s key names (see :mod:`cosybatch.cosyvoice.lm.v1`)."""
    llm = build_llm_v1(llm_node)
    randomise(llm, gen)
    _norms_near_one(llm, gen)
    return {k: v.clone() for k, v in llm.state_dict().items()}


def write_model_dir(
    out: str | Path,
    variant: str = "base",
    size: str = "tiny",
    seed: int = 0,
    speakers: tuple[str, ...] = SPEAKERS,
    llm: bool = True,
    short: bool = False,
) -> Path:
    """Write the whole folder (without ``llm.pt`` if ``llm`` is false); returns its path.

    ``variant`` sft and instruct add ``spk2info.pt`` with ``speakers`` (``{name: {"embedding": (1, 192)}}``).
    ``short``: the LM's stop id is made likely (random_weights.SHORT_STOP_BIAS), so rows end a few
    tokens after their minimum length instead of at the length cap, where random weights take them.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    (out / "cosyvoice.yaml").write_text(yaml_text(size), encoding="utf-8")
    (out / "configuration.json").write_text(
        json.dumps({"framework": "Pytorch", "task": "text-to-speech", "allow_remote": True}, indent=4) + "\n",
        encoding="utf-8",
    )
    write_campplus_onnx(out / "campplus.onnx", seed=seed)
    write_speech_tokenizer_v1_onnx(out / "speech_tokenizer_v1.onnx", seed=seed)
    raw = load_yaml(out / "cosyvoice.yaml")

    torch.save(flow_state(raw["flow"], gen), out / "flow.pt")
    torch.save(hift_state(raw["hift"], gen), out / "hift.pt")
    if llm:
        state = llm_state(raw["llm"], gen)
        if short:
            stop_soon(state, state["llm_decoder.bias"].numel() - 1)  # v1's one stop id is its last
        torch.save(state, out / "llm.pt")
    if variant != "base":
        torch.save({name: {"embedding": torch.randn(1, 192, generator=gen)} for name in speakers}, out / "spk2info.pt")
    return out
