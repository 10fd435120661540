"""The run configuration: every option of `cosybatch run`, typed, documented and bounded.

A `RunConfig` is six frozen sections, one per stage of the data path: `input` (the corpus),
`engine` (what makes the audio), `batching`, `output` (the folder, its shards and exports),
`quality` (the QC gate) and `ops` (limits, metrics, progress). Each field has a docstring, a
default and, where it is a number, documented bounds checked on construction: a value outside
them (NaN and infinities included) is a UsageError naming the option and the allowed range.

Two routes build one, both used by the CLI:
  RunConfig.from_options(batch_size=8, qc_max_cer=0.1, ...)   the flat option names of `cosybatch run`
  cosybatch.jobspec.config_from_spec("job.toml", seed=7)      a job spec, overridden by flat options
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

from .engines import DEFAULT_ENGINE
from .errors import UsageError
from .store.audio import FORMATS


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# -- bounds ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bounds:
    """A closed or half-open range a numeric setting must lie in; every value is also finite."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def text(self) -> str:
        return f"{'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"

    def check(self, option: str, value: Any) -> None:
        """UsageError naming `option` unless `value` (None allowed: unset) is in range."""
        if value is None:
            return
        kind = "a whole number" if self.integer else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                self.integer and not isinstance(value, int)):
            raise UsageError(f"{option} {value!r}: must be {kind} in {self.text()}")
        inside = (math.isfinite(value)
                  and (self.low < value if self.low_open else self.low <= value)
                  and (value < self.high if self.high_open else value <= self.high))
        if not inside:  # NaN fails every comparison, so it lands here
            raise UsageError(f"{option} must be {kind} in {self.text()} (got {value!r})")


def _num(value: float) -> str:
    if isinstance(value, int) and abs(value) >= 100_000:
        return f"{value:_}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def bounded(default: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False,
            integer: bool = False) -> Any:
    """A dataclass field with `default` whose value must lie in the given range (see Bounds)."""
    return field(default=default, metadata={"bounds": Bounds(low, high, low_open, high_open, integer)})


def _check_bounds(section: Any) -> None:
    for f in fields(section):
        bounds = f.metadata.get("bounds")
        if bounds is not None:
            bounds.check(option_label(type(section).SECTION, f.name), getattr(section, f.name))


def _choice(option: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise UsageError(f"{option} must be {', '.join(allowed[:-1])} or {allowed[-1]} (got {value!r})")


# The quality gate's signal thresholds (cosybatch.qc.gate.Limits, a job spec's [qc] table): the range
# each must lie in. max_cer and max_wer are QualityConfig fields (--qc-max-cer, --qc-max-wer).
LIMIT_BOUNDS: dict[str, Bounds] = {
    "max_z": Bounds(0, 100, low_open=True),  # robust z of the speech rate; 100 never flags in practice
    "min_history": Bounds(1, 2000, integer=True),  # qc.gate.HISTORY clips are kept per voice
    "max_lead_s": Bounds(0, 600),
    "max_tail_s": Bounds(0, 600),
    "max_end_db": Bounds(-200, 0),  # dB below the clip's loud frames; -200 is the signal's floor
    "max_gap_s": Bounds(0, 600),
    "min_speech_share": Bounds(0, 1),
    "max_clipped": Bounds(0, 1),  # share of samples
    "max_flatness": Bounds(0, 1),  # spectral flatness lies in [0, 1]
    "max_token_run": Bounds(1, 100_000, integer=True),  # speech tokens
    "max_cer": Bounds(0, 10),
    "max_wer": Bounds(0, 10),
    "min_support": Bounds(-50, 50),  # natural-log gain per token; tokens are floored at 1e-12 (about -27.6)
    "min_word_support": Bounds(-50, 50),
    "max_beyond_s": Bounds(0, 600),
    "max_stretch_s": Bounds(0, 600),
    "max_pace_z": Bounds(0, 100, low_open=True),  # robust z of the pace; 100 never flags in practice
}

MiB = 1024 * 1024


# -- the sections -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputConfig:
    """What is read: the corpus (a file, a folder of parts, a glob or a URI) and its columns."""

    SECTION = "input"

    corpus: Union[Path, str]
    """Corpus: a file (Parquet, JSONL(.gz), CSV, TSV or plain text, one row a line), a folder of parts,
    a glob (quoted: 'data/train-*.parquet') or a URI (s3://BUCKET/PREFIX/, gs://..., file://...)."""
    format: Optional[str] = None
    """parquet, jsonl, csv, tsv or text (one row a line); unset: chosen by file suffix."""
    id_col: Optional[str] = None
    """Id column; unset: uses 'id' when present, else the row number."""
    text_col: str = "text"
    """Text column."""
    voice_col: Optional[str] = None
    """Per-row voice column; unset: uses 'voice' when present."""
    limit: Optional[int] = bounded(None, 1, 10**12, integer=True)
    """Read only the first N rows of the corpus (1 to 10^12)."""
    max_chars: int = bounded(20000, 1, 1_000_000, integer=True)
    """Rows with longer text fail with a reason (about 20 minutes of speech at the default; 1 to 1_000_000)."""

    def __post_init__(self) -> None:
        from .sources import is_uri

        # A URI stays a string: a Path would fold its "//" into one slash.
        object.__setattr__(self, "corpus", self.corpus if is_uri(self.corpus) else Path(self.corpus))
        _check_bounds(self)


@dataclass(frozen=True)
class EngineConfig:
    """What makes the audio: the engine, its voices and settings, where it runs, the seed."""

    SECTION = "engine"

    name: str = DEFAULT_ENGINE
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
    options: dict = field(default_factory=dict)
    """The engine's own settings, KEY -> value, checked against its options (--engine-opt KEY=VALUE)."""
    memory_fraction: float = bounded(0.9, 0, 1, low_open=True)
    """GPU: share of device memory for the job, in (0, 1]; engines pre-allocate or cap to it."""
    device: str = "auto"
    """auto (CUDA when onnxruntime has it, else CPU), cpu or cuda."""
    threads: int = bounded(1, 1, 1024, integer=True)
    """Intra-op threads per inference call (CPU; 1 to 1024)."""
    seed: int = bounded(0, 0, 2**32 - 1, integer=True)
    """Job seed; each item's noise is seeded from (seed, id), so reruns reproduce audio (0 to 2^32 - 1)."""

    def __post_init__(self) -> None:
        _check_bounds(self)
        _choice("--device", self.device, ("auto", "cpu", "cuda"))
        self._check_voices()
        self.settings()  # the engine exists and its options are valid

    def engine_class(self):
        from .engines import engine_class

        return engine_class(self.name)

    def settings(self):
        """The engine's options dataclass, filled from `options` (errors name the key)."""
        from .engines import parse_engine_options

        return parse_engine_options(self.engine_class(), self.options)

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


@dataclass(frozen=True)
class BatchingConfig:
    """How rows are grouped into batches and how many run at once."""

    SECTION = "batching"

    batch_size: Optional[int] = bounded(None, 1, 4096, integer=True)
    """Most units per batch; unset: 1 on CPU (fastest there, measured), 64 on GPU (1 to 4096)."""
    batch_budget: Optional[int] = bounded(None, 1, 10**9, integer=True)
    """Most padded cost per batch (batch size x longest unit, in phoneme ids); unset: batch size x 256
    (1 to 10^9)."""
    workers: Optional[int] = bounded(None, 1, 1024, integer=True)
    """Inference threads sharing the engine; unset: one per CPU core on CPU, 2 on GPU (1 to 1024)."""
    window: int = bounded(20000, 1, 10_000_000, integer=True)
    """Rows sorted together by length; bounds memory on corpora of any size (1 to 10^7)."""

    def __post_init__(self) -> None:
        _check_bounds(self)


EXPORT_FORMATS = ("hf", "nemo", "lhotse", "shar")  # cosybatch.store.exports.FORMATS
AUDIO_FORMATS = tuple(FORMATS)
AUDIO_BITRATES = {name: f.bitrates[0] for name, f in FORMATS.items() if f.lossy}  # the lossy formats' default kbit/s


@dataclass(frozen=True)
class OutputConfig:
    """Where and how the audio is written: the folder, the clips, shards, exports and resume."""

    SECTION = "output"

    folder: Path
    """Output folder: shards, manifest, stats; rerunning on it resumes. Or a store URI (s3://BUCKET/PREFIX,
    gs://BUCKET/PREFIX): the dataset is written there, and this becomes the local staging folder."""
    sentence_silence_s: float = bounded(0.0, 0, 60)
    """Seconds of silence inserted between the sentences of one row (0 to 60)."""
    normalize: bool = True
    """Scale each clip to a full-scale peak (unless --loudness sets its loudness instead)."""
    audio_format: str = "wav"
    """The clips' format in the shards: wav (16-bit PCM), flac (16-bit, lossless) or opus (lossy, at --bitrate)."""
    bitrate: Optional[float] = bounded(None, 6, 256)
    """kbit/s of Opus (6 to 256, default 32; a variable bitrate: each clip's own varies around it)."""
    sample_rate: Optional[int] = bounded(None, 8000, 192000, integer=True)
    """Resample every clip to this rate, Hz (8000 to 192000; unset: the engine's). Opus holds only 8, 12, 16, 24
    and 48 kHz: another rate is raised to the next of these."""
    loudness: Optional[float] = bounded(None, -70, -5)
    """Normalise each clip's integrated loudness to this many LUFS (ITU-R BS.1770-4, -70 to -5; -23 is EBU R128),
    instead of its peak to full scale."""
    true_peak: float = bounded(-1.0, -20, 0)
    """With --loudness: the true-peak ceiling, dBTP (-20 to 0); a clip that would pass it stays quieter."""
    trim_silence_ms: Optional[int] = bounded(None, 50, 60000, integer=True)
    """Cut each clip's leading and trailing silence to at most this many ms (50 to 60000; the quality gate
    reads a clip's last 30 ms to tell a cut clip, so less than that would pass for one)."""
    shard_max_items: int = bounded(1000, 1, 10_000_000, integer=True)
    """Close a shard after this many items (1 to 10^7)."""
    shard_max_bytes: int = bounded(256 * MiB, 1, 2**40, integer=True)
    """Close a shard once it reaches this many bytes (1 to 2^40, 1 TiB; --shard-max-mb gives it in MiB)."""
    exports: tuple = ()
    """Dataset formats to write at the end besides WebDataset: hf, nemo, lhotse, shar (Lhotse Shar)."""
    export_copy: bool = False
    """The NeMo and Lhotse exports copy the audio out as loose files (exports/wavs/KEY.wav, KEY.flac, ... by
    --audio-format) instead of pointing into the shards."""
    restart: bool = False
    """Delete the output folder's earlier cosybatch output and start over."""
    allow_corpus_change: bool = False
    """Resume although the corpus file changed: committed ids are kept, new ids synthesised, and
    committed rows that changed or went are listed in corpus_changes.jsonl."""
    store: Optional[str] = None
    """The object-storage URI the dataset is written to (from an --out URI); None for a folder."""
    staging: Optional[Path] = None
    """With --out in object storage: the local folder for the open shard and the journal (default: under the user's
    cache, one per URI)."""
    lease_s: float = bounded(60.0, 2, 3600)
    """With --out in object storage: seconds a run's lease on the prefix lasts unrenewed (2 to 3600); a rerun
    after a kill waits this long for the old run's lease to lapse."""
    shard_index: Optional[int] = None
    """This worker's shard (0-based) when the corpus is split over shard_count workers (0 to shard_count - 1)."""
    shard_count: Optional[int] = bounded(None, 1, 100_000, integer=True)
    """Number of workers the corpus is split over by a stable hash of each id (1 to 100_000)."""

    def __post_init__(self) -> None:
        from .sources import is_uri

        if is_uri(str(self.folder)):
            if not str(self.folder).lower().startswith(("s3://", "gs://", "gcs://", "file://")):
                raise UsageError(f"--out {self.folder}: an output URI is s3://BUCKET/PREFIX or gs://BUCKET/PREFIX "
                                 "(or file:///PATH)")
            from .store.objects import default_staging

            store = str(self.folder).rstrip("/")
            object.__setattr__(self, "store", store)
            object.__setattr__(self, "folder", Path(self.staging) if self.staging is not None
                               else default_staging(store))
        elif self.staging is not None and self.store is None:
            raise UsageError("--staging is for an --out in object storage (s3://..., gs://...); a local --out folder "
                             "is written in place")
        object.__setattr__(self, "folder", Path(self.folder))
        if self.staging is not None:
            object.__setattr__(self, "staging", Path(self.staging))
        object.__setattr__(self, "exports", tuple(self.exports))
        _check_bounds(self)
        if (self.shard_index is None) != (self.shard_count is None):
            raise UsageError("give both the shard index and the shard count (--shard I/N)")
        if self.shard_count is not None and not (
                isinstance(self.shard_index, int) and 0 <= self.shard_index < self.shard_count):
            raise UsageError(f"--shard {self.shard_index}/{self.shard_count}: "
                             f"the index must be in 0..{self.shard_count - 1}")
        if self.audio_format not in AUDIO_FORMATS:
            raise UsageError(f"--audio-format must be one of {', '.join(AUDIO_FORMATS)} (got {self.audio_format!r})")
        if self.bitrate is not None and self.audio_format not in AUDIO_BITRATES:
            raise UsageError(f"--bitrate is for the lossy format (opus); {self.audio_format} is lossless")
        unknown = set(self.exports) - set(EXPORT_FORMATS)
        if unknown:
            raise UsageError(f"--export: unknown format(s) {sorted(unknown)}; choose from {', '.join(EXPORT_FORMATS)}")

    def audio_settings(self) -> dict:
        """What of the clips' last stage differs from the default (16-bit WAV at the engine's rate,
        peak-normalised, untrimmed): recorded in the job's fingerprint and each KEY.json "settings"
        when set, so a resume with other bytes is refused and jobs without them keep their record."""
        found: dict[str, Any] = {}
        if self.audio_format != "wav":
            found["format"] = self.audio_format
            if self.audio_format in AUDIO_BITRATES:
                found["bitrate"] = self.bitrate or AUDIO_BITRATES[self.audio_format]
        if self.sample_rate is not None:
            found["sample_rate"] = self.sample_rate
        if self.loudness is not None:
            found["loudness"] = self.loudness
            found["true_peak"] = self.true_peak
        if self.trim_silence_ms is not None:
            found["trim_silence_ms"] = self.trim_silence_ms
        return found


@dataclass(frozen=True)
class QualityConfig:
    """The quality checks (cosybatch.qc.gate): what is measured, what fails a clip, what then."""

    SECTION = "quality"

    mode: str = "signals"
    """Quality checks: off; signals (measured and recorded per clip, nothing dropped); gate (a flagged clip is
    made again, then dropped or kept per --qc-on-fail); asr (gate, and Whisper scores each clip's text against
    its audio)."""
    asr_rows: str = "all"
    """With --qc asr, which clips Whisper hears: all, flagged (by the cheap signals), or sample (flagged ones
    and a seeded --qc-sample share of the rest)."""
    sample: float = bounded(0.1, 0, 1, low_open=True)
    """Share of unflagged clips transcribed with --qc-asr-rows sample, in (0, 1]."""
    asr_model: Optional[Path] = None
    """CTranslate2 Whisper folder for --qc asr; unset: Whisper tiny.en from the cosybatch[qc] extra."""
    max_cer: float = bounded(0.2, 0, 10)
    """A transcribed clip fails above this character error rate (0 to 10: insertions can pass 1)."""
    max_wer: Optional[float] = bounded(None, 0, 10)
    """A transcribed clip fails above this word error rate (unset: WER is recorded, not gated; 0 to 10)."""
    retries: int = bounded(2, 0, 10, integer=True)
    """Takes of a failing row after the first, each with a new seed (0 to 10)."""
    on_fail: str = "drop"
    """A row with no passing take: drop (fails, with the reason) or keep (its best take, marked qc.pass false)."""
    limits: dict = field(default_factory=dict)
    """The signal thresholds (`[qc]` table of a job spec): max_z, max_gap_s, min_speech_share, ... Ranges:
    max_z and max_pace_z (0, 100], min_support and min_word_support -50 to 50, max_beyond_s and max_stretch_s 0
    to 600, min_history 1 to 2000, max_lead_s, max_tail_s and max_gap_s 0 to 600, max_end_db -200 to 0,
    min_speech_share, max_clipped and max_flatness 0 to 1, max_token_run 1 to 100_000."""

    def __post_init__(self) -> None:
        _check_bounds(self)
        self.settings()  # mode, rows and every threshold are valid

    def settings(self):
        """The quality gate's settings (cosybatch.qc.gate.QCSettings), checked."""
        from .qc.gate import Limits, QCSettings

        unknown = set(self.limits) - set(Limits.names())
        if unknown:
            raise UsageError(f"[qc]: unknown threshold(s) {', '.join(sorted(unknown))}; known: "
                             f"{', '.join(Limits.names())}")
        try:
            limits = Limits(**{**self.limits, "max_cer": self.max_cer, "max_wer": self.max_wer})
        except TypeError as exc:
            raise UsageError(f"[qc]: {exc}") from None
        for name in Limits.names():
            value = getattr(limits, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise UsageError(f"[qc] {name} = {value!r} should be a number")
            if name in self.limits:
                LIMIT_BOUNDS[name].check(f"[qc] {name}", value)
        return QCSettings(self.mode, self.asr_rows, self.sample, self.retries, self.on_fail, limits)


@dataclass(frozen=True)
class OpsConfig:
    """How the run is operated: time and failure limits, metrics, progress reports."""

    SECTION = "ops"

    max_runtime_s: Optional[float] = bounded(None, 0, 366 * 86400, low_open=True)
    """Stop taking new batches after this many seconds, commit, exit 4 (resumable); at most 366 days."""
    max_failures: Optional[str] = None
    """Fail the run (exit 5) past this many failed rows ('100') or this share of rows ('2%')."""
    metrics_file: Optional[Path] = None
    """Prometheus textfile (for node_exporter), rewritten atomically during and after the run."""
    pushgateway: Optional[str] = None
    """Prometheus Pushgateway URL to push the final metrics to."""
    metrics_job: Optional[str] = None
    """Job name for metrics: the Pushgateway job and the cosybatch_job label; unset: the output
    folder's name plus a hash of its full path."""
    progress: str = "auto"
    """auto (bar on a terminal, log lines otherwise), bar, log or none."""
    log_every_s: float = bounded(30.0, 0, 86400, low_open=True)
    """Seconds between progress log lines when not on a terminal, in (0, 86400]."""

    def __post_init__(self) -> None:
        if self.metrics_file is not None:
            object.__setattr__(self, "metrics_file", Path(self.metrics_file))
        _check_bounds(self)
        _choice("--progress", self.progress, ("auto", "bar", "log", "none"))
        self.failure_limit()

    def failure_limit(self) -> tuple[Optional[int], Optional[float]]:
        """(count, rate) from max_failures; at most one is set."""
        if self.max_failures is None:
            return None, None
        text = self.max_failures.strip()
        try:
            if text.endswith("%"):
                rate = float(text[:-1]) / 100
                if not 0 <= rate <= 1:  # NaN too
                    raise ValueError
                return None, rate
            count = int(text)
            if count < 0:
                raise ValueError
            return count, None
        except ValueError:
            raise UsageError(f"--max-failures {self.max_failures!r}: give a count (100) or a percentage (2%)") from None


SECTIONS = {"input": InputConfig, "output": OutputConfig, "engine": EngineConfig, "batching": BatchingConfig,
            "quality": QualityConfig, "ops": OpsConfig}

# Each flat option (a `cosybatch run` flag, a job spec key, a RunConfig.from_options keyword) ->
# (section, field). The codemod that moved code to the sections reads this table too.
FLAT: dict[str, tuple[str, str]] = {
    "corpus": ("input", "corpus"), "out": ("output", "folder"), "format": ("input", "format"),
    "id_col": ("input", "id_col"), "text_col": ("input", "text_col"), "voice_col": ("input", "voice_col"),
    "engine": ("engine", "name"), "voice": ("engine", "voice"), "voice_pool": ("engine", "voice_pool"),
    "voice_pool_mode": ("engine", "voice_pool_mode"), "voice_map": ("engine", "voice_map"),
    "engine_options": ("engine", "options"), "memory_fraction": ("engine", "memory_fraction"),
    "device": ("engine", "device"), "batch_size": ("batching", "batch_size"),
    "batch_budget": ("batching", "batch_budget"), "workers": ("batching", "workers"),
    "threads": ("engine", "threads"), "window": ("batching", "window"), "seed": ("engine", "seed"),
    "sentence_silence": ("output", "sentence_silence_s"), "normalize": ("output", "normalize"),
    "audio_format": ("output", "audio_format"), "bitrate": ("output", "bitrate"),
    "sample_rate": ("output", "sample_rate"), "loudness": ("output", "loudness"),
    "true_peak": ("output", "true_peak"), "trim_silence": ("output", "trim_silence_ms"),
    "shard_max_items": ("output", "shard_max_items"), "shard_max_bytes": ("output", "shard_max_bytes"),
    "limit": ("input", "limit"), "max_chars": ("input", "max_chars"), "max_runtime": ("ops", "max_runtime_s"),
    "max_failures": ("ops", "max_failures"), "shard_index": ("output", "shard_index"),
    "shard_count": ("output", "shard_count"), "metrics_file": ("ops", "metrics_file"),
    "pushgateway": ("ops", "pushgateway"), "metrics_job": ("ops", "metrics_job"), "export": ("output", "exports"),
    "export_copy": ("output", "export_copy"), "restart": ("output", "restart"),
    "allow_corpus_change": ("output", "allow_corpus_change"), "staging": ("output", "staging"),
    "lease": ("output", "lease_s"), "qc": ("quality", "mode"),
    "qc_asr_rows": ("quality", "asr_rows"), "qc_sample": ("quality", "sample"),
    "qc_asr_model": ("quality", "asr_model"), "qc_max_cer": ("quality", "max_cer"),
    "qc_max_wer": ("quality", "max_wer"), "qc_retries": ("quality", "retries"),
    "qc_on_fail": ("quality", "on_fail"), "qc_limits": ("quality", "limits"), "progress": ("ops", "progress"),
    "log_every": ("ops", "log_every_s"),
}
_FLAT_OF = {place: name for name, place in FLAT.items()}
# Flat options without a flag of their own: errors name them as the library and job specs do.
_NO_FLAG = {"shard_max_bytes": "shard_max_bytes", "shard_index": "--shard", "shard_count": "--shard",
            "qc_limits": "[qc]", "engine_options": "--engine-opt"}


def option_label(section: str, name: str) -> str:
    """How an error names a section's field: its flag (`--qc-max-cer`), which is also its job spec key."""
    flat = _FLAT_OF.get((section, name), name)
    return _NO_FLAG.get(flat) or "--" + flat.replace("_", "-")


@dataclass(frozen=True)
class RunConfig:
    """Every setting of one run, by stage. Build it with `from_options` (flat option names) or
    `cosybatch.jobspec.config_from_spec` (a job spec); every section is checked when made."""

    input: InputConfig
    """The corpus and its columns."""
    output: OutputConfig
    """The output folder, its shards, exports and resume policy."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine, voices, device and seed."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    """Batch sizes and parallelism."""
    quality: QualityConfig = field(default_factory=QualityConfig)
    """The quality checks and their thresholds."""
    ops: OpsConfig = field(default_factory=OpsConfig)
    """Time and failure limits, metrics, progress."""

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"RunConfig.{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}; "
                                "RunConfig.from_options takes flat option names")

    def __getattr__(self, name: str):
        # Only reached for a missing attribute: say where a flat option went.
        if name in FLAT:
            section, field_name = FLAT[name]
            raise AttributeError(f"RunConfig has no attribute {name!r}: it is cfg.{section}.{field_name} "
                                 "(RunConfig.option(name) reads any option by its flat name)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- the flat option names ------------------------------------------------------------------

    @classmethod
    def from_options(cls, **options: Any) -> RunConfig:
        """A config from flat option names, as `cosybatch run` spells them (`batch_size`,
        `qc_max_cer`, ...; unset ones take their defaults). Besides the flat fields, the spellings
        of the command line and job specs are accepted: `shard` ("I/N" or "N"), `shard_max_mb`,
        `engine_opt` (["KEY=VALUE", ...]), each engine's alias options (`model=...`), `export` as
        "hf,nemo" or a list, `max_runtime` as seconds or "2h"."""
        values = normalise_options(options)
        sections: dict[str, dict] = {name: {} for name in SECTIONS}
        for name, value in values.items():
            section, field_name = FLAT[name]
            sections[section][field_name] = value
        return cls(**{name: SECTIONS[name](**given) for name, given in sections.items()})

    def options(self) -> dict[str, Any]:
        """Flat option name -> value, as `from_options` takes them (`from_options(**cfg.options())`
        is `cfg`)."""
        found = {name: getattr(getattr(self, section), field_name) for name, (section, field_name) in FLAT.items()}
        if self.output.store is not None:  # the folder is the store's staging
            found["out"] = self.output.store
        return found

    def to_dict(self) -> dict[str, Any]:
        """The flat options as plain data (nested value objects as dicts), for JSON."""
        return {name: _plain(value) for name, value in self.options().items()}

    def option(self, name: str) -> Any:
        """One option by its flat name (`cfg.option("batch_size")`)."""
        if name not in FLAT:
            raise KeyError(f"no option {name!r}; options are: {', '.join(FLAT)}")
        section, field_name = FLAT[name]
        return getattr(getattr(self, section), field_name)

    def with_options(self, **changes: Any) -> RunConfig:
        """A copy with some flat options changed (checked again)."""
        unknown = set(changes) - set(FLAT)
        if unknown:
            raise UsageError(f"unknown option(s) {', '.join(sorted(unknown))}; options are: {', '.join(FLAT)}")
        by_section: dict[str, dict] = {}
        for name, value in changes.items():
            section, field_name = FLAT[name]
            by_section.setdefault(section, {})[field_name] = value
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **given)
                                            for section, given in by_section.items()})

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """Flat option name -> the docstring of its field, for the CLI help."""
        docs = {name: field_docs(section) for name, section in SECTIONS.items()}
        return {flat: docs[section][field_name] for flat, (section, field_name) in FLAT.items()}

    # -- what the stages ask of it ----------------------------------------------------------------

    def voice_router(self):
        """The job's pools (cosybatch.voices.VoiceRouter)."""
        from .voices import VoiceRouter

        e = self.engine
        return VoiceRouter(e.voice_pool, e.voice_map, e.voice_pool_mode, e.seed)

    def failure_limit(self) -> tuple[Optional[int], Optional[float]]:
        """(count, rate) from max_failures; at most one is set."""
        return self.ops.failure_limit()

    def qc_settings(self):
        """The quality gate's settings (cosybatch.qc.gate.QCSettings), checked."""
        return self.quality.settings()

    def engine_class(self):
        return self.engine.engine_class()

    def engine_settings(self):
        """The engine's options dataclass, filled from the engine options (errors name the key)."""
        return self.engine.settings()

    def engine_options_for(self, device: Optional[str] = None, allow_paths: bool = True):
        """What the job hands the engine (EngineOptions), on `device` (default: --device)."""
        from .engines import EngineOptions

        e = self.engine
        from .sources import corpus_folder

        # Relative paths in rows are read relative to the corpus file's folder (see corpus_folder).
        return EngineOptions(device or e.device, e.threads, e.seed, e.memory_fraction,
                             corpus_folder(self.input.corpus), allow_paths, self.engine_settings())


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# -- the flat options: the command line's and job specs' spellings --------------------------------


class RunOption(NamedTuple):
    """One `cosybatch run` option as the command line and job specs see it."""

    hint: Any  # the type a flag parses to and a spec value is checked against
    default: Any
    help: str
    section: str  # its panel in `run --help`


SECTION_TITLES = {"input": "Input", "engine": "Engine", "batching": "Batching", "output": "Output",
                  "quality": "Quality", "ops": "Operations"}
# Flat fields the command line and job specs spell differently (see the extra options below).
SPELLED_OTHERWISE = ("corpus", "shard_index", "shard_count", "max_runtime", "shard_max_bytes", "export",
                     "engine_options", "qc_limits", "voice_pool", "voice_map")
# Options a job spec may give as a list or a table, handed to the sections as they are (they parse them).
SPEC_STRUCTURES = ("voice_pool", "voice_map")


def run_options() -> dict[str, RunOption]:
    """Every option of `cosybatch run` and key of a job spec, in `run --help` order: the sections'
    fields, then the spellings that build the rest, then the installed engines' aliases."""
    import typing

    docs = RunConfig.field_docs()
    found: dict[str, RunOption] = {
        "corpus": RunOption(Optional[str], None, docs["corpus"], "input")}
    for flat, (section, field_name) in FLAT.items():
        if flat in SPELLED_OTHERWISE:
            continue
        f = next(f for f in fields(SECTIONS[section]) if f.name == field_name)
        hint = typing.get_type_hints(SECTIONS[section])[field_name]
        default = f.default if f.default is not dataclasses.MISSING else None
        if flat == "out":
            hint = Optional[str]  # a folder or a store URI; from the corpus name when unset
        found[flat] = RunOption(hint, default, docs[flat], section)
    found.update({
        "engine_opt": RunOption(Optional[list[str]], None, "An engine setting KEY=VALUE (repeatable); "
                                "`[engine_options]` in a job spec. `cosybatch engines` lists each engine's.", "engine"),
        "shard": RunOption(Optional[str], None, "Run worker I of N (I/N), writing OUT/part-IIIII-of-NNNNN. N alone "
                           "takes I from JOB_COMPLETION_INDEX or SLURM_ARRAY_TASK_ID.", "ops"),
        "max_runtime": RunOption(Optional[str], None, docs["max_runtime"] + " Accepts 90, 90s, 30m, 2h.", "ops"),
        "shard_max_mb": RunOption(float, 256.0, "Close a shard once it reaches this many MiB.", "output"),
        "export": RunOption(Optional[str], None, "Comma-separated dataset formats to write at the end: hf, nemo, "
                            "lhotse, shar (Lhotse Shar).", "output"),
        "voice_pool": RunOption(Optional[str], None, docs["voice_pool"] + " A job spec may give a list (of strings "
                                "or tables {voice, speaker, prompt_wav, prompt_text, weight}).", "engine"),
        "voice_map": RunOption(Optional[str], None, docs["voice_map"] + " Example: en=VOICE,de=VOICE|VOICE; a job "
                               "spec's [voice_map] table.", "engine"),
    })
    for name, (kind, help) in engine_alias_options().items():
        found[name] = RunOption(Optional[kind], None, help, "engine")
    return found


def engine_alias_options() -> dict[str, tuple[type, str]]:
    """The installed engines' options that each set the engine option of the same name (after
    --engine-opt, which they override; an engine without that option refuses it, naming the key):
    option -> (type, help). Declared by each engine (`Engine.aliases`); imports engine classes,
    never their runtimes."""
    from .engines import engine_aliases

    found = {}
    for option, declared in engine_aliases().items():
        helps: dict[str, list[str]] = {}  # one help -> the engines that give it
        for engine, alias in declared:
            helps.setdefault(alias.help, []).append(engine)
        said = "; ".join(text.rstrip(".") if len(helps) == 1 else f"{', '.join(names)}: {text.rstrip('.')}"
                         for text, names in helps.items())
        found[option] = (declared[0][1].kind, f"Alias of --engine-opt {option}=...: {said}.")
    return found


def normalise_options(options: dict[str, Any]) -> dict[str, Any]:
    """Flat options in any accepted spelling -> flat field values (see RunConfig.from_options)."""
    import difflib

    v = dict(options)
    alias_names = _alias_names() if set(v) - set(FLAT) else set()
    aliases = {name: v.pop(name) for name in list(v) if name not in FLAT and name in alias_names}
    unknown = set(v) - set(FLAT) - {"shard", "shard_max_mb", "engine_opt"}
    if unknown:
        name = sorted(unknown)[0]
        close = difflib.get_close_matches(name, [*FLAT, "shard", "shard_max_mb", "engine_opt"], n=1)
        raise UsageError(f"unknown option {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    if v.get("corpus") is None:
        raise UsageError("no corpus: give CORPUS or `corpus` in the --job spec")
    engine_options = dict(v.pop("engine_options", None) or {})
    for item in v.pop("engine_opt", None) or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--engine-opt {item!r}: give KEY=VALUE")
        engine_options[key.strip()] = value
    engine_options.update({name: value for name, value in aliases.items() if value is not None})
    if engine_options:
        v["engine_options"] = engine_options
    if "shard" in v:
        shard = v.pop("shard")
        if shard is not None:
            from .store.distributed import parse_shard

            v["shard_index"], v["shard_count"] = parse_shard(shard)
    if isinstance(v.get("max_runtime"), str):
        v["max_runtime"] = _seconds(v["max_runtime"], "--max-runtime")
    if "export" in v:
        export = v["export"] or ()
        if isinstance(export, str):
            export = export.split(",")
        v["export"] = tuple(x.strip() for x in export if x.strip())
    if "shard_max_mb" in v:
        shard_max_mb = v.pop("shard_max_mb")
        if isinstance(shard_max_mb, bool) or not isinstance(shard_max_mb, (int, float)) or \
                not 0 < shard_max_mb <= 2**20:
            raise UsageError(f"--shard-max-mb must be a finite number > 0 and at most 1048576 (1 TiB) "
                             f"(got {shard_max_mb})")
        v["shard_max_bytes"] = max(1, int(shard_max_mb * MiB))
    for name in SPEC_STRUCTURES:
        if name in v and v[name] is None:
            del v[name]
    if v.get("out") is None:
        v["out"] = Path("out") / _stem(v["corpus"])
    return v


def _alias_names() -> set[str]:
    from .engines import engine_aliases

    return set(engine_aliases())


def _seconds(text: str, option: str) -> float:
    """'90', '90s', '30m', '2h', '7h50m' -> seconds."""
    import re

    value = text.strip().lower()
    try:
        return float(value)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise UsageError(f"{option} {text!r}: give seconds (90), or 90s, 30m, 2h, 7h50m")
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(float(n) * units[u] for n, u in parts)


def _stem(corpus: Union[Path, str]) -> str:
    """The default --out folder's name: the corpus's last path component (a folder's, a prefix's,
    a glob's without its wildcards) without its corpus suffixes."""
    from .sources import default_name, is_uri

    text = str(corpus)
    wild = is_uri(text) or any(ch in text for ch in "*?[")
    name = default_name(text) if wild else Path(text).name
    for suffix in (".gz", ".jsonl", ".ndjson", ".parquet", ".pq", ".csv", ".tsv", ".tab", ".txt"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if wild:
        name = name.strip("-_. ")
    return name or "corpus"


@functools.cache
def _class_bodies(module: str) -> dict:
    """Class name -> its statements, for every class of ``module``, from one parse of its source
    (inspect.getsource of a class parses the whole module again each time: 0.1 s a CLI start)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(sys.modules[module]))
    return {node.name: node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field name -> the docstring written under the field."""
    import ast
    import itertools

    docs = {}
    body = _class_bodies(cls.__module__)[cls.__name__]
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs
