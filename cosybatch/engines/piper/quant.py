"""Calibrated INT8 Piper voices (``--precision int8``): onnxruntime's static QDQ quantization of a
voice's ONNX graph, built once per voice and cached.

The result is a Piper ONNX model like the original (same inputs, outputs, noise ops and frame-count
tensor), so the engine opens it exactly as it opens the fp32 file. What is quantized is a
``Variant``: op types and the layers (node-name prefixes) they are quantized in. Weights are int8
per output channel, activations uint8 with MinMax ranges calibrated on the bundled calibration text
(our own sentences, public domain). The 1-D convolutions are made 2-D first, as the fp32 CPU path
does, so int8 and fp32 run the same kernels' layout.

Calibration runs the voice with its default noise scales; the noise ops are seeded for it (the seed
is removed again from the result), so a rebuild on the same machine makes the same file.

Cache: ``$XDG_CACHE_HOME/cosybatch/piper-int8/KEY-DIGEST.onnx``, KEY hashing the voice's sha256, the
variant, the calibration text and sentence count, the format version and the onnx/onnxruntime
versions; DIGEST is the sha256 of the file's own bytes (a damaged file is rebuilt). It is written to
a temporary file and renamed into place under a lock, so concurrent jobs and sharded workers on one
machine build it once and share it. ``cosybatch quantize`` builds it ahead of a run.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ...cache import cache_root, cached_file, file_sha256
from ...errors import UsageError
from .graph import convs_as_2d
from .phonemes import MAX_PIECE_IDS, Phonemizer
from .text import normalize_symbols
from .voice import VoiceConfig, resolve_voice

log = logging.getLogger("cosybatch")

DATA = Path(__file__).resolve().parents[2] / "data"  # cosybatch/data
CALIBRATION_TEXT = DATA / "piper_calibration_en.txt"
HELDOUT_TEXT = DATA / "piper_heldout_en.txt"  # for benchmarks/piper_int8.py: never used to calibrate
CALIBRATION_SENTENCES = 50
# Bump to invalidate every cached INT8 model (a change in how the file is made).
FORMAT_VERSION = 1
CACHE_FOLDER = "piper-int8"
_CALIBRATION_SEED = 1234


@dataclass(frozen=True)
class Variant:
    """Which nodes run in int8."""

    ops: tuple[str, ...]
    """Op types quantized."""
    layers: tuple[str, ...] = ()
    """Node-name prefixes where they are quantized; empty: every layer."""
    keep_fp32: tuple[str, ...] = ()
    """Node-name prefixes kept in fp32 inside those layers."""
    keep_last_stage: bool = False
    """Keep the decoder's last stage (its last upsampling and the resblocks after it, at the full
    sample rate) in fp32: 8-bit activations there add an audible noise floor."""
    keeps_durations: bool = False
    """True when the text encoder and duration predictor stay fp32: phoneme durations, and so each
    clip's length, equal fp32's."""


# The measured variants (docs/piper.md "INT8 voices"; benchmarks/piper_int8.py). Piper's VITS graph
# names its parts /enc_p (text encoder), /dp (duration predictor), /flow and /dec (the HiFi-GAN
# decoder, most of the compute); /dec/conv_post makes the waveform from 32 channels.
# ConvTranspose (the decoder's upsampling) is never quantized: onnxruntime's CPU provider has no
# int8 kernel for it, so it would run as dequantize -> fp32 -> quantize, slower and noisier.
VARIANTS = {
    "decoder": Variant(("Conv",), ("/dec/",), ("/dec/conv_post/",), keeps_durations=True),
    "decoder-early": Variant(("Conv",), ("/dec/",), ("/dec/conv_post/",), keep_last_stage=True,
                             keeps_durations=True),
    "flow-decoder-early": Variant(("Conv", "MatMul"), ("/flow/", "/dec/"), ("/dec/conv_post/",),
                                  keep_last_stage=True, keeps_durations=True),
    "flow-decoder": Variant(("Conv", "MatMul"), ("/flow/", "/dec/"), ("/dec/conv_post/",), keeps_durations=True),
    "convs": Variant(("Conv", "MatMul")),
}
# The fastest variant that keeps fp32's durations and its word error rate (docs/piper.md's table): the
# decoder's last stage in int8 costs ~10 points of WER and gains no speed.
DEFAULT_VARIANT = "flow-decoder-early"


def read_sentences(path: Path) -> list[str]:
    """A bundled text file: one sentence a line; '#' lines are its header."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def variant_of(name: str) -> Variant:
    if name not in VARIANTS:
        raise UsageError(f"int8 variant {name!r}: choose one of {', '.join(VARIANTS)}")
    return VARIANTS[name]


def cache_key(voice_sha256: str, variant: str = DEFAULT_VARIANT, sentences: int = CALIBRATION_SENTENCES) -> str:
    """What the INT8 file depends on, hashed: the voice, the recipe, the calibration text, the tools."""
    import onnx
    import onnxruntime

    parts = {
        "format": FORMAT_VERSION,
        "voice_sha256": voice_sha256,
        "variant": [variant, asdict(variant_of(variant))],
        "calibration": [file_sha256(CALIBRATION_TEXT)["sha256"], sentences],
        "tools": {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def describe(voice_sha256: str, variant: str = DEFAULT_VARIANT, sentences: int = CALIBRATION_SENTENCES) -> dict:
    """The fingerprint of an INT8 voice: the recipe, not the file's bytes (a rebuild elsewhere may
    differ in the last bit of a calibration range)."""
    return {"precision": "int8", "int8_variant": variant, "int8_format": FORMAT_VERSION,
            "int8_calibration_sentences": sentences, "int8_key": cache_key(voice_sha256, variant, sentences)}


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------
def calibration_inputs(model_path: Path, config_path: Path, sentences: Sequence[str]) -> list[dict]:
    """One feed per sentence for the original graph: its phoneme ids and the voice's default scales."""
    config = VoiceConfig.load(config_path)
    phonemizer = Phonemizer(config, MAX_PIECE_IDS)  # the engine's own text -> ids steps, without a session
    scales = np.array([config.noise_scale, config.length_scale, config.noise_w], dtype=np.float32)
    feeds = []
    for text in sentences:
        for phonemes in phonemizer.phonemize(normalize_symbols(text, config.english)):
            ids, _missing = phonemizer.to_ids(phonemes)
            if len(ids) <= 3:
                continue
            feed = {"input": ids[None, :], "input_lengths": np.array([len(ids)], dtype=np.int64), "scales": scales}
            if config.num_speakers > 1:
                feed["sid"] = np.zeros(1, dtype=np.int64)
            feeds.append(feed)
    return feeds


class _Feeds:
    """onnxruntime's CalibrationDataReader protocol over a list."""

    def __init__(self, feeds: list[dict]):
        self._it = iter(feeds)

    def get_next(self) -> Optional[dict]:
        return next(self._it, None)


def _set_noise_seed(model, seed: Optional[int]) -> None:
    """Seed (or unseed, with None) the graph's RandomNormalLike ops."""
    from onnx import helper

    for node in model.graph.node:
        if node.op_type == "RandomNormalLike":
            kept = [a for a in node.attribute if a.name != "seed"]
            del node.attribute[:]
            node.attribute.extend(kept)
            if seed is not None:
                node.attribute.append(helper.make_attribute("seed", float(seed)))


def last_decoder_stage(model) -> tuple[str, ...]:
    """Name prefixes of the decoder's last stage: its last /dec/ups.N and the resblocks after it
    (HiFi-GAN runs len(resblocks) / len(ups) resblocks per upsampling)."""
    names = [n.name for n in model.graph.node if n.name.startswith("/dec/")]
    ups = {int(name.split("/")[2].split(".")[1]) for name in names if name.startswith("/dec/ups.")}
    blocks = {int(name.split("/")[2].split(".")[1]) for name in names if name.startswith("/dec/resblocks.")}
    if not ups or not blocks or len(blocks) % len(ups):
        return ()
    per_stage = len(blocks) // len(ups)
    last = len(ups) - 1
    return (f"/dec/ups.{last}/", *(f"/dec/resblocks.{i}/" for i in range(last * per_stage, len(blocks))))


def nodes_to_quantize(model, variant: Variant) -> list[str]:
    keep = variant.keep_fp32 + (last_decoder_stage(model) if variant.keep_last_stage else ())
    return [n.name for n in model.graph.node
            if n.op_type in variant.ops and (not variant.layers or n.name.startswith(variant.layers))
            and not (keep and n.name.startswith(keep))]


def quantize_voice(model_path: Path, config_path: Path, out_path: Path, variant: str | Variant = DEFAULT_VARIANT,
                   sentences: Optional[Sequence[str]] = None, ranges_path: Optional[Path] = None,
                   conv2d: bool = True) -> Path:
    """Write the INT8 model of a Piper voice to ``out_path``.

    ``sentences``: calibration text (default: the first CALIBRATION_SENTENCES bundled sentences).
    ``ranges_path``: a calibration-range JSON to reuse, or to write when it does not exist (the
    benchmark calibrates once for every variant).
    ``conv2d``: make the 1-D convolutions 2-D first, as the fp32 CPU path does (the int8 ones
    measured no faster in 1-D; their output is the same).
    """
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    chosen = variant if isinstance(variant, Variant) else variant_of(variant)
    if sentences is None:
        sentences = read_sentences(CALIBRATION_TEXT)[:CALIBRATION_SENTENCES]
    model = onnx.load(str(model_path))
    if conv2d:
        convs_as_2d(model.graph)
    _set_noise_seed(model, _CALIBRATION_SEED)
    names = nodes_to_quantize(model, chosen)
    feeds = calibration_inputs(model_path, config_path, sentences)
    quiet = logging.getLogger()  # the quantizer warns about pre-processing on the root logger
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        quantize_static(
            model, str(out_path), _Feeds(feeds), quant_format=QuantFormat.QDQ,
            # Calibrate every op type any variant quantizes, so one range file serves them all.
            op_types_to_quantize=["Conv", "ConvTranspose", "MatMul"], nodes_to_quantize=names,
            per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            calibration_cache_path=str(ranges_path) if ranges_path is not None else None,
            # No CalibMaxIntermediateOutputs: in onnxruntime 1.32 it drops what it collected. The
            # calibration graph reduces each tensor to its min and max, so memory stays small.
        )
    finally:
        quiet.setLevel(level)
    result = onnx.load(str(out_path))
    _set_noise_seed(result, None)
    onnx.save(result, str(out_path))
    return out_path


def cached_int8(model_path: Path, config_path: Path, variant: str = DEFAULT_VARIANT,
                sentences: int = CALIBRATION_SENTENCES, folder: Optional[Path] = None,
                voice_sha256: Optional[str] = None) -> Path:
    """The INT8 model of a voice from the cache, built (once, atomically) when missing or damaged."""
    folder = Path(folder) if folder is not None else cache_root() / CACHE_FOLDER
    voice_sha256 = voice_sha256 or file_sha256(model_path)["sha256"]
    key = cache_key(voice_sha256, variant, sentences)

    def build(tmp: Path) -> None:
        log.info("building the INT8 model of %s (variant %s, once per voice) into %s", model_path.name,
                 variant, folder)
        quantize_voice(model_path, config_path, tmp, variant, read_sentences(CALIBRATION_TEXT)[:sentences])

    try:
        return cached_file(folder, key, build)
    except OSError as exc:
        raise UsageError(f"the INT8 cache folder {folder} is not usable ({exc}); set XDG_CACHE_HOME to a "
                         "writable folder") from None


def quantize(voice: Optional[str] = None, voice_dir: Optional[Path] = None) -> dict:
    """`cosybatch quantize`: the voice's INT8 model in the cache, built now if it is not there."""
    import time

    name, model, config = resolve_voice(voice, voice_dir)
    sha = file_sha256(model)["sha256"]
    start = time.perf_counter()
    path = cached_int8(model, config, voice_sha256=sha)
    return {"voice": name, "path": str(path), "seconds": round(time.perf_counter() - start, 1), **describe(sha)}
