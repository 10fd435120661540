"""The run configuration: every option of `cosybatch run`, typed, documented and checked."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import UsageError


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class RunConfig:
    corpus: Path
    """Parquet or JSONL(.gz) corpus file."""
    out: Path
    """Output folder: shards, manifest, stats; rerunning on it resumes."""
    format: Optional[str] = None
    """'parquet' or 'jsonl'; unset: chosen by file suffix."""
    id_col: Optional[str] = None
    """Id column; unset: uses 'id' when present, else the row number."""
    text_col: str = "text"
    """Text column."""
    voice_col: Optional[str] = None
    """Per-row voice column; unset: uses 'voice' when present."""
    engine: str = "piper"
    """Engine name."""
    voice: Optional[str] = None
    """Default voice: a name (bundled or in voice_dir) or a path to a Piper .onnx file."""
    voice_dir: Optional[Path] = None
    """Folder holding NAME.onnx + NAME.onnx.json voices that corpus rows may name."""
    speaker: Optional[str] = None
    """Speaker name or id for multi-speaker voices; CosyVoice: an SFT speaker of spk2info.pt."""
    model: Optional[Path] = None
    """CosyVoice: the model folder as downloaded (e.g. pretrained_models/CosyVoice2-0.5B)."""
    prompt_wav: Optional[Path] = None
    """CosyVoice: default zero-shot prompt audio (at most 30 s); rows may give their own prompt_wav."""
    prompt_text: Optional[str] = None
    """CosyVoice: what prompt_wav says (without it the prompt only sets the voice, as upstream's cross-lingual mode)."""
    prompt_dir: Optional[Path] = None
    """CosyVoice: a folder (besides the corpus file's own) that rows' prompt_wav paths may point into."""
    precision: str = "fp32"
    """CosyVoice: fp32, or bf16/fp16 autocast for the LM and flow on CUDA."""
    memory_fraction: float = 0.9
    """GPU: share of device memory for the job, in (0, 1]; CosyVoice pre-allocates it, Piper caps onnxruntime to it."""
    device: str = "auto"
    """auto (CUDA when onnxruntime has it, else CPU), cpu or cuda."""
    batch_size: Optional[int] = None
    """Most units per batch; unset: 1 on CPU (fastest there, measured), 64 on GPU."""
    batch_budget: Optional[int] = None
    """Most padded cost per batch (batch size x longest unit, in phoneme ids); unset: batch size x 256."""
    workers: Optional[int] = None
    """Inference threads sharing the engine; unset: one per CPU core on CPU, 2 on GPU."""
    threads: int = 1
    """Intra-op threads per inference call (CPU)."""
    window: int = 20000
    """Rows sorted together by length; bounds memory on corpora of any size."""
    seed: int = 0
    """Job seed; each item's noise is seeded from (seed, id), so reruns reproduce audio."""
    noise_scale: Optional[float] = None
    """Piper generator noise; unset: the voice's default."""
    length_scale: Optional[float] = None
    """Piper speaking-rate factor (>1 is slower); unset: the voice's default."""
    noise_w: Optional[float] = None
    """Piper duration noise; unset: the voice's default."""
    conv2d: Optional[bool] = None
    """Piper: run 1-D convolutions as 2-D ones (same result, ~1.2x faster on CPU); unset: on for CPU."""
    sentence_silence: float = 0.0
    """Seconds of silence inserted between the sentences of one row."""
    normalize: bool = True
    """Scale each clip to a full-scale peak (as piper's CLI does)."""
    shard_max_items: int = 1000
    """Close a shard after this many items."""
    shard_max_bytes: int = 256 * 1024 * 1024
    """Close a shard once it reaches this many bytes."""
    limit: Optional[int] = None
    """Read only the first N rows of the corpus."""
    max_chars: int = 20000
    """Rows with longer text fail with a reason (about 20 minutes of speech at the default)."""
    max_runtime: Optional[float] = None
    """Stop taking new batches after this many seconds, commit, exit 4 (resumable)."""
    max_failures: Optional[str] = None
    """Fail the run (exit 5) past this many failed rows ('100') or this share of rows ('2%')."""
    shard_index: Optional[int] = None
    """This worker's shard (0-based) when the corpus is split over shard_count workers."""
    shard_count: Optional[int] = None
    """Number of workers the corpus is split over by a stable hash of each id."""
    metrics_file: Optional[Path] = None
    """Prometheus textfile (for node_exporter), rewritten atomically during and after the run."""
    pushgateway: Optional[str] = None
    """Prometheus Pushgateway URL to push the final metrics to."""
    export: tuple = ()
    """Dataset formats to write at the end besides WebDataset: hf, nemo, lhotse."""
    restart: bool = False
    """Delete the output folder's earlier cosybatch output and start over."""
    allow_corpus_change: bool = False
    """Resume although the corpus file changed: committed ids are kept, new ids synthesised, and
    committed rows that changed or went are listed in corpus_changes.jsonl."""
    progress: str = "auto"
    """auto (bar on a terminal, log lines otherwise), bar, log or none."""
    log_every: float = 30.0
    """Seconds between progress log lines when not on a terminal."""

    def __post_init__(self) -> None:
        positive = ("batch_size", "batch_budget", "workers", "threads", "window", "shard_max_items",
                    "shard_max_bytes", "limit", "max_chars")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"--device must be auto, cpu or cuda (got {self.device!r})")
        if self.progress not in ("auto", "bar", "log", "none"):
            raise UsageError(f"--progress must be auto, bar, log or none (got {self.progress!r})")
        if self.sentence_silence < 0:
            raise UsageError("--sentence-silence must be >= 0")
        if self.length_scale is not None and self.length_scale <= 0:
            raise UsageError("--length-scale must be > 0")
        self.failure_limit()
        if (self.shard_index is None) != (self.shard_count is None):
            raise UsageError("give both the shard index and the shard count (--shard I/N)")
        if self.shard_count is not None and not 0 <= self.shard_index < self.shard_count:
            raise UsageError(f"--shard {self.shard_index}/{self.shard_count}: "
                             f"the index must be in 0..{self.shard_count - 1}")
        unknown = set(self.export) - {"hf", "nemo", "lhotse"}
        if unknown:
            raise UsageError(f"--export: unknown format(s) {sorted(unknown)}; choose from hf, nemo, lhotse")
        if self.max_runtime is not None and self.max_runtime <= 0:
            raise UsageError("--max-runtime must be > 0 seconds")
        from .gpu import validate_fraction

        validate_fraction(self.memory_fraction)
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise UsageError(f"--precision must be fp32, bf16 or fp16 (got {self.precision!r})")
        if self.engine == "cosyvoice" and self.model is None:
            raise UsageError("--engine cosyvoice needs --model DIR (the CosyVoice2-0.5B folder as downloaded)")
        if self.engine != "cosyvoice":
            given = [n for n in ("model", "prompt_wav", "prompt_text", "prompt_dir") if getattr(self, n) is not None]
            if given:
                raise UsageError(f"--{given[0].replace('_', '-')} is a CosyVoice option; add --engine cosyvoice")
        for name in ("noise_scale", "noise_w"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 0")

    def failure_limit(self) -> tuple[Optional[int], Optional[float]]:
        """(count, rate) from max_failures; at most one is set."""
        if self.max_failures is None:
            return None, None
        text = self.max_failures.strip()
        try:
            if text.endswith("%"):
                rate = float(text[:-1]) / 100
                if not 0 <= rate <= 1:
                    raise ValueError
                return None, rate
            count = int(text)
            if count < 0:
                raise ValueError
            return count, None
        except ValueError:
            raise UsageError(f"--max-failures {self.max_failures!r}: give a count (100) or a percentage (2%)") from None

    def engine_extra(self) -> dict:
        if self.engine == "cosyvoice":
            return {
                "model": self.model,
                "speaker": self.speaker,
                "prompt_wav": self.prompt_wav,
                "prompt_text": self.prompt_text,
                "precision": self.precision,
                "memory_fraction": self.memory_fraction,
                "prompt_dir": self.prompt_dir,
                # Relative prompt_wav paths in rows are read relative to the corpus file's folder.
                "corpus_dir": Path(self.corpus).resolve().parent,
            }
        return {
            "noise_scale": self.noise_scale,
            "length_scale": self.length_scale,
            "noise_w": self.noise_w,
            "speaker": self.speaker,
            "voice_dir": self.voice_dir,
            "memory_fraction": self.memory_fraction,
            **({} if self.conv2d is None else {"conv2d": self.conv2d}),
        }

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Field name -> docstring, for the CLI help."""
        import ast
        import inspect
        import itertools

        docs = {}
        body = ast.parse(inspect.getsource(cls)).body[0].body
        for node, nxt in itertools.pairwise(body):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
        return docs
