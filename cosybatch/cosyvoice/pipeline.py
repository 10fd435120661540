"""The stages of CosyVoice synthesis for a batch of segments: text tokens -> speech tokens (the LM,
in its slot pool) -> mel (the flow) -> waveform (the HiFT vocoder).

The LM decodes every segment at once; the flow and the vocoder then take the segments regrouped
by the speech tokens the LM really made, longest first, each stage in its own batch sizes (the
flow's cost grows faster than linearly with length, see :func:`flow_cost`). A GPU out-of-memory
error in the LM, the flow or the vocoder halves that stage's chunk (:func:`split_on_oom`), so the
tokens the LM made are kept. On CUDA (with cudaMallocAsync) the LM and token-to-wave run on
streams of their own (:class:`StageStreams`), so one worker's flow overlaps another's decoding.
The engine adapter (``cosybatch.engines.cosyvoice``) builds the :class:`Segment` s and calls
:meth:`Pipeline.synthesize`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..errors import PieceTooLong
from .flow.cfm import FlowInput
from .lm.decoder import DecoderLM
from .lm.slots import LMRequest, PoolStats, Sampling
from .model import ModelConfig, load_flow, load_hift, read_config

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Flow cost of an item of L mel frames (prompt frames included), in units of frames:
# L * (1 + L / FLOW_QUADRATIC_FRAMES). Convolutions and linear layers grow with L, the estimator's
# self-attention with L^2; this is the length at which the two cost the same.
FLOW_QUADRATIC_FRAMES = 2048


@dataclass(frozen=True)
class Segment:
    """One piece of a row for the LM: its text tokens, its voice, what of the voice the LM sees, its seed."""

    text_tokens: tuple[int, ...]
    voice: Any  # frontend.features.Voice
    prompt_text_tokens: tuple[int, ...]  # the LM's prompt text: a zero-shot transcript or an instruction
    seed: int
    lm_speech: bool = False  # the LM reads the voice's prompt speech tokens (zero-shot)
    lm_embedding: bool = True  # the LM reads the speaker embedding (CosyVoice-300M, not in instruct mode)
    speed: float = 1.0  # the mel stretched to 1/speed of its frames before the vocoder (upstream's `speed`)


class Token2Wav:
    """The flow and the vocoder of one CosyVoice model directory (any family).

    ``precision`` bf16 or fp16 converts the flow's weights once, at load; the flow's Euler state,
    its time features and its starting noise stay fp32, and the vocoder stays fp32 (as upstream's
    fp16 mode keeps it).

    ``flow_backend`` onnx or tensorrt runs the flow's estimator (the U-Net called at each Euler step)
    through ONNX Runtime instead of torch, see :mod:`.flow.onnx`; ``onnx_cache`` overrides the cache
    folder (default ``$XDG_CACHE_HOME/cosybatch``).
    """

    def __init__(
        self, model_dir: str | Path | ModelConfig, device: str | torch.device = "cpu", precision: str = "fp32",
        flow_backend: str = "torch", onnx_cache: str | Path | None = None,
    ):
        self.config = model_dir if isinstance(model_dir, ModelConfig) else read_config(model_dir)
        self.device = torch.device(device)
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
        self.precision = precision
        self.flow = load_flow(self.config, self.device)
        self.flow_backend = flow_backend
        if flow_backend != "torch":
            from .flow.onnx import attach

            # Exported from the fp32 weights, before any conversion below.
            attach(self.flow, self.config, flow_backend, self.device, precision, folder=onnx_cache)
        if PRECISIONS[precision] is not None:
            self.flow.to(dtype=PRECISIONS[precision])
        self.hift = load_hift(self.config, self.device)
        self.sample_rate = self.config.sample_rate
        self.samples_per_frame = self.config.samples_per_frame

    @torch.inference_mode()
    def mels(self, items: Sequence[FlowInput], seeds: Sequence[int] | None = None) -> list[torch.Tensor]:
        """One (80, frames) fp32 mel per item, on the model's device. ``seeds``: each item's noise
        seed, for CosyVoice-300M's flow (upstream draws fresh noise per call; ours per item, from
        its seed); CosyVoice2's and 3's flows start every item from upstream's fixed noise table."""
        return [m.float() for m in self.flow.inference(items, seeds=seeds)]

    @torch.inference_mode()
    def vocode(self, mels: Sequence[torch.Tensor], seeds: Sequence[int]) -> list[np.ndarray]:
        """Waveforms (float32, ``samples_per_frame`` per mel frame) for mels (80, L_i)."""
        lengths = torch.tensor([m.size(1) for m in mels], device=self.device)
        batch = torch.zeros(len(mels), mels[0].size(0), int(lengths.max()), device=self.device)
        for i, mel in enumerate(mels):
            batch[i, :, : mel.size(1)] = mel
        generators = [torch.Generator(device=self.device).manual_seed(int(s)) for s in seeds]
        audio, audio_lengths = self.hift(batch, lengths, generators)
        audio = audio.float().cpu().numpy()
        return [audio[i, : int(n)].copy() for i, n in enumerate(audio_lengths.tolist())]

    def __call__(self, items: Sequence[FlowInput], seeds: Sequence[int]) -> list[np.ndarray]:
        if len(items) != len(seeds):
            raise ValueError("one seed per item")
        if not items:
            return []
        return self.vocode(self.mels(items, seeds), seeds)


class StageStreams:
    """The LM and token-to-wave (flow and vocoder) on CUDA streams of their own, ordered by events.

    One stream for the LM (one decode runs at a time) and one per worker thread for token-to-wave,
    so with two workers one's flow and vocoder run while the other decodes, instead of queueing
    behind each other on one stream. A batch's token-to-wave stream waits for the event its LM
    stream recorded after decoding (a device-side wait, no host sync). Each stage also waits for
    the default stream at its start (work queued there before, by any thread). Its inputs from the
    LM are host lists and its output goes to the host, so no device tensor changes streams.

    Only with cudaMallocAsync: its memory pool serves every stream, while the native allocator
    caches freed blocks per stream, so the pool cosybatch reserves (on the default stream) would be
    out of reach of the others. On CPU, and with the native allocator, both stages run in place
    (the same code path, ``enabled`` False).
    """

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda" and torch.cuda.get_allocator_backend() == "cudaMallocAsync"
        self.device = device
        self._lm = torch.cuda.Stream(device) if self.enabled else None
        self._local = threading.local()

    def _t2w_stream(self):
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        return stream

    @contextlib.contextmanager
    def lm(self):
        """Run the LM in here; yields a callable that records the "tokens made" event (or None)."""
        if not self.enabled:
            yield lambda: None
            return
        self._lm.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._lm):
            yield lambda: self._lm.record_event()

    @contextlib.contextmanager
    def token2wav(self, after):
        """Run the flow and the vocoder in here, on this thread's stream, after event ``after``."""
        if not self.enabled:
            yield
            return
        stream = self._t2w_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            yield


@dataclass
class Pipeline:
    """The LM, the flow and the vocoder of one model folder, with each stage's batch sizes.

    ``segment_tokens``: speech tokens of a full-length segment (the flow's batch budget is
    ``flow_batch`` such items)."""

    lm: DecoderLM
    sampling: Sampling
    t2w: Token2Wav
    lm_slots: int
    flow_batch: int
    hift_batch: int
    segment_tokens: int
    cuda_graphs: bool = True
    # No segment's audio may run longer (the engines' MAX_PIECE_SECONDS): checked on the speech tokens
    # the LM made and the segment's speed, before the flow, the time stretch and the vocoder allocate it.
    max_piece_seconds: float = float("inf")
    # The LM's pool statistics summed over every call (stats.json's engine_stats).
    totals: PoolStats = field(default_factory=PoolStats, init=False)

    def __post_init__(self) -> None:
        self._totals_lock = threading.Lock()
        self.streams = StageStreams(self.t2w.device)

    def synthesize(self, segs: Sequence[Segment]) -> tuple[list[np.ndarray], PoolStats, list[dict]]:
        """One waveform per segment (empty where the LM made no tokens), the LM's pool statistics,
        and per segment what the LM did: why it stopped, its tokens and how they repeat (for QC)."""
        with self.streams.lm() as record:
            tokens, lm_stats, lm_info = self.decode(segs)
            made = record()
        with self._totals_lock:
            self.totals.add(lm_stats)
        rate = self.t2w.config.token_frame_rate
        for seg, made_tokens in zip(segs, tokens, strict=True):
            seconds = len(made_tokens) / rate / seg.speed
            if seconds > self.max_piece_seconds:
                raise PieceTooLong(f"a segment would run {seconds:.0f} s ({len(made_tokens)} speech tokens at speed "
                                   f"{seg.speed:g}), over the cap of {self.max_piece_seconds:g} s on one piece; "
                                   "raise --speed or shorten the row")
        with self.streams.token2wav(made):
            return self._token2wav(segs, tokens), lm_stats, lm_info

    def _token2wav(self, segs: Sequence[Segment], tokens: list[list[int]]) -> list[np.ndarray]:
        items = [
            FlowInput(torch.tensor(t, dtype=torch.long), s.voice.embedding, s.voice.prompt_tokens, s.voice.prompt_mel)
            for s, t in zip(segs, tokens, strict=True)
        ]
        seeds = [s.seed for s in segs]
        # Mel frames each item's flow computes: its prompt's and its own.
        mel_frames = self.t2w.flow.mel_frames
        frames = {i: mel_frames(len(t) + (0 if s.voice.prompt_tokens is None else len(s.voice.prompt_tokens)))
                  for i, (s, t) in enumerate(zip(segs, tokens, strict=True)) if t}
        mels = self.flow(items, seeds, frames)
        for i, mel in mels.items():
            if segs[i].speed != 1.0:  # as upstream's token2wav: the mel resampled in time, linearly
                size = max(1, int(mel.size(1) / segs[i].speed))
                mels[i] = torch.nn.functional.interpolate(mel[None], size=size, mode="linear")[0]
        audio: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(items)
        for i, wav in self.vocode(mels, seeds).items():
            audio[i] = wav
        return audio

    def decode(self, segs: Sequence[Segment]) -> tuple[list[list[int]], PoolStats, list[dict]]:
        """Speech tokens per segment (the family's finishing rule applied), decoded in the slot pool;
        on a GPU out-of-memory error, in halves (the pool's statistics summed); per segment its stop
        reason and repetition (of the raw tokens)."""
        requests = [
            LMRequest(
                text=s.text_tokens,
                prompt_text=s.prompt_text_tokens,
                prompt_speech=s.voice.prompt_tokens.tolist() if s.lm_speech else (),
                seed=s.seed,
                embedding=s.voice.embedding if s.lm_embedding else None,
            )
            for s in segs
        ]
        lm_stats = PoolStats()

        def run(chunk: list[int]) -> list[list[int]]:
            tokens, stats = self.lm.decode([requests[i] for i in chunk], self.sampling, slots=self.lm_slots,
                                           cuda_graphs=self.cuda_graphs)
            lm_stats.add(stats)
            return tokens

        tokens = split_on_oom(list(range(len(requests))), run) if requests else []
        info = [{"stop": r.stop, "tokens": len(t), **token_repetition(t)}
                for r, t in zip(requests, tokens, strict=True)]
        return [self.lm.finish_tokens(t) for t in tokens], lm_stats, info

    def flow(self, items: Sequence[FlowInput], seeds: Sequence[int], frames: dict[int, int]) -> dict[int, torch.Tensor]:
        """Mels of the items in ``frames`` (item index -> mel frames), longest first, in chunks of at
        most ``flow_batch`` items within the padded-cost budget."""
        by_frames = sorted(frames, key=lambda i: -frames[i])
        budget = self.flow_batch * flow_cost(self.t2w.flow.mel_frames(self.segment_tokens))
        mels: dict[int, torch.Tensor] = {}
        for chunk in stage_batches(by_frames, {i: flow_cost(f) for i, f in frames.items()}, self.flow_batch, budget):
            made = split_on_oom(chunk, lambda c: _gated_call(self.t2w.mels, [items[i] for i in c],
                                                             [seeds[i] for i in c]))
            for i, mel in zip(chunk, made, strict=True):
                mels[i] = mel
        return mels

    def vocode(self, mels: dict[int, torch.Tensor], seeds: Sequence[int]) -> dict[int, np.ndarray]:
        """Waveforms of the mels, longest first, in chunks of at most ``hift_batch``."""
        lengths = {i: mel.size(1) for i, mel in mels.items()}
        audio: dict[int, np.ndarray] = {}
        for chunk in stage_batches(sorted(lengths, key=lambda i: -lengths[i]), lengths, self.hift_batch):
            wavs = split_on_oom(chunk, lambda c: _gated_call(self.t2w.vocode, [mels[i] for i in c],
                                                             [seeds[i] for i in c]))
            for i, wav in zip(chunk, wavs, strict=True):
                audio[i] = wav
        return audio


def _gated_call(fn, *args):
    """``fn(*args)`` while no CUDA graph is being captured (see :class:`cosybatch.gpu.CaptureGate`)."""
    from ..gpu import CAPTURE_GATE

    with CAPTURE_GATE.work():
        return fn(*args)


def split_on_oom(chunk: list[int], run) -> list:
    """``run(chunk)``; on a GPU out-of-memory error, the chunk in halves (recursively), so the
    tokens the LM made are kept. One item that does not fit alone raises, and fails its row."""
    from ..gpu import is_oom

    try:
        return list(run(chunk))
    except Exception as exc:
        if not is_oom(exc) or len(chunk) == 1:
            raise
    half = len(chunk) // 2
    return split_on_oom(chunk[:half], run) + split_on_oom(chunk[half:], run)


def flow_cost(frames: int) -> float:
    """The flow's cost of an item of ``frames`` mel frames: linear layers plus self-attention."""
    return frames * (1 + frames / FLOW_QUADRATIC_FRAMES)


def stage_batches(order: list[int], cost: dict[int, float], max_items: int,
                  budget: Optional[float] = None) -> list[list[int]]:
    """Consecutive chunks of ``order`` (longest first) of at most ``max_items``, each within
    ``budget`` counted as padded cost (items x the cost of its first, longest item); an item over
    the budget alone still gets a chunk of its own."""
    chunks: list[list[int]] = []
    for i in order:
        if chunks and len(chunks[-1]) < max_items and (
                budget is None or (len(chunks[-1]) + 1) * cost[chunks[-1][0]] <= budget):
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def token_repetition(tokens: Sequence[int]) -> dict:
    """For an LM's speech tokens: the longest run of one token, and the share of 4-grams that
    occur more than once (loops and babble repeat; CosyVoice issue #1877 flags runs of 25)."""
    longest = run = 0
    prev = None
    for t in tokens:
        run = run + 1 if t == prev else 1
        prev = t
        longest = max(longest, run)
    grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    repeated = 0.0
    if grams:
        counts: dict = {}
        for g in grams:
            counts[g] = counts.get(g, 0) + 1
        repeated = sum(c for c in counts.values() if c > 1) / len(grams)
    return {"token_run": longest, "repeat_4gram": round(repeated, 4)}
