"""Piper (VITS) voices on onnxruntime, batched.

Facts this engine relies on (see the project notes on Piper voices):
- inputs are zero-padded phoneme ids `[B, T]`, their lengths `[B]` and `scales` (noise, length,
  noise_w); the output audio `[B, 1, 1, S]` is NOT silent past each item's end, so every item is
  trimmed to its exact length, read from the graph's own frame-count tensor (Ceil -> ReduceSum ->
  Clip -> Cast), which we expose as an extra output.
- the graph draws its noise with two unseeded RandomNormalLike ops. We replace each by a slice of a
  new graph input, and feed noise drawn from a generator seeded per item: an item's audio is then
  reproducible and independent of the batch it lands in, even with noise on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ...cache import file_sha256
from ...errors import PieceTooLong, UsageError, VoiceError
from ...plan import Unit
from ..base import (
    MAX_PIECE_SECONDS,
    Alias,
    Engine,
    EngineOptions,
    Piece,
    Prepared,
    RowRejected,
    ScaleRange,
    Synthesised,
    VoiceRequest,
    bounded,
    item_seed,
)
from .graph import SCALES_INPUT, PatchedGraph, cpu_optimized, patched_bytes
from .phonemes import MAX_PIECE_IDS, Phonemizer
from .text import clause_spans, foreign_letters, normalize_symbols, voice_scripts
from .voice import VoiceConfig, resolve_voice

log = logging.getLogger("cosybatch")

# Initial frame allowance for the decoder noise, per phoneme id and unit of length_scale. Speech
# runs at about 2.3 frames per id; on a miss the batch is rerun with a larger allowance.
NOISE_FRAMES_PER_ID = 4.0
CUDA_PAD_MULTIPLE = 32
# Decoder frames per phoneme id at length_scale 1, for `run --plan-only`'s predicted hours: 2.14
# measured on en_US-joe-medium over the 120 rows of examples/corpus.parquet (26,803 ids; per
# piece 1.94 to 2.78, 5th to 95th percentile). Other voices speak at their own rate.
FRAMES_PER_ID = 2.14
# The bounds of the prosody settings (docs/piper.md, "Bounds"), checked at `run --check`: Piper's
# own tools use length scales of about 0.5 to 2 and noise of 0 to 1; beyond these the model makes
# no better speech, only longer clips and larger inputs.
LENGTH_SCALE_BOUNDS = (0.25, 4.0)
NOISE_BOUNDS = (0.0, 2.0)  # noise_scale and noise_w
SCALE_BOUNDS = {"noise_scale": NOISE_BOUNDS, "length_scale": LENGTH_SCALE_BOUNDS, "noise_w": NOISE_BOUNDS}
MAX_PIECE_IDS_BOUNDS = (8, 2000)
PAD_MULTIPLE_BOUNDS = (1, 256)


@dataclass(frozen=True)
class PhonemeIds:
    """One sentence (or part of one) as phoneme ids, with the seed of its noise: a piece's payload."""

    ids: np.ndarray  # int64 [T]
    seed: int
    scales: Optional[tuple[float, float, float]] = None  # the row's (noise, length, noise_w); None: the voice's
    sid: Optional[int] = None  # the row's speaker of a multi-speaker voice; None: the engine's --speaker


def _ort_errors():
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return (state.Fail, state.RuntimeException, state.InvalidArgument)


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PiperOptions:
    voice_dir: Optional[Path] = None
    """Folder holding NAME.onnx + NAME.onnx.json voices that corpus rows may name."""
    speaker: Optional[str] = None
    """Speaker name or id for multi-speaker voices."""
    noise_scale: Optional[str] = None
    """Generator noise, a value or a range LOW:HIGH drawn per row, each in [0, 2]; unset: the voice's default."""
    length_scale: Optional[str] = None
    """Speaking-rate factor (>1 is slower), a value or a range LOW:HIGH (0.9:1.2) drawn per row,
    each in [0.25, 4]; unset: the voice's default."""
    noise_w: Optional[str] = None
    """Duration noise, a value or a range LOW:HIGH drawn per row, each in [0, 2]; unset: the voice's default."""
    conv2d: Optional[bool] = None
    """Run 1-D convolutions as 2-D ones (same result, ~1.2x faster on CPU); unset: on for CPU."""
    pad_multiple: Optional[int] = None
    """Pad the phoneme axis to a multiple of this, 1 to 256 (CUDA reuses fewer shapes); unset: 1 on CPU,
    32 on CUDA."""
    max_piece_ids: int = MAX_PIECE_IDS
    """Split longer sentences at clause, then word boundaries; 8 to 2000 phoneme ids."""
    two_stage: Optional[bool] = None
    """Run the graph in two stages: text encoder + durations on the batch, then flow + decoder on
    groups regrouped by real frame counts (docs/piper.md: "Two-stage batches"). Unset: two stages for
    every batch of more than one piece, on any device (measured faster at batch 32 on the CPU)."""
    stage2_efficiency: float = 0.95
    """Two-stage only: cut each batch, sorted by frames, into the fewest decoder groups whose real
    frames are at least this share of the computed ones (0: one group per batch)."""
    precision: str = "fp32"
    """fp32, or int8 (CPU only): a calibrated INT8 copy of the voice, built on first use and cached
    (docs/piper.md: "INT8 voices"; `cosybatch quantize` builds it ahead)."""

    def __post_init__(self) -> None:
        self.ranges()  # each a number or LOW:HIGH, in bounds
        bounded("pad_multiple", self.pad_multiple, *PAD_MULTIPLE_BOUNDS)
        bounded("max_piece_ids", self.max_piece_ids, *MAX_PIECE_IDS_BOUNDS)
        if not 0.0 <= self.stage2_efficiency <= 1.0:
            raise UsageError("stage2_efficiency must be between 0 and 1")
        if self.precision not in ("fp32", "int8"):
            raise UsageError(f"--precision {self.precision!r}: Piper voices run in fp32 or int8")

    def ranges(self) -> dict:
        """noise_scale, length_scale, noise_w -> ScaleRange (None: the voice's default)."""
        return {name: ScaleRange.parse(getattr(self, name), f"--{name.replace('_', '-')}",
                                       minimum=SCALE_BOUNDS[name][0], maximum=SCALE_BOUNDS[name][1])
                for name in SCALE_NAMES}


SCALE_NAMES = ("noise_scale", "length_scale", "noise_w")  # the order of the model's `scales` input


class PiperEngine(Engine):
    """A Piper voice: text -> sentences of phoneme ids -> batched, trimmed audio. One instance per
    voice: rows naming other voices (from --voice-dir) get their own."""

    name = "piper"
    Options = PiperOptions
    gpu_runtime = "onnxruntime"
    aliases = (
        Alias("voice_dir", Path, "voices NAME.onnx + NAME.onnx.json that corpus rows may name."),
        Alias("speaker", str, "a speaker of a multi-speaker voice."),
        Alias("precision", str, 'fp32|int8 (int8: docs/piper.md, "INT8 voices").'),
        Alias("noise_scale", str, "generator noise, or a range LOW:HIGH drawn per row (unset: the voice's "
                                  "default)."),
        Alias("length_scale", str, "speaking-rate factor, >1 is slower, or a range LOW:HIGH (0.9:1.2) drawn per "
                                   "row (unset: the voice's default)."),
        Alias("noise_w", str, "duration noise, or a range LOW:HIGH drawn per row (unset: the voice's default)."),
    )

    @classmethod
    def check(cls, voice: Optional[str], options: EngineOptions) -> dict:
        """The voice's name, and its speakers ("speakers": their count, "speaker_names": the named
        ones), which preflight checks a voice pool's VOICE#SPEAKER entries against."""
        name, _, config_path = resolve_voice(voice, options.engine.voice_dir)
        try:
            config = VoiceConfig.load(config_path)
        except Exception:  # the voice's loader reports a bad config with its own words at load
            return {"voice": name}
        return {"voice": name, "speakers": config.num_speakers, "speaker_names": sorted(config.speaker_id_map)}

    @classmethod
    def quantize(cls, voice: Optional[str], options: EngineOptions) -> dict:
        """`cosybatch quantize`: the voice's calibrated INT8 model built into the cache (quant.py)."""
        from .quant import quantize

        return quantize(voice, options.engine.voice_dir)

    def __init__(self, voice: Optional[str], options: EngineOptions):
        import onnxruntime as ort

        opts: PiperOptions = options.engine
        self.voice_name, self.model_path, self.config_path = resolve_voice(
            voice, opts.voice_dir, allow_paths=options.allow_paths
        )
        self.config = VoiceConfig.load(self.config_path)
        self.language = self.config.language_family or None
        if self.config.phoneme_type not in ("espeak", "text"):
            raise VoiceError(f"voice {self.voice_name!r}: phoneme type {self.config.phoneme_type!r} "
                             "is not supported (espeak and text are)")
        self.sample_rate = self.config.sample_rate
        # The decoder frames one piece may have (MAX_PIECE_SECONDS): the noise is never drawn longer,
        # so a longer piece fails in the graph's duration stage, before its audio is allocated.
        self.max_piece_frames = int(MAX_PIECE_SECONDS * self.sample_rate / self.config.hop)
        self.scripts = voice_scripts(self.config.espeak_voice)
        self.seed = options.seed
        defaults = {"noise_scale": self.config.noise_scale, "length_scale": self.config.length_scale,
                    "noise_w": self.config.noise_w}
        # Each scale as a range (a fixed value is a range of one); the attributes are the job's
        # values where fixed, the range's low end otherwise (probes and the fingerprint's shape).
        self.scale_ranges = {name: given or ScaleRange(float(defaults[name]), float(defaults[name]))
                             for name, given in opts.ranges().items()}
        self.noise_scale, self.length_scale, self.noise_w = (self.scale_ranges[n].low for n in SCALE_NAMES)
        self._drawn = tuple(n for n in SCALE_NAMES if not self.scale_ranges[n].fixed)
        self._speakers: dict = {}  # a pool's speaker name -> id
        self.max_piece_ids = opts.max_piece_ids
        self.phonemizer = Phonemizer(self.config, self.max_piece_ids)
        self.speaker = self._speaker_id(opts.speaker)
        providers = _providers(ort, options.device, options.memory_fraction)
        # The 2-D convolution rewrite is measured on CPU only (benchmarks/cpu_settings.py).
        on_cpu = providers == ["CPUExecutionProvider"]
        self.conv2d = on_cpu if opts.conv2d is None else opts.conv2d
        # On CUDA every new input shape costs a cuDNN algorithm search: pad the phoneme axis to a
        # multiple of this so batches reuse a few shapes. Padding is masked, so audio is unchanged.
        self.pad_multiple = opts.pad_multiple or (1 if on_cpu else CUDA_PAD_MULTIPLE)

        self.model_sha256 = file_sha256(self.model_path)["sha256"]
        self.precision = opts.precision
        model_file = self.model_path
        if self.precision == "int8":
            if not on_cpu:
                raise UsageError("--precision int8 is for the CPU (its int8 kernels are onnxruntime's CPU ones); "
                                 "on CUDA use fp32")
            from .quant import cached_int8

            model_file = cached_int8(self.model_path, self.config_path, voice_sha256=self.model_sha256)
        model_bytes, cached_as = patched_bytes(model_file, conv2d=self.conv2d)
        source = cpu_optimized(model_bytes, cached_as) if on_cpu and cached_as else model_bytes

        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, options.threads)
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(source, so, providers=providers)
        graph = self._graph = PatchedGraph.from_metadata(model_bytes, self._session.get_modelmeta().custom_metadata_map)
        used = self._session.get_providers()
        self.device = "cuda" if "CUDAExecutionProvider" in used else "cpu"
        if options.device == "cuda" and self.device != "cuda":
            raise UsageError("--device cuda: onnxruntime could not start its CUDA provider here; "
                             "install onnxruntime-gpu on a machine with a working NVIDIA driver, or use --device cpu")
        self._input_names = {i.name for i in self._session.get_inputs()}
        if self._drawn and not graph.per_item_scales:
            raise VoiceError(f"voice {self.voice_name!r}: its graph reads its scales other than as Piper exports "
                             f"do, so they cannot differ within a batch; give {', '.join(self._drawn)} one value")
        self._output_names = [self._graph.length_output, "output"]
        self._channels = self._probe_noise_channels()
        self.two_stage = opts.two_stage  # None: auto, decided per batch (_use_two_stage)
        self.stage2_efficiency = opts.stage2_efficiency
        self._two_stage = None  # the stage sessions (split.TwoStage), opened on first use
        self._two_stage_lock = threading.Lock()
        if self.two_stage:  # asked for: a model that cannot be split fails now, not mid-run
            self._stages()

    # -- set-up helpers --------------------------------------------------------------------
    def _speaker_id(self, speaker) -> int:
        if speaker is None:
            return 0
        if self.config.num_speakers <= 1:
            raise UsageError(f"voice {self.voice_name!r} has one speaker; drop --speaker")
        if isinstance(speaker, str) and speaker in self.config.speaker_id_map:
            return int(self.config.speaker_id_map[speaker])
        try:
            sid = int(speaker)
        except ValueError:
            raise UsageError(f"voice {self.voice_name!r} has no speaker {speaker!r}; speakers: "
                             f"{sorted(self.config.speaker_id_map)}") from None
        if not 0 <= sid < self.config.num_speakers:
            raise UsageError(f"speaker id {sid} out of range 0..{self.config.num_speakers - 1}")
        return sid

    def _probe_noise_channels(self) -> tuple[int, ...]:
        """Run a two-phoneme input once to learn each noise tensor's channel count."""
        ids = np.array([[1, 0, 2]], dtype=np.int64)
        feeds = self._neutral_scales(self._feeds(ids, np.array([3], dtype=np.int64)))
        for name in self._graph.noise_inputs:
            feeds[name] = np.zeros((1, 1024, 4096), dtype=np.float32)
        shapes = self._session.run([f"{n}_shape" for n in self._graph.noise_inputs], feeds)
        return tuple(int(s[1]) for s in shapes)

    def _neutral_scales(self, feeds: dict) -> dict:
        """Probe feeds at length scale 1: a probe learns shapes, and the voice's own length scale
        (its .onnx.json, which no option bounds) must not make it run past its noise."""
        name = SCALES_INPUT if self._graph.per_item_scales else "scales"
        scales = np.array(feeds[name], dtype=np.float32, copy=True)
        scales[..., 1] = 1.0
        feeds[name] = scales
        return feeds

    def _feeds(self, ids: np.ndarray, lengths: np.ndarray, pieces: Optional[Sequence[PhonemeIds]] = None) -> dict:
        """The graph's inputs besides the noise; each piece's own scales and speaker where it has them."""
        default = (self.noise_scale, self.length_scale, self.noise_w)
        feeds = {"input": ids, "input_lengths": lengths}
        if self._graph.per_item_scales:
            rows = [p.scales or default for p in pieces] if pieces is not None else [default] * len(ids)
            feeds[SCALES_INPUT] = np.array(rows, dtype=np.float32).reshape(len(ids), 3)
        else:
            feeds["scales"] = np.array(default, dtype=np.float32)
        if "sid" in self._input_names:
            sids = [self.speaker if pieces is None or p.sid is None else p.sid for p in pieces or [None] * len(ids)]
            feeds["sid"] = np.array(sids, dtype=np.int64)
        return feeds

    def describe(self) -> dict:
        return {
            "engine": self.name,
            "voice": self.voice_name,
            "model_sha256": self.model_sha256,
            "sample_rate": self.sample_rate,
            # a value, or [low, high] for a range drawn per row (the row's value is in its KEY.json)
            **{name: self.scale_ranges[name].describe() for name in SCALE_NAMES},
            "speaker": self.speaker,
            "max_piece_ids": self.max_piece_ids,
            # fp32 adds nothing, so fingerprints of jobs from before int8 existed still match.
            **(self._int8_describe() if self.precision == "int8" else {}),
        }

    def _int8_describe(self) -> dict:
        from .quant import describe

        return describe(self.model_sha256)

    def prepare(self, text: str, item_id: str, voice: Optional[VoiceRequest] = None, attempt: int = 0) -> Prepared:
        text = normalize_symbols(text, english=self.config.english)
        if self.config.phoneme_type == "espeak":
            foreign = foreign_letters(text, self.scripts)
            if foreign:
                sample = "".join(foreign[:10])
                raise RowRejected(f"characters this voice ({self.config.espeak_voice}) cannot speak: "
                                  f"{sample!r}; route the row to a voice for that language")
        drawn = {name: self.scale_ranges[name].draw(self.seed, item_id, attempt, name) for name in self._drawn}
        scales = tuple(drawn.get(n, self.scale_ranges[n].low) for n in SCALE_NAMES) if drawn else None
        sid = self._pool_speaker(voice.speaker) if voice is not None and voice.speaker is not None else None
        pieces: list[Piece] = []
        phonemized, sizes = self.phonemizer.pieces(text)
        spans = ([(0, len(text))] if self.config.phoneme_type != "espeak"
                 else clause_spans(text, sizes, self.phonemizer.sounds))
        for phonemes, clauses in phonemized:
            # Pieces with no letter-like phoneme (only punctuation and spaces) make no sound.
            if not any(p.strip() and p not in ".,:;!?¡¿—…\"'()-" for p in phonemes):
                continue
            ids, _missing = self.phonemizer.to_ids(phonemes)
            if len(ids) <= 3:
                continue
            seed = item_seed(self.seed, item_id, len(pieces), attempt)
            said = text[spans[clauses[0]][0]:spans[clauses[1]][1]] if spans and clauses else None
            pieces.append(Piece(cost=len(ids), payload=PhonemeIds(ids, seed, scales, sid), text=said))
        if not pieces:
            raise RowRejected("nothing pronounceable in the text for this voice")
        return Prepared(tuple(pieces), text, meta=drawn or None)

    def _pool_speaker(self, speaker: str) -> int:
        """A voice pool's speaker of this voice (a name or an id) -> its id; RowRejected if it has none."""
        if speaker not in self._speakers:
            try:
                if self.config.num_speakers <= 1:
                    raise UsageError(f"voice {self.voice_name!r} has one speaker")
                self._speakers[speaker] = self._speaker_id(speaker)
            except UsageError as exc:
                raise RowRejected(f"--voice-pool entry {self.voice_name}#{speaker}: {exc}; drop the entry or "
                                  "name a speaker the voice has") from None
        return self._speakers[speaker]

    def estimate_seconds(self, piece: Piece) -> float:
        """Phoneme ids -> seconds: FRAMES_PER_ID frames per id, times the length scale, of `hop` samples."""
        return piece.cost * FRAMES_PER_ID * self.length_scale * self.config.hop / self.sample_rate

    # -- audio -----------------------------------------------------------------------------
    def _noise(self, pieces: Sequence[PhonemeIds], frame_allowance: float, input_width: int) -> dict:
        """Per-item noise for the one-graph path, the frame axis sized by an allowance per id."""
        feeds = {}
        lengths = [len(p.ids) for p in pieces]
        rates = [p.scales[1] if p.scales else self.length_scale for p in pieces]
        for k, (name, on_frames) in enumerate(zip(self._graph.noise_inputs, self._graph.noise_on_frames, strict=True)):
            if on_frames:
                times = [min(self.max_piece_frames, int(n * frame_allowance * max(rate, 0.1)) + 64)
                         for n, rate in zip(lengths, rates, strict=True)]
            else:
                times = lengths
            width = max(times) if on_frames else input_width  # the phoneme axis may be padded
            feeds[name] = self._noise_input(pieces, k, times, width)
        return feeds

    def _noise_input(self, pieces: Sequence[PhonemeIds], k: int, times: Sequence[int], width: int) -> np.ndarray:
        """Noise input k [B, C, width]: item i's first times[i] steps from its own stream, which
        depends only on its seed, never on the batch; zeros after."""
        channels = self._channels[k]
        noise = np.zeros((len(pieces), channels, width), dtype=np.float32)
        which = 0 if self._graph.noise_on_frames[k] else 2  # noise_scale or noise_w
        default = (self.noise_scale, self.length_scale, self.noise_w)[which]
        for i, piece in enumerate(pieces):
            if (piece.scales[which] if piece.scales else default) != 0.0:  # scaled to nothing: left zero
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([piece.seed, k])))
                # Drawn time-major, so the first t steps never depend on how many are drawn.
                noise[i, :, : times[i]] = rng.standard_normal((times[i], channels), dtype=np.float32).T
        return noise

    def _batch_inputs(self, pieces: Sequence[PhonemeIds]) -> tuple[np.ndarray, np.ndarray, int]:
        lengths = np.array([len(p.ids) for p in pieces], dtype=np.int64)
        width = -(-int(lengths.max()) // self.pad_multiple) * self.pad_multiple
        ids = np.zeros((len(pieces), width), dtype=np.int64)
        for i, piece in enumerate(pieces):
            ids[i, : len(piece.ids)] = piece.ids
        return ids, lengths, width

    def synthesize(self, units: Sequence[Unit]) -> Synthesised:
        pieces = [u.payload for u in units]
        if self._use_two_stage(len(pieces)):
            stages = self._stages()
            if stages is not None:
                return self._synthesize_two_stage(stages, pieces)
        ids, lengths, width = self._batch_inputs(pieces)
        feeds = self._feeds(ids, lengths, pieces)
        allowance = NOISE_FRAMES_PER_ID
        for attempt in range(3):
            feeds.update(self._noise(pieces, allowance, width))
            try:
                frames, audio = self._session.run(self._output_names, feeds)
                break
            except _ort_errors():
                # The noise slice was shorter than the frames this batch needs: a very slow
                # speaking rate. Rerun with four times the allowance, up to the cap on a piece.
                if self._noise_at_cap(pieces, allowance):
                    raise PieceTooLong(self._too_long(pieces, None)) from None
                if attempt == 2:
                    raise
                allowance *= 4
        frames = frames.reshape(-1)
        if int(frames.max()) > self.max_piece_frames:
            raise PieceTooLong(self._too_long(pieces, int(frames.max())))
        hop = self.config.hop
        audio = audio.reshape(len(pieces), -1)
        out = [audio[i, : int(frames[i]) * hop].astype(np.float32, copy=True) for i in range(len(pieces))]
        return Synthesised(out, real_frames=int(frames.sum()), padded_frames=int(frames.max()) * len(pieces))

    def _noise_at_cap(self, pieces: Sequence[PhonemeIds], allowance: float) -> bool:
        rates = [p.scales[1] if p.scales else self.length_scale for p in pieces]
        return any(int(len(p.ids) * allowance * max(rate, 0.1)) + 64 >= self.max_piece_frames
                   for p, rate in zip(pieces, rates, strict=True))

    def _too_long(self, pieces: Sequence[PhonemeIds], frames: Optional[int]) -> str:
        """Why a piece fails the cap on one piece's length (MAX_PIECE_SECONDS)."""
        hop, rate = self.config.hop, self.sample_rate
        made = f"{frames * hop / rate:.0f} s" if frames is not None else "more"
        used = pieces[0].scales or (self.noise_scale, self.length_scale, self.noise_w)
        scales = ", ".join(f"{n} {v:g}" for n, v in zip(SCALE_NAMES, used, strict=True))
        which = f" ({scales})" if len(pieces) == 1 else ""
        return (f"a piece would run {made}, over the cap of {MAX_PIECE_SECONDS:g} s on one piece{which}; "
                "lower --length-scale or --noise-w (the voice's own defaults count too), or --engine-opt max_piece_ids")

    # -- two stages (split.py) ----------------------------------------------------------------
    def _use_two_stage(self, batch: int) -> bool:
        """Auto: two stages for batches of several pieces (a single piece gets the same audio,
        bit for bit, from the one graph in one call). Measured faster at batch 32 on the CPU too
        (benchmarks/piper_two_stage.py); at the CPU default of batch 1 it never opens."""
        return batch > 1 if self.two_stage is None else self.two_stage

    def _stages(self):
        """The two stage sessions, opened once (thread-safe); None where auto found the model
        cannot be split (the one graph then runs every batch)."""
        with self._two_stage_lock:
            if self._two_stage is None:
                from .split import TwoStage

                try:
                    self._two_stage = TwoStage(self._session, self._graph.model_bytes, self._graph.length_output,
                                               self._probe_feeds)
                except VoiceError as exc:
                    if self.two_stage:
                        raise
                    log.warning("voice %s runs as one graph: %s", self.voice_name, exc)
                    self._two_stage = False
            return self._two_stage or None

    def _probe_feeds(self, lengths: list[int], width: int) -> dict:
        """Stage-1 feeds for a dummy batch of `lengths` phoneme ids padded to `width` (<= 9)."""
        ids = np.zeros((len(lengths), width), dtype=np.int64)
        for i, n in enumerate(lengths):
            ids[i, :n] = [1, 0, 2, 0, 3, 0, 4, 0, 5][:n]
        feeds = self._neutral_scales(self._feeds(ids, np.array(lengths, dtype=np.int64)))
        for k, name in enumerate(self._graph.noise_inputs):
            if not self._graph.noise_on_frames[k]:
                feeds[name] = np.zeros((len(lengths), self._channels[k], width), dtype=np.float32)
        return feeds

    def _synthesize_two_stage(self, stages, pieces: Sequence[PhonemeIds]) -> Synthesised:
        """Stage 1 on the whole batch; stage 2 per group of similar real frame counts."""
        from .split import group_by_frames

        ids, lengths, width = self._batch_inputs(pieces)
        feeds = self._feeds(ids, lengths, pieces)
        for k, name in enumerate(self._graph.noise_inputs):
            if not self._graph.noise_on_frames[k]:
                feeds[name] = self._noise_input(pieces, k, lengths, width)
        carried, frames = stages.align(feeds)
        if int(max(frames)) > self.max_piece_frames:  # known before the decoder allocates the audio
            raise PieceTooLong(self._too_long(pieces, int(max(frames))))
        out: list = [None] * len(pieces)
        padded = 0
        hop = self.config.hop
        for rows in group_by_frames(frames, self.stage2_efficiency):
            group = [pieces[r] for r in rows]
            need = [int(frames[r]) for r in rows]
            direct = {}
            for name in stages.split.stage2_inputs:
                if name in self._graph.noise_inputs:
                    direct[name] = self._noise_input(group, self._graph.noise_inputs.index(name), need, max(need))
                elif name in ("sid", SCALES_INPUT):  # one per item
                    direct[name] = feeds[name][rows]
                else:
                    direct[name] = feeds[name]
            audio, got = stages.decode(carried, rows, lengths, direct, self.pad_multiple)
            if list(got) != need:
                raise VoiceError(f"two-stage frame counts {list(got)} differ from stage 1's {need}")
            for g, r in enumerate(rows):
                out[r] = audio[g, : need[g] * hop].astype(np.float32, copy=True)
            padded += len(rows) * max(need)
        return Synthesised(out, real_frames=int(frames.sum()), padded_frames=padded)


def _providers(ort, device: str, memory_fraction: float = 0.9) -> list:
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r}: choose auto, cpu or cuda")
    from ... import gpu

    cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    # auto: a GPU build on a machine without a GPU goes to the CPU at once, without onnxruntime's
    # error lines about a CUDA provider it cannot load.
    if cuda and device == "auto" and not gpu.cuda_driver_devices()[0]:
        return ["CPUExecutionProvider"]
    if device != "cpu" and cuda:
        from ...gpu import device_total_bytes, ort_cuda_options, ort_preload_cuda

        # The CUDA provider finds pip's CUDA and cuDNN libraries only once they are loaded.
        note = ort_preload_cuda(ort)
        if note:
            log.warning("%s", note)
        # HEURISTIC: EXHAUSTIVE re-benchmarks every new shape. kSameAsRequested: the arena grows by
        # what is asked. gpu_mem_limit: --memory-fraction of the device (when nvidia-smi tells its size).
        total = device_total_bytes()
        return [("CUDAExecutionProvider", ort_cuda_options(int(total * memory_fraction) if total else None)),
                "CPUExecutionProvider"]
    if device == "cuda":
        raise UsageError("--device cuda: this onnxruntime has no CUDA provider; install onnxruntime-gpu as "
                         "docs/gpu.md (GPU install) says (`cosybatch doctor` shows what is installed), "
                         "or use --device cpu")
    return ["CPUExecutionProvider"]
