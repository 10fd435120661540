"""The run configuration: every option of `cosybatch run`, typed, documented and checked."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .engines import DEFAULT_ENGINE
from .errors import UsageError


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class RunConfig:
    corpus: Path
    """Corpus file: Parquet, JSONL(.gz), CSV, TSV or plain text (one row a line)."""
    out: Path
    """Output folder: shards, manifest, stats; rerunning on it resumes."""
    format: Optional[str] = None
    """parquet, jsonl, csv, tsv or text (one row a line); unset: chosen by file suffix."""
    id_col: Optional[str] = None
    """Id column; unset: uses 'id' when present, else the row number."""
    text_col: str = "text"
    """Text column."""
    voice_col: Optional[str] = None
    """Per-row voice column; unset: uses 'voice' when present."""
    engine: str = DEFAULT_ENGINE
    """Engine name: a built-in or an installed plugin (`cosybatch engines` lists them)."""
    voice: Optional[str] = None
    """Default voice: whatever the engine takes as a voice (a voice name, a model path, a speaker)."""
    voice_pool: tuple = ()
    """Voices for rows without their own (docs/input.md "Voice pools"): VOICE, VOICE#SPEAKER, a prompt .wav or
    a folder of voices or prompts, each optionally :WEIGHT, comma-separated."""
    voice_pool_mode: str = "hash"
    """How a row gets a pool voice: hash (a seeded hash of its id: the same under resume, --shard, ray-run) or
    balanced (the voice with the least predicted audio so far, in file order)."""
    voice_map: dict = field(default_factory=dict)
    """Voices by the rows' language column: LANGUAGE=VOICE (or VOICE|VOICE, a pool), comma-separated."""
    engine_options: dict = field(default_factory=dict)
    """The engine's own settings, KEY -> value, checked against its options (--engine-opt KEY=VALUE)."""
    memory_fraction: float = 0.9
    """GPU: share of device memory for the job, in (0, 1]; engines pre-allocate or cap to it."""
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
    sentence_silence: float = 0.0
    """Seconds of silence inserted between the sentences of one row."""
    normalize: bool = True
    """Scale each clip to a full-scale peak."""
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
    metrics_job: Optional[str] = None
    """Job name for metrics: the Pushgateway job and the cosybatch_job label; unset: the output
    folder's name plus a hash of its full path."""
    export: tuple = ()
    """Dataset formats to write at the end besides WebDataset: hf, nemo, lhotse."""
    export_copy: bool = False
    """The NeMo and Lhotse exports copy the audio out as loose WAV files instead of pointing into the shards."""
    restart: bool = False
    """Delete the output folder's earlier cosybatch output and start over."""
    allow_corpus_change: bool = False
    """Resume although the corpus file changed: committed ids are kept, new ids synthesised, and
    committed rows that changed or went are listed in corpus_changes.jsonl."""
    qc: str = "signals"
    """Quality checks: off; signals (measured and recorded per clip, nothing dropped); gate (a flagged clip is
    made again, then dropped or kept per --qc-on-fail); asr (gate, plus a Whisper round trip scored by CER)."""
    qc_asr_rows: str = "flagged"
    """With --qc asr, which clips the ASR hears: flagged (by the cheap signals), all, or sample (flagged ones
    and a seeded --qc-sample share of the rest)."""
    qc_sample: float = 0.1
    """Share of unflagged clips transcribed with --qc-asr-rows sample."""
    qc_asr_model: Optional[Path] = None
    """CTranslate2 Whisper folder for --qc asr; unset: Whisper tiny.en from the cosybatch[qc] extra."""
    qc_max_cer: float = 0.2
    """A transcribed clip fails above this character error rate."""
    qc_max_wer: Optional[float] = None
    """A transcribed clip fails above this word error rate (unset: WER is recorded, not gated)."""
    qc_retries: int = 2
    """Takes of a failing row after the first, each with a new seed."""
    qc_on_fail: str = "drop"
    """A row with no passing take: drop (fails, with the reason) or keep (its best take, marked qc.pass false)."""
    qc_limits: dict = field(default_factory=dict)
    """The signal thresholds (`[qc]` table of a job spec): max_z, max_gap_s, min_speech_share, ..."""
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
        self.failure_limit()
        if (self.shard_index is None) != (self.shard_count is None):
            raise UsageError("give both the shard index and the shard count (--shard I/N)")
        if self.shard_count is not None and not 0 <= self.shard_index < self.shard_count:
            raise UsageError(f"--shard {self.shard_index}/{self.shard_count}: "
                             f"the index must be in 0..{self.shard_count - 1}")
        unknown = set(self.export) - {"hf", "nemo", "lhotse"}
        if unknown:
            raise UsageError(f"--export: unknown format(s) {sorted(unknown)}; choose from hf, nemo, lhotse")
        if self.max_runtime is not None and not 0 < self.max_runtime < float("inf"):
            raise UsageError("--max-runtime must be a finite number of seconds > 0")
        self.qc_settings()  # mode, rows, limits are valid
        self._check_voices()
        from .gpu import validate_fraction

        validate_fraction(self.memory_fraction)
        self.engine_settings()  # the engine exists and its options are valid

    def _check_voices(self) -> None:
        """Parse --voice-pool and --voice-map (a string or a job spec's list / table) and check
        that the engine can speak what they name."""
        from .voices import MODES, parse_pool, parse_voice_map

        if self.voice_pool_mode not in MODES:
            raise UsageError(f"--voice-pool-mode must be {' or '.join(MODES)} (got {self.voice_pool_mode!r})")
        object.__setattr__(self, "voice_pool", parse_pool(self.voice_pool))
        object.__setattr__(self, "voice_map", parse_voice_map(self.voice_map))
        cls = self.engine_class()
        for entry in (*self.voice_pool, *(e for pool in self.voice_map.values() for e in pool)):
            if entry.prompt_wav is not None and not cls.zero_shot:
                raise UsageError(f"--voice-pool: engine {cls.name!r} takes no prompt audio "
                                 f"({entry.prompt_wav}); use an engine that clones voices, or name voices")
            if entry.speaker is not None and cls.multi_voice:
                raise UsageError(f"--voice-pool: engine {cls.name!r} names its speakers as voices; write "
                                 f"{entry.speaker!r} without '#'")

    def voice_router(self):
        """The job's pools (cosybatch.voices.VoiceRouter)."""
        from .voices import VoiceRouter

        return VoiceRouter(self.voice_pool, self.voice_map, self.voice_pool_mode, self.seed)

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

    def qc_settings(self):
        """The quality gate's settings (cosybatch.qc.gate.QCSettings), checked."""
        from .qc.gate import Limits, QCSettings

        unknown = set(self.qc_limits) - set(Limits.names())
        if unknown:
            raise UsageError(f"[qc]: unknown threshold(s) {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(Limits.names())}")
        try:
            limits = Limits(**{**self.qc_limits, "max_cer": self.qc_max_cer, "max_wer": self.qc_max_wer})
        except TypeError as exc:
            raise UsageError(f"[qc]: {exc}") from None
        for name in Limits.names():
            value = getattr(limits, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise UsageError(f"[qc] {name} = {value!r} should be a number")
        return QCSettings(self.qc, self.qc_asr_rows, self.qc_sample, self.qc_retries, self.qc_on_fail, limits)

    def engine_class(self):
        from .engines import engine_class

        return engine_class(self.engine)

    def engine_settings(self):
        """The engine's options dataclass, filled from engine_options (errors name the key)."""
        from .engines import parse_engine_options

        return parse_engine_options(self.engine_class(), self.engine_options)

    def engine_options_for(self, device: Optional[str] = None, allow_paths: bool = True):
        """What the job hands the engine (EngineOptions), on `device` (default: --device)."""
        from .engines import EngineOptions

        # Relative paths in rows are read relative to the corpus file's folder.
        return EngineOptions(device or self.device, self.threads, self.seed, self.memory_fraction,
                             Path(self.corpus).resolve().parent, allow_paths, self.engine_settings())

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Field name -> docstring, for the CLI help."""
        return field_docs(cls)


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field name -> the docstring written under the field."""
    import ast
    import inspect
    import itertools

    docs = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs
