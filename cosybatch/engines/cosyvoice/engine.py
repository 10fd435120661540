"""The CosyVoice engine: text -> segments -> speech tokens (LM) -> mel (flow) -> waveform (HiFT).

The model folder says which CosyVoice it is (CosyVoice-300M, CosyVoice2-0.5B, Fun-CosyVoice3-0.5B;
see :mod:`cosybatch.cosyvoice.family`); every family decodes in the same slot pool.

One instance serves every voice (``multi_voice``): SFT speakers of ``spk2info.pt`` and zero-shot
prompts, given once for the job (``--speaker``, ``--prompt-wav``/``--prompt-text``) or per row
(``speaker``/``voice``, ``prompt_wav``, ``prompt_text`` columns), and instructions (``--instruct``,
an ``instruct`` column). Prompt features are computed once per distinct prompt by the voice bank.
A batch may mix voices: every stage takes each item's own embedding and prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...cache import file_fingerprint
from ...errors import UsageError
from ...plan import Unit
from .. import (
    Engine,
    EngineOptions,
    MemoryPlan,
    Piece,
    Prepared,
    RowRejected,
    ScaleRange,
    Synthesised,
    VoiceRequest,
    item_seed,
)
from ..base import MAX_PIECE_SECONDS, Alias, bounded
from .setup import check_flow_backend, check_setup

# GPU memory: what the pool leaves outside torch (cuDNN workspaces, the CUDA context's growth,
# onnxruntime's speech tokenizer), and onnxruntime's own cap within it.
HEADROOM_BYTES = 2 << 30
ORT_GPU_BYTES = 1 << 30
# Upstream splits text into segments of about 80 text tokens (packing sentences, 60 minimum).
MAX_SEGMENT_TOKENS = 80
# Speech tokens per text token at 25 Hz, to estimate a segment's cost for bucketing (English,
# measured on upstream's demo outputs: about 6 to 8; the LM bounds it to 2..20). Scaled by the
# family's token rate (CosyVoice-300M: 50 Hz).
TOKENS_PER_TEXT_TOKEN = 7
# Stage defaults per device (measured in docs/cosyvoice.md):
# decode slots of the LM, segments per planner batch (the pool's queue), items per flow and per
# vocoder call. On CPU the LM gains from batching and the flow and vocoder do not.
STAGE_DEFAULTS = {
    "cpu": {"lm_slots": 16, "window": 48, "flow_batch": 1, "hift_batch": 1},
    "cuda": {"lm_slots": 64, "window": 256, "flow_batch": 32, "hift_batch": 32},
}
# The longest prompt a decode slot is sized for up front: speech tokens of a 30 s prompt (times the
# token rate), plus this many for its text, the segment and control ids; longer ones grow the pool.
PROMPT_SECONDS_RESERVED = 30
PROMPT_TEXT_RESERVED = 200
# Upstream's instructions and prompt transcripts are a sentence or two (a 30 s prompt says about
# 500 characters). 1,000 characters is about 250 text tokens: with a 30 s prompt and the longest
# segment it still fits the decode slot the pool reserves, while 100,000 ran the LM out of memory.
MAX_INSTRUCT_CHARS = 1000
MAX_PROMPT_TEXT_CHARS = 1000
# The speech tokens the LM may make per text token of a segment (its decode bound), plus the segment itself.
LM_TOKENS_PER_TEXT_TOKEN = 21
# Bounds of the numeric options, checked at `run --check` (docs/cosyvoice.md, "Bounds"): upstream's
# speed is used at 0.5 to 2; past these the model makes no better speech, only longer inputs.
SPEED_BOUNDS = (0.25, 4.0)
OPTION_BOUNDS = {
    "max_segment_tokens": (8, 400),
    "max_instruct_chars": (1, 1_000_000),
    "max_prompt_text_chars": (1, 1_000_000),
    "lm_slots": (1, 1024),
    "flow_batch": (1, 1024),
    "hift_batch": (1, 1024),
}


@dataclass(frozen=True)
class CosyVoiceOptions:
    model: Optional[Path] = None
    """The model folder as downloaded (e.g. pretrained_models/CosyVoice2-0.5B); required."""
    speaker: Optional[str] = None
    """An SFT speaker of spk2info.pt, the default voice."""
    prompt_wav: Optional[Path] = None
    """Default zero-shot prompt audio (at most 30 s); rows may give their own prompt_wav."""
    prompt_text: Optional[str] = None
    """What prompt_wav says (without it the prompt only sets the voice, as upstream's cross-lingual mode)."""
    prompt_dir: Optional[Path] = None
    """A folder (besides the corpus file's own) that rows' prompt_wav paths may point into."""
    instruct: Optional[str] = None
    """Default instruction (emotion, speed, dialect, style) for rows without an instruct value:
    CosyVoice2 and 3 with any voice, CosyVoice-300M-Instruct with a built-in speaker."""
    speed: Optional[str] = None
    """Speaking speed (>1 is faster: the mel is resampled in time, as upstream's `speed`), a value or a range
    LOW:HIGH (0.9:1.1) drawn per row, each in [0.25, 4]; unset: 1."""
    precision: str = "fp32"
    """fp32, or bf16/fp16: the LM's and the flow's weights converted once at load (the vocoder stays fp32)."""
    max_segment_tokens: int = MAX_SEGMENT_TOKENS
    """Text tokens per LM segment (upstream packs about 80), 8 to 400."""
    max_instruct_chars: int = MAX_INSTRUCT_CHARS
    """Longest instruction (a row's instruct, or --instruct) in characters, 1 to 1,000,000; a longer row fails
    with the reason."""
    max_prompt_text_chars: int = MAX_PROMPT_TEXT_CHARS
    """Longest prompt transcript (a row's prompt_text, or --prompt-text) in characters, 1 to 1,000,000; a longer
    row fails."""
    lm_slots: Optional[int] = None
    """Decode slots of the LM (continuous batching), 1 to 1024; unset: 16 on CPU, 64 on CUDA."""
    flow_batch: Optional[int] = None
    """Most items per flow call, grouped by their real token counts, 1 to 1024; unset: 1 on CPU, 32 on CUDA."""
    hift_batch: Optional[int] = None
    """Most items per vocoder call, grouped by length, 1 to 1024; unset: 1 on CPU, 32 on CUDA."""
    cuda_graphs: bool = True
    """Replay the LM's decode step from CUDA graphs (CUDA only; false: eager)."""
    flow_backend: str = "torch"
    """What runs the flow's estimator: torch, onnx (ONNX Runtime, CPU or CUDA; fp16 on CUDA with
    --precision fp16/bf16) or tensorrt (ONNX Runtime's TensorRT provider, fp16 likewise). The ONNX
    export is made once per checkpoint and cached in $XDG_CACHE_HOME/cosybatch (~/.cache/cosybatch)."""

    def __post_init__(self) -> None:
        if self.model is None:
            raise UsageError("--engine cosyvoice needs --model DIR (the CosyVoice model folder as downloaded)")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise UsageError(f"--precision must be fp32, bf16 or fp16 (got {self.precision!r})")
        if self.flow_backend not in ("torch", "onnx", "tensorrt"):
            raise UsageError(f"--engine-opt flow_backend must be torch, onnx or tensorrt (got {self.flow_backend!r})")
        ScaleRange.parse(self.speed, "--speed", minimum=SPEED_BOUNDS[0], maximum=SPEED_BOUNDS[1])
        for name, (low, high) in OPTION_BOUNDS.items():
            flag = f"--{name.replace('_', '-')}" if name.startswith("max_") and name != "max_segment_tokens" else None
            bounded(name, getattr(self, name), low, high, flag)


class CosyVoiceEngine(Engine):
    name = "cosyvoice"
    Options = CosyVoiceOptions
    multi_voice = True
    zero_shot = True
    takes_instruct = True  # the model decides: prepare() rejects rows its model cannot follow
    needs_torch_allocator = True
    voice_column_fallback = "speaker"  # its voices are SFT speakers
    aliases = (
        Alias("model", Path, "the model folder as downloaded."),
        Alias("speaker", str, "an SFT speaker of spk2info.pt."),
        Alias("prompt_wav", Path, "default zero-shot prompt audio."),
        Alias("prompt_text", str, "what the prompt audio says."),
        Alias("prompt_dir", Path, "a folder rows' prompt_wav paths may point into."),
        Alias("instruct", str, "the default instruction (emotion, speed, dialect, style) for rows without an "
                               "instruct column value."),
        Alias("precision", str, "fp32|bf16|fp16."),
        Alias("speed", str, "speaking speed, >1 is faster, or a range LOW:HIGH (0.9:1.1) drawn per row (unset: 1)."),
        Alias("max_instruct_chars", int, f"longest instruction in characters (default {MAX_INSTRUCT_CHARS}); "
                                         "a longer row fails."),
        Alias("max_prompt_text_chars", int, f"longest prompt transcript in characters (default "
                                            f"{MAX_PROMPT_TEXT_CHARS}); a longer row fails."),
    )

    @classmethod
    def check(cls, voice: Optional[str], options: EngineOptions) -> dict:
        opts: CosyVoiceOptions = options.engine
        if opts.flow_backend == "tensorrt":
            check_flow_backend(opts.flow_backend, "cuda")
        return check_setup(opts.model, opts.speaker or voice, opts.prompt_wav, opts.prompt_text, opts.instruct,
                           opts.flow_backend)

    def __init__(self, voice: Optional[str], options: EngineOptions):
        import torch

        from ...cosyvoice.flow.onnx import FlowBackendError
        from ...cosyvoice.frontend.features import PromptError, VoiceBank
        from ...cosyvoice.frontend.text import normalize
        from ...cosyvoice.frontend.whisper import TokenizerNotInstalled
        from ...cosyvoice.lm.slots import Sampling
        from ...cosyvoice.model import load_lm, load_text_tokenizer, read_config
        from ...cosyvoice.pipeline import PRECISIONS, Pipeline, Token2Wav
        from ...cosyvoice.weights import ModelDirError

        opts: CosyVoiceOptions = options.engine
        model, precision = opts.model, opts.precision
        speaker = opts.speaker or voice
        prompt_wav, prompt_text = opts.prompt_wav, opts.prompt_text or ""
        self.corpus_dir = Path(options.corpus_dir)
        self.prompt_dir = opts.prompt_dir
        self.max_segment_tokens = opts.max_segment_tokens
        self.max_instruct_chars = opts.max_instruct_chars
        self.max_prompt_text_chars = opts.max_prompt_text_chars

        cuda = torch.cuda.is_available()
        if options.device == "cuda" and not cuda:
            raise UsageError("--device cuda: torch sees no usable CUDA GPU here (check the driver and that the "
                             "installed torch is a CUDA build), or use --device cpu")
        self.device = "cuda" if cuda and options.device != "cpu" else "cpu"
        if self.device == "cpu" and precision != "fp32":
            # Supported by the modules, but not worth it: bf16 convolutions are slow on CPUs without
            # matrix extensions (measured: token -> waveform 6.7x slower than fp32 on this project's CPUs).
            raise UsageError(f"--precision {precision} is for CUDA; on CPU use fp32 (bf16 measured 6.7x slower)")
        if self.device == "cpu":
            # Small ops: one thread per worker is fastest (several workers run side by side).
            torch.set_num_threads(max(1, options.threads))
        else:
            # fp32 matmuls (the vocoder, and everything under --precision fp32) on TF32 tensor cores:
            # a 10-bit mantissa for the products, fp32 accumulation. Convolutions already do (cuDNN's
            # default). Process-wide, as torch's setting is.
            torch.set_float32_matmul_precision("high")
        check_flow_backend(opts.flow_backend, self.device)  # before any weights load
        self.flow_backend = opts.flow_backend
        defaults = STAGE_DEFAULTS[self.device]
        self.lm_slots = opts.lm_slots or defaults["lm_slots"]
        self.flow_batch = opts.flow_batch or defaults["flow_batch"]
        self.hift_batch = opts.hift_batch or defaults["hift_batch"]
        self.window = defaults["window"]
        self.cuda_graphs = opts.cuda_graphs
        self.model_dir = Path(model)
        self.precision = precision
        try:
            config = read_config(self.model_dir)
            self.family = config.family
            self.config = config
            check_flow_backend(opts.flow_backend, None, config.family)
            self.sampling = Sampling.from_yaml(config.llm)
            self.tokenizer = load_text_tokenizer(config)
            self.lm = load_lm(config, self.device, PRECISIONS[precision] or torch.float32)
            self.t2w = Token2Wav(config, self.device, precision, flow_backend=opts.flow_backend)
            self.pipeline = Pipeline(self.lm, self.sampling, self.t2w, self.lm_slots, self.flow_batch,
                                     self.hift_batch, self._tokens_per_text_token() * self.max_segment_tokens,
                                     self.cuda_graphs, max_piece_seconds=MAX_PIECE_SECONDS)
        except FlowBackendError as exc:
            raise UsageError(f"--engine-opt flow_backend={opts.flow_backend}: {exc}") from None
        except (ModelDirError, OSError, ValueError, TokenizerNotInstalled) as exc:
            raise UsageError(f"--model {self.model_dir}: {exc}") from None
        providers = None
        if self.device == "cuda":
            from ... import gpu

            # The speech tokenizer runs on onnxruntime's CUDA provider, outside torch's pool: it gets
            # a capped arena inside the headroom the pool leaves free.
            providers = [("CUDAExecutionProvider", gpu.ort_cuda_options(ORT_GPU_BYTES)), "CPUExecutionProvider"]
        self.voices = VoiceBank(self.model_dir, providers=providers, mel=config.mel,
                                speech_tokenizer=self.family.speech_tokenizer, mel_per_token=config.token_mel_ratio)
        self._prompt_tokens: dict[tuple[str, Optional[str]], tuple[int, ...]] = {}
        from ...corpus import clean_text

        self.default_instruct = clean_text(opts.instruct) or None if opts.instruct is not None else None
        self.speed = ScaleRange.parse(opts.speed, "--speed", minimum=SPEED_BOUNDS[0], maximum=SPEED_BOUNDS[1])
        if self.speed is not None and self.speed.describe() == 1.0:
            self.speed = None  # 1 is no change (and the fingerprint of a job without it)
        from ...cosyvoice.family import variant

        self.variant = variant(self.model_dir, self.family)
        self.sample_rate = self.t2w.sample_rate
        self.seed = options.seed
        self._PromptError = PromptError
        self._normalize = normalize
        self._torch = torch

        # The job's default voice is checked now: a bad --speaker or --prompt-wav is a usage error.
        self.default_voice = None
        try:
            reason = self._length_refusal(prompt_text, self.default_instruct)
            if reason:
                raise UsageError(f"the job's default {reason}")
            if prompt_wav is not None:
                self.default_voice = self.voices.prompt(Path(prompt_wav), prompt_text)
                self.voice_name = f"prompt:{Path(prompt_wav).name}"
            elif speaker is not None:
                self.default_voice = self.voices.speaker(speaker)
                self.voice_name = speaker
            else:
                self.voice_name = "per-row"
        except PromptError as exc:
            raise UsageError(str(exc)) from None
        if self.default_instruct is not None and self.default_voice is not None:
            reason = self._instruct_refusal(self.default_voice)
            if reason:
                raise UsageError(f"--instruct: {reason}")
        self._files = {n: file_fingerprint(self.model_dir / n) for n in ("llm.pt", "flow.pt", "hift.pt")}
        self.pool_info: Optional[dict] = None
        self.probed_budget: Optional[int] = None
        if self.device == "cuda":
            self._set_up_memory(options.memory_fraction)

    def _set_up_memory(self, fraction: float) -> None:
        """Cap and pre-allocate torch's pool, then size the batch budget from a warm-up probe."""
        from dataclasses import asdict

        from ... import gpu

        # The LM's KV cache is one fixed slot pool, allocated first: like the weights, it is outside
        # the reserved pool and outside what the probe measures.
        slots = self.lm.slot_pool(self.lm_slots, self._slot_capacity(), 20 * self._longest_segment(), self.sampling,
                                  self.cuda_graphs)
        graph_room = self._capture_first(slots)
        pool = gpu.setup_pool(fraction, self.device, headroom_bytes=HEADROOM_BYTES + graph_room)
        per_unit = self._probe()
        self.probed_budget = gpu.budget_from_probe(per_unit, pool.pool_bytes)
        self.pool_info = asdict(pool) | {"bytes_per_cost_unit": per_unit, "probed_budget": self.probed_budget,
                                         "graph_room_bytes": graph_room}

    def _capture_first(self, slots) -> int:
        """Capture the decode step's largest CUDA graph (every slot, the whole window) before the pool
        is reserved and before any worker starts, and return the room the pool must leave for graphs.

        Graph memory is outside the reserved pool: under cudaMallocAsync torch ignores the graph pool
        handle, so each graph's memory comes from the driver beside the pool (and outside the cap);
        under the native allocator all graphs share one private pool, which reuses the largest
        graph's memory. The room is what the largest capture took from the driver (the driver's free
        memory before and after; its eager warm-up runs first, outside the measurement, since the
        pool reuses that memory), times the number of graphs the pool may capture under
        cudaMallocAsync (the smaller ones need less: an upper bound), once under native. 0 without
        CUDA graphs."""
        torch = self._torch
        if not slots.use_graphs:
            return 0
        largest = [(slots.slots, slots.capacity)]
        self.pipeline.totals.add(slots.capture_ahead(largest, warm_up_only=True))
        torch.cuda.synchronize()
        free = int(torch.cuda.mem_get_info()[0])
        stats = slots.capture_ahead(largest)
        torch.cuda.synchronize()
        measured = max(0, free - int(torch.cuda.mem_get_info()[0]))
        self.pipeline.totals.add(stats)
        graphs = len(slots.graph_keys()) if torch.cuda.get_allocator_backend() == "cudaMallocAsync" else 1
        return measured * graphs

    def _probe(self) -> dict[str, float]:
        """Peak bytes per padded cost unit of each stage.

        The flow and the vocoder run on two synthetic segments of the longest planned length (their
        attention grows faster than linearly, so the longest is the costliest per unit). The LM's
        KV cache is not per unit: its slot pool is allocated before the probe."""
        from ... import gpu
        from ...cosyvoice.flow.cfm import FlowInput
        from ...cosyvoice.lm.slots import LMRequest

        torch = self._torch
        rows, text_len = 2, self.max_segment_tokens
        tokens = self._tokens_per_text_token() * text_len
        units = rows * tokens
        embedding = torch.zeros(192)
        # CosyVoice3's LM refuses a prompt without <|endofprompt|>: the probe's carries the system prompt.
        prompt_text = self._lm_prompt_text(None, None)
        requests = [LMRequest(text=list(range(100, 100 + text_len)), prompt_text=prompt_text, seed=i, min_tokens=8,
                              max_tokens=8, embedding=embedding)
                    for i in range(rows)]
        items = [FlowInput(torch.arange(tokens) % self.lm.speech_token_size, embedding) for _ in range(rows)]
        mels = self.t2w.mels(items)
        return {
            "lm": gpu.probe_stage(lambda: self.lm.generate(requests, self.sampling, slots=self.lm_slots,
                                                           cuda_graphs=self.cuda_graphs), units, self.device),
            "flow": gpu.probe_stage(lambda: self.t2w.mels(items), units, self.device),
            "hift": gpu.probe_stage(lambda: self.t2w.vocode(mels, list(range(rows))), units, self.device),
        }

    def _longest_segment(self) -> int:
        """Text tokens of the longest segment the frontend makes (it packs to max_segment_tokens but
        keeps an over-long sentence whole up to twice that)."""
        return 2 * self.max_segment_tokens

    def _slot_capacity(self) -> int:
        prompt = PROMPT_SECONDS_RESERVED * self.config.token_frame_rate + PROMPT_TEXT_RESERVED
        return prompt + 21 * self._longest_segment() + 1

    def lm_context_tokens(self) -> int:
        """The positions one row's segment may take in the LM: the decode slot the pool reserves (a
        30 s prompt, its text and instruction, the longest segment and the speech tokens it may make).
        A longer prompt would grow every slot of the pool and its attention (100,000 characters of
        instruction took the tiny model past 12 GB), so such a row fails instead."""
        return self._slot_capacity()

    def _length_refusal(self, prompt_text: Optional[str], instruct: Optional[str]) -> Optional[str]:
        """Why a prompt transcript or instruction is too long to read (None: it is not); checked on
        characters before anything tokenises or normalises it."""
        for column, value, limit, option in (("prompt_text", prompt_text, self.max_prompt_text_chars,
                                              "max_prompt_text_chars"),
                                             ("instruct", instruct, self.max_instruct_chars, "max_instruct_chars")):
            if value is not None and len(value) > limit:
                return (f"{column} is {len(value):,} characters, over the limit of {limit:,} "
                        f"(--{option.replace('_', '-')}); shorten it")
        return None

    def _tokens_per_text_token(self) -> int:
        return TOKENS_PER_TEXT_TOKEN * self.config.token_frame_rate // 25

    def describe(self) -> dict:
        return {
            # Only for the newer families, so fingerprints of earlier CosyVoice2 runs stay valid.
            **({"family": self.variant} if self.family.version != 2 else {}),
            "model": self.model_dir.name,
            "model_files": self._files,
            "sample_rate": self.sample_rate,
            "precision": self.precision,
            "voice": None if self.default_voice is None else self.default_voice.key,
            "sampling": self.sampling.describe(),
            "max_segment_tokens": self.max_segment_tokens,
            # Only when not the default, so fingerprints of earlier runs stay valid.
            **({"flow_backend": self.flow_backend} if self.flow_backend != "torch" else {}),
            **({"instruct": self.default_instruct} if self.default_instruct is not None else {}),
            **({"speed": self.speed.describe()} if self.speed is not None else {}),
        }

    def memory_plan(self) -> MemoryPlan:
        return MemoryPlan(self.probed_budget, self.pool_info)

    def estimate_seconds(self, piece: Piece) -> float:
        """Text tokens -> the speech tokens the planner expects of them (TOKENS_PER_TEXT_TOKEN,
        about 7 at 25 Hz for English) -> seconds at the family's token rate; the prompt's are not spoken."""
        return self._tokens_per_text_token() * len(piece.payload.text_tokens) / self.config.token_frame_rate

    def runtime_stats(self) -> dict:
        """The LM's slot pool over the run (stats.json's ``engine_stats.lm``): decode steps, CUDA graphs
        captured and replayed, eager steps, failed captures (each also warned), host syncs."""
        pool = self.lm._pool
        return {"lm": self.pipeline.totals.as_dict() | {
            "graphs_held": len(pool.graphs) if pool is not None else 0,
            "stage_streams": self.pipeline.streams.enabled}}

    def batch_defaults(self) -> tuple[int, int]:
        """(segments per planner batch, padded cost per segment): a planner batch is the queue of
        the LM's slot pool, a few times the slots so they stay full while rows finish."""
        return self.window, self._tokens_per_text_token() * MAX_SEGMENT_TOKENS

    # -- voices -------------------------------------------------------------------------------
    def _voice(self, request: Optional[VoiceRequest]):
        named = request is not None and request.name is not None and (request.from_row or request.pooled)
        if request is None or (request.prompt_wav is None and not named):
            if self.default_voice is None:
                raise RowRejected("no voice: give --speaker NAME or --prompt-wav/--prompt-text, "
                                  "or speaker / prompt_wav columns in the corpus")
            return self.default_voice
        try:
            if request.prompt_wav is not None:
                path = self._row_prompt_path(request.prompt_wav) if request.from_row else Path(request.prompt_wav)
                return self.voices.prompt(path, request.prompt_text or "")
            return self.voices.speaker(request.name)
        except self._PromptError as exc:
            raise RowRejected(str(exc)) from None

    def _row_prompt_path(self, value: str) -> Path:
        """A corpus row's prompt path: relative to the corpus folder, and inside it or --prompt-dir.

        A corpus is untrusted input: it may not make the job read (or probe for) files elsewhere."""
        if "\x00" in value:  # the OS refuses it with a ValueError, not an OSError
            raise RowRejected(f"prompt_wav {value!r} holds a NUL byte; a path cannot")
        path = (self.corpus_dir / value).resolve()
        roots = [self.corpus_dir.resolve()] + ([self.prompt_dir.resolve()] if self.prompt_dir else [])
        if not any(path.is_relative_to(root) for root in roots):
            allowed = " or ".join(str(r) for r in roots)
            raise RowRejected(f"prompt_wav {value!r} is outside {allowed}; rows may only name prompt files "
                              "there (pass --prompt-dir DIR to allow another folder)")
        return path

    def _instruct_refusal(self, voice) -> Optional[str]:
        """Why this model cannot speak ``voice`` with an instruction (None: it can)."""
        if self.family.instruct == "prompt":
            return None  # CosyVoice2 and 3: an instruction beside any voice (upstream's instruct2)
        if "Instruct" not in self.variant:
            return (f"this {self.variant} folder ({self.model_dir.name}) cannot follow instructions; use the "
                    "CosyVoice-300M-Instruct folder, CosyVoice2 or CosyVoice3, or drop the instruction")
        if voice.prompt_tokens is not None:
            return ("CosyVoice-300M-Instruct follows instructions with a built-in speaker (--speaker or a "
                    "speaker column), not with prompt audio")
        return None

    def _lm_prompt_text(self, voice, instruct: Optional[str]) -> tuple[int, ...]:
        """The LM's prompt text for a voice (None: no voice's transcript) and instruction, as
        upstream's frontends build it:
        - zero-shot: the prompt's transcript; instruct: the instruction, ended by <|endofprompt|>
          (CosyVoice-300M-Instruct: normalised, then <endofprompt>, as its release's frontend does);
        - CosyVoice3: its system prompt and <|endofprompt|> first, unless the text already holds
          <|endofprompt|> (upstream's examples write them into the text).
        Text holding a <|...|> tag is not normalised (upstream's rule)."""
        from ...cosyvoice.family import ENDOFPROMPT, V1_ENDOFPROMPT

        transcript = voice.prompt_text if voice is not None else ""
        key = (voice.key if voice is not None else "", instruct)
        cached = self._prompt_tokens.get(key)
        if cached is not None:
            return cached
        system = self.family.system_prompt
        if instruct is not None and self.family.instruct == "speaker":
            text = instruct.rstrip()
            if not text.endswith((ENDOFPROMPT, V1_ENDOFPROMPT)):
                text = self._normalize(text) + V1_ENDOFPROMPT
        elif instruct is not None:
            text = instruct.rstrip()
            if not text.endswith(ENDOFPROMPT):
                text += ENDOFPROMPT
            if system and not text.startswith(system) and text.count(ENDOFPROMPT) == 1:
                text = f"{system} {text}"
        elif system and ENDOFPROMPT not in transcript:
            text = f"{system}{ENDOFPROMPT}{transcript}"
        else:
            text = transcript
        if text and not ("<|" in text and "|>" in text) and not text.endswith(V1_ENDOFPROMPT):
            text = self._normalize(text)
        cached = self._prompt_tokens[key] = tuple(self.tokenizer.encode(text)) if text else ()
        return cached

    # -- text ---------------------------------------------------------------------------------
    def prepare(self, text: str, item_id: str, voice: Optional[VoiceRequest] = None, attempt: int = 0) -> Prepared:
        from ...cosyvoice.frontend.text import frontend_segments
        from ...cosyvoice.pipeline import Segment

        if voice is not None:
            reason = self._length_refusal(voice.prompt_text, voice.instruct)
            if reason:
                raise RowRejected(reason)
        chosen = self._voice(voice)
        instruct = voice.instruct if voice is not None and voice.instruct is not None else self.default_instruct
        if instruct is not None:
            reason = self._instruct_refusal(chosen)
            if reason:
                raise RowRejected(f"instruct: {reason}")
        try:
            segments = frontend_segments(text, self.tokenizer, max_tokens=self.max_segment_tokens)
        except ValueError as exc:
            raise RowRejected(str(exc)) from None
        prompt_text = self._lm_prompt_text(chosen, instruct)
        if len(self._prompt_tokens) > 4096:  # one entry per (voice, instruction): bounded
            self._prompt_tokens.clear()
        # The LM reads the prompt's speech tokens in zero-shot mode only: a prompt given without its
        # transcript is upstream's cross-lingual mode, and instruct mode replaces the transcript.
        lm_speech = chosen.prompt_tokens is not None and bool(chosen.prompt_text) and instruct is None
        # A prompt's speech tokens ride along in the flow (and in the LM when it reads them).
        prompt_cost = 0 if chosen.prompt_tokens is None else len(chosen.prompt_tokens)
        per_token = self._tokens_per_text_token()
        # What one segment may cost the LM at most: its prompt (prompt text or instruction, the
        # prompt's speech tokens when the LM reads them, control ids) and the segment with the
        # speech tokens it may make. Over the slot the pool reserves, the row fails.
        lm_prompt = len(prompt_text) + (len(chosen.prompt_tokens) if lm_speech else 0) + 3
        longest = max(len(tokens) for _, tokens in segments)
        needed = lm_prompt + LM_TOKENS_PER_TEXT_TOKEN * longest + 1
        if needed > self.lm_context_tokens():
            raise RowRejected(f"the row needs {needed:,} LM positions (prompt text and instruction {len(prompt_text):,}"
                              f" tokens, prompt speech {lm_prompt - len(prompt_text) - 3:,}, longest segment "
                              f"{longest} text tokens), over the {self.lm_context_tokens():,} a decode slot "
                              "holds; shorten the prompt text, instruction or prompt audio")
        costs, payloads = [], []
        speed = 1.0 if self.speed is None else self.speed.draw(self.seed, item_id, attempt, "speed")
        for part, (_, tokens) in enumerate(segments):
            payloads.append(Segment(tuple(tokens), chosen, prompt_text, item_seed(self.seed, item_id, part, attempt),
                                    lm_speech=lm_speech, lm_embedding=instruct is None, speed=speed))
            costs.append(max(1, per_token * len(tokens) + prompt_cost))
        spoken = " ".join(seg for seg, _ in segments)
        drawn = {"speed": speed} if self.speed is not None and not self.speed.fixed else None
        pieces = tuple(Piece(c, p, text=seg) for c, p, (seg, _) in zip(costs, payloads, segments, strict=True))
        return Prepared(pieces, spoken, voice=chosen.key, instruct=instruct, meta=drawn)

    # -- audio --------------------------------------------------------------------------------
    def synthesize(self, units: Sequence[Unit]) -> Synthesised:
        """The LM decodes every segment in its slot pool; then the flow and the vocoder take the
        segments regrouped by the speech tokens the LM really made, longest first, each stage in
        its own batch sizes (see :mod:`cosybatch.cosyvoice.pipeline`)."""
        audio, lm_stats, lm_info = self.pipeline.synthesize([u.payload for u in units])
        # Padding statistics are the LM's: rows decoded (tokens made) against slot-steps computed.
        return Synthesised(audio, lm_stats.live_slot_steps, lm_stats.slot_steps, lm=lm_info)
