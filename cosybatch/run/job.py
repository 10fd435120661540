"""One job's life, for `cosybatch run` and `cosybatch ray-run` alike: open the output folder,
fingerprint the job, resume what is committed, enforce the limits (--max-failures,
--max-runtime), turn signals into a clean stop, and finish (manifest, checks, stats, metrics,
exports, exit code). The two runners only dispatch rows to engines and commit what comes back:
`local.LocalRunner` (threads on this machine) and `ray.RayRunner` (a Ray actor pool).

The data path, in `Job._run`, one line:

    corpus -> plan (runner) -> engine (runner) -> writer (runner) -> checkpoint -> stats
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Union

from .. import __version__
from ..config import RunConfig
from ..corpus import BadRow, Columns, Corpus, Row
from ..engines import engine_check
from ..errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TOO_MANY_FAILURES,
    CorpusError,
    OutputError,
    UsageError,
)
from ..qc.gate import QCCounts
from ..stats import Progress, Stats, failure_summary
from ..store.checkpoint import (
    DUPLICATE_ID,
    FAILURES_FILE,
    RUN_FILE,
    STATS_FILE,
    OutputDir,
    ResumeState,
    file_fingerprint,
    json_bytes,
    write_atomic,
)
from ..store.distributed import part_name
from .executor import source_hash

log = logging.getLogger("cosybatch")

METRICS_EVERY_S = 10.0  # how often the Prometheus textfile is refreshed during a run


@dataclass
class RunResult:
    status: str  # "complete", "interrupted", "too_many_failures", "damaged" or "corpus_error"
    exit_code: int
    stats: dict = field(default_factory=dict)
    error: Optional[str] = None  # why the run failed (too_many_failures): "2 of 45 rows failed (4.4%), more than 2%"

    def summary_line(self) -> str:
        """The JSON line a run prints last on stdout (Airflow's XCom reads it). Its keys:

        - ``status``: complete, interrupted, too_many_failures, damaged or corpus_error;
        - ``out``: the output folder;
        - ``items_done``, ``items_failed``, ``audio_seconds``: what THIS run did (on a resume,
          only the rows it added), the same numbers as stats.json's keys of those names;
        - ``audio_seconds_per_wall_second``: this run's rate;
        - ``job_totals``: ``items_done``, ``items_failed`` and ``audio_seconds`` of the whole
          job, every run so far included (stats.json's ``job_totals``);
        - ``error``: only when status is too_many_failures, the sentence that says why.
        """
        s = self.stats
        totals = s.get("job_totals", {})
        return json.dumps({
            "status": self.status,
            "out": s.get("out"),
            "items_done": s.get("items_done"),
            "items_failed": s.get("items_failed"),
            "audio_seconds": s.get("audio_seconds"),
            "audio_seconds_per_wall_second": s.get("audio_seconds_per_wall_second"),
            "job_totals": {key: totals.get(key) for key in ("items_done", "items_failed", "audio_seconds")},
            **({"error": self.error} if self.error else {}),
        })


class RowGate:
    """Which rows a run still has to synthesise, for `run` and `ray-run` alike. It skips what a
    resume says is done, and turns bad rows, duplicate ids (the first row wins) and over-long
    texts into failure records. One instance per run, fed rows in file order."""

    def __init__(self, done_ids: set, failed_rows: set, max_chars: int, committed: Optional[dict] = None):
        self.done_ids = done_ids
        self.failed_rows = failed_rows
        self.max_chars = max_chars
        self.seen = set(done_ids)
        # After a corpus change: committed id -> source_hash of the row it was made from.
        self.committed = committed
        self.changed: list[dict] = []
        self.still_there: set = set()

    def admit(self, row: Union[Row, BadRow]) -> Union[Row, dict, None]:
        """The row to synthesise, a failure record for it, or None when it is already done."""
        if row.index in self.failed_rows or (row.id is not None and row.id in self.done_ids):
            if self.committed is not None and row.id in self.committed and row.id not in self.still_there:
                self.still_there.add(row.id)
                old = self.committed[row.id]
                if old is not None and (isinstance(row, BadRow) or old != source_hash(row)):
                    self.changed.append({"id": row.id, "row": row.index, "change": "changed",
                                         "detail": "the row's text, voice or prompt differs from the committed "
                                                   "audio's; the committed audio was kept"})
            return None
        if isinstance(row, BadRow):
            if row.id is not None:
                self.seen.add(row.id)
            return {"id": row.id, "row": row.index, "reason": row.reason}
        if row.id in self.seen:
            return {"id": row.id, "row": row.index, "reason": DUPLICATE_ID}
        self.seen.add(row.id)
        if len(row.text) > self.max_chars:
            return {"id": row.id, "row": row.index, "reason":
                    f"text is {len(row.text)} characters, over --max-chars {self.max_chars}; "
                    "split the row or raise the limit"}
        return row




class Runner(ABC):
    """How a job's rows reach the engines and how what comes back is committed. The job calls
    these in order: `check`, `start`, `resume`, `dispatch`, `end`, and `close` in every case."""

    name: Optional[str] = None  # recorded in the job's fingerprint ("ray"); None for `run`
    stopping = "finishing the batches in flight, then stopping"  # logged on SIGINT/SIGTERM
    batch_seconds = None  # a metrics.BatchHistogram of batch compute times, where the runner keeps one

    @abstractmethod
    def check(self, cfg: RunConfig) -> RunConfig:
        """Refuse what this runner cannot do before anything is written; the config to run."""

    @abstractmethod
    def start(self, job: Job) -> dict:
        """Load the engines. Returns the engine's `fingerprint()` under "fingerprint"."""

    @abstractmethod
    def resume(self, job: Job, corpus_was: Optional[dict]) -> tuple[ResumeState, Optional[dict]]:
        """What the folder holds (after checking and repairing it): the resume state, and, after an
        accepted corpus change, committed id -> source hash of the row it was made from."""

    @abstractmethod
    def dispatch(self, job: Job, corpus: Corpus, gate: RowGate) -> None:
        """Plan, synthesise and commit every row the gate admits, until done or `job.stop`."""

    @abstractmethod
    def interrupted(self, job: Job) -> bool:
        """Whether a stop left work undone (a stop after the last commit interrupted nothing)."""

    @abstractmethod
    def end(self, job: Job, interrupted: bool) -> tuple[list[str], dict]:
        """Close the writer and write the manifest and failures file: (problems found, stats extras)."""

    @abstractmethod
    def describe(self) -> dict:
        """The engine and batching fields of stats.json."""

    def stopped_for_failures(self) -> bool:
        """Whether the writer already stopped the run for --max-failures."""
        return False

    def close(self) -> None:  # noqa: B027  (optional: only a runner that took something overrides it)
        """Release what `start` took (a Ray cluster)."""


def run_job(cfg: RunConfig, runner: Runner) -> RunResult:
    """Open the output folder, run the job with `runner`, and leave the folder unlocked (and, if
    the job never started, as it was)."""
    cfg = runner.check(cfg)  # what `run --check` checks, before anything is written
    out = OutputDir(cfg.out)
    created = _missing_folders(cfg.out)  # removed again if the job never starts (no job.json)
    state_existed = out.state.exists()
    try:
        cfg.out.mkdir(parents=True, exist_ok=True)
        out.lock()
    except OSError as exc:
        out.unlock()
        _remove_unstarted(out, created, state_existed)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk is resumable, whenever it strikes
            raise _output_error(cfg, exc) from None
        raise UsageError(f"cannot use {cfg.out} as the output folder ({exc.strerror or exc}); "
                         "choose a writable --out") from None
    try:
        return Job(cfg, out, runner).run()
    except OSError as exc:
        if _about_output(cfg, exc):
            raise _output_error(cfg, exc) from exc
        raise
    finally:
        runner.close()
        _remove_unstarted(out, created, state_existed)
        out.unlock()


def part_config(cfg: RunConfig) -> RunConfig:
    """A sharded worker's config: each worker owns a self-contained folder OUT/part-I-of-N, which
    `cosybatch merge` presents as one, and its own metrics file."""
    if cfg.shard_count is None:
        return cfg
    part = part_name(cfg.shard_index, cfg.shard_count)
    metrics = cfg.metrics_file
    if metrics is not None:  # workers sharing a volume must not overwrite each other's file
        metrics = metrics.with_name(f"{metrics.stem}.{part}{metrics.suffix}")
    return replace(cfg, out=cfg.out / part, metrics_file=metrics)


class Job:
    """One run of a job: set-up and resume, the runner's dispatch, signals and --max-runtime,
    the failure limit, and the end (manifest, checks, stats, metrics, exports)."""

    def __init__(self, cfg: RunConfig, out: OutputDir, runner: Runner):
        self.cfg = cfg
        self.out = out
        self.runner = runner
        self.stats = Stats()
        self.stop = threading.Event()
        self.interrupted_by: Optional[str] = None
        self.repairs: list[str] = []
        self.quarantined: list[dict] = []  # {"file", "shard", "reason"}: what a repair set aside as not this job's
        self.last_success: Optional[float] = None  # when a run of this job last completed (stats.json)
        self.progress: Optional[Progress] = None
        self.corpus: Optional[Corpus] = None
        self._metrics_failed = False
        self._metrics_written = 0.0
        self.qc_settings = cfg.qc_settings()
        self.qc_counts = QCCounts()  # the quality gate's counts, filled by the runner

    def run(self) -> RunResult:
        """Signals and --max-runtime turn into a clean stop from the very start, model load included."""
        restore = self._install_signal_handlers()
        timer = None
        if self.cfg.max_runtime is not None:
            timer = threading.Timer(self.cfg.max_runtime, self.request_stop, args=("--max-runtime",))
            timer.daemon = True
            timer.start()
        try:
            return self._run()
        finally:
            if timer is not None:
                timer.cancel()
            restore()

    def request_stop(self, why: str) -> None:
        if not self.stop.is_set():
            self.interrupted_by = why
            self.stop.set()

    # -- the straight line -------------------------------------------------------------------
    def _run(self) -> RunResult:
        cfg = self.cfg
        corpus = self.corpus = open_corpus(cfg)                    # corpus: rows in file order
        t0 = time.monotonic()
        engine = self.runner.start(self)                           # engine: loaded where it runs
        self.stats.stage_s["load"] = time.monotonic() - t0
        self._claim_signals()
        state, committed = self._open(corpus, engine["fingerprint"])  # checkpoint: what is done
        gate = RowGate(state.done_ids, state.failed_rows, cfg.max_chars, committed)
        self.progress = Progress(self._total_rows(corpus), state.items + state.failures, cfg.progress,
                                 cfg.log_every)
        try:
            self.runner.dispatch(self, corpus, gate)               # plan -> engine -> writer
        finally:
            self.progress.close()
        return self._finish()                                      # manifest -> stats

    def _open(self, corpus: Corpus, engine_fingerprint: dict) -> tuple[ResumeState, Optional[dict]]:
        """Record the job, or check that the folder holds this job, and read what is committed."""
        cfg = self.cfg
        fingerprint = job_fingerprint(cfg, corpus, engine_fingerprint, runner=self.runner.name,
                                      asr_model=getattr(self.runner, "asr_model", None))
        adopt_legacy_fingerprint(self.out, cfg, corpus, fingerprint)
        was = self.out.check_or_start(fingerprint, cfg.restart, cfg.allow_corpus_change)
        state, committed = self.runner.resume(self, was)
        self.last_success = _previous_success(cfg.out)
        self.stats.previous_items_done = state.items
        self.stats.previous_items_failed = state.failures
        self.stats.previous_audio_s = state.audio_s
        if was is not None:
            log.info("resuming %s: %d items done, %d failed before", cfg.out, state.items, state.failures)
        write_atomic(self.out.state / RUN_FILE, json_bytes({
            "pid": os.getpid(), "started": time.time(), "corpus": str(cfg.corpus.resolve()),
            "total_rows": self._total_rows(corpus), "total_is_estimate": cfg.shard_count is not None,
            "shard": None if cfg.shard_count is None else [cfg.shard_index, cfg.shard_count]}))
        return state, committed

    def _total_rows(self, corpus: Corpus) -> Optional[int]:
        cfg = self.cfg
        total = corpus.num_rows
        if total is not None and cfg.limit:
            total = min(total, cfg.limit)
        if total is not None and cfg.shard_count is not None:
            total = -(-total // cfg.shard_count)  # an estimate: ids spread evenly over workers
        return total

    # -- limits --------------------------------------------------------------------------------
    def failure_limit_passed(self) -> Optional[str]:
        """None, or why the job's failures (every run so far) pass --max-failures: "2 of 45 rows
        failed (4.4%), more than 2%"."""
        failed = self.stats.previous_items_failed + self.stats.items_failed
        done = self.stats.previous_items_done + self.stats.items_done
        max_failed, max_failed_rate = self.cfg.failure_limit()
        over = (max_failed_rate is not None and failed > max_failed_rate * max(done + failed, 1)) or (
            max_failed is not None and failed > max_failed)
        if not over and not self.runner.stopped_for_failures():
            return None
        return failure_summary(failed, done + failed, self.cfg.max_failures)

    # -- interruption ------------------------------------------------------------------------
    def _on_signal(self, signum, _frame) -> None:
        if not self.stop.is_set():
            log.warning("%s: %s", signal.Signals(signum).name, self.runner.stopping)
        self.request_stop(signal.Signals(signum).name)

    def _claim_signals(self) -> None:
        """Take SIGINT and SIGTERM back from whatever the runner's start installed (ray.init does)."""
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(s) != self._on_signal:
                    signal.signal(s, self._on_signal)

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore():
            for s, h in previous.items():
                signal.signal(s, h)
        return restore

    # -- the end -----------------------------------------------------------------------------
    def metrics_while_running(self) -> None:
        if self.cfg.metrics_file is not None and time.monotonic() - self._metrics_written >= METRICS_EVERY_S:
            self._write_metrics(self._snapshot("running"))

    def _snapshot(self, status: str, **extra) -> dict:
        cfg = self.cfg
        if self.qc_settings.mode != "off":
            self.stats.qc = self.qc_counts.summary(self.qc_settings)
        return self.stats.to_dict(
            status=status, out=str(cfg.out), **self.runner.describe(), cosybatch=__version__,
            cold_start_seconds=round(self.stats.stage_s["load"], 3),
            shard=None if cfg.shard_count is None else [cfg.shard_index, cfg.shard_count],
            last_success_timestamp_seconds=self.last_success,
            **extra,
        )

    def _write_report(self, stats: dict) -> None:
        """OUT/report.html, the audit page of the finished job (never fails the job: the audio is safe)."""
        from ..store.audit import write_job_report

        try:
            totals = stats["job_totals"]
            summary = {"items": totals["items_done"], "failed": totals["items_failed"],
                       "audio_hours": round(totals["audio_seconds"] / 3600, 4), "engine": stats.get("engine"),
                       "voice": stats.get("voice"), "qc": stats.get("qc")}
            write_job_report(self.cfg.out, summary=summary, seed=self.cfg.seed)
        except Exception as exc:
            log.warning("could not write %s: %s", self.cfg.out / "report.html", exc)

    def _metrics_job(self) -> str:
        from ..metrics import default_job_name

        root = self.cfg.out.parent if self.cfg.shard_count is not None else self.cfg.out  # the job, not the part
        return self.cfg.metrics_job or default_job_name(root)

    def _metrics_grouping(self) -> dict[str, str]:
        """The shard, when sharded: one Pushgateway group (and one series) per worker."""
        if self.cfg.shard_count is None:
            return {}
        return {"shard": f"{self.cfg.shard_index}/{self.cfg.shard_count}"}

    def _metrics_registry(self, snapshot: dict):
        from ..metrics import BatchHistogram, registry

        # Not `job`: that is the target label a scrape sets (it would rename ours exported_job).
        labels = {"cosybatch_job": self._metrics_job(), **self._metrics_grouping()}
        return registry(snapshot, self.runner.batch_seconds or BatchHistogram(), labels)

    def _write_metrics(self, snapshot: dict) -> None:
        from ..metrics import write_textfile

        self._metrics_written = time.monotonic()
        try:
            write_textfile(self.cfg.metrics_file, self._metrics_registry(snapshot))
        except Exception as exc:  # monitoring must never stop the audio
            if not self._metrics_failed:
                log.error("cannot write --metrics-file %s: %s", self.cfg.metrics_file, exc)
            self._metrics_failed = True

    def _finish(self) -> RunResult:
        cfg = self.cfg
        interrupted = self.runner.interrupted(self)
        too_many_failures = self.failure_limit_passed()  # also on a rerun that adds no new failure
        problems, extra = self.runner.end(self, interrupted)  # never "complete" over a damaged folder
        corpus_error = getattr(self.runner, "corpus_error", None)
        status = ("too_many_failures" if too_many_failures else "interrupted" if interrupted
                  else "damaged" if problems else "corpus_error" if corpus_error else "complete")
        if status == "complete" and cfg.export:
            from ..store.exports import export

            for fmt in cfg.export:
                export(cfg.out, fmt, require_complete=False, copy=cfg.export_copy)
        if status == "complete":
            self.last_success = round(time.time(), 3)
        if self.quarantined:
            extra["quarantined"] = self.quarantined
        stats = self._snapshot(status, repairs=self.repairs, problems=problems, **extra)
        write_atomic(cfg.out / STATS_FILE, json_bytes(stats))
        if status == "complete" and self.qc_settings.mode != "off":
            self._write_report(stats)
        if status == "complete":
            from ..store.card import write_card

            write_card(cfg.out)  # OUT/README.md, the dataset card (never fails the job)
        if cfg.metrics_file is not None:
            self._write_metrics(stats)
        if cfg.pushgateway:
            from ..metrics import push

            try:
                push(cfg.pushgateway, self._metrics_registry(stats), job=self._metrics_job(),
                     grouping=self._metrics_grouping())
            except Exception as exc:  # the audio is safe; no monitoring problem may fail the job
                log.warning("could not push metrics to %s: %s", cfg.pushgateway, exc)
        if too_many_failures:
            log.error("%s; see %s", too_many_failures, cfg.out / FAILURES_FILE)
            return RunResult(status, EXIT_TOO_MANY_FAILURES, stats, error=too_many_failures)
        if interrupted:
            log.warning("interrupted by %s: committed work is kept; rerun the same command to resume",
                        self.interrupted_by or "a stop request")
            return RunResult(status, EXIT_INTERRUPTED, stats)
        if problems:
            for problem in problems:
                log.error("%s: %s", cfg.out, problem)
            log.error("the output folder changed under the run; rerun the same command to repair it")
            return RunResult(status, EXIT_INTERRUPTED, stats)
        if corpus_error is not None:
            raise CorpusError(f"{corpus_error} Every readable row was processed and committed; fix the "
                              "file, then rerun with --allow-corpus-change to synthesise the rest.")
        return RunResult(status, EXIT_OK, stats)


def _missing_folders(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first."""
    missing = []
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            break
        missing.append(folder)
    return missing


def _remove_unstarted(out: OutputDir, created: list[Path], state_existed: bool) -> None:
    """After a start that failed before the job was recorded (no job.json: a bad corpus, a model
    that does not load), remove what this call created, so that no half-made folder is left for
    `cosybatch status` to call "not started". Only the lock file, and then folders this call
    created, and only while empty: a folder that existed before, or holds anything else, stays.
    Called while the lock is held, so no other run can be starting in the folder."""
    if out.job_file.exists():
        return
    if not state_existed:
        from ..store.checkpoint import LOCK_FILE

        try:
            (out.state / LOCK_FILE).unlink(missing_ok=True)
            out.state.rmdir()
        except OSError:
            return
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            return


def check_device(cfg: RunConfig) -> None:
    """--device cuda on a machine where the engine cannot use CUDA is a usage error, for `run` and
    `run --check` alike, found before any folder is written or model loaded (the engine's own check
    would come later, at load). Engines say what runs them on a GPU (`Engine.gpu_runtime`)."""
    if cfg.device != "cuda":
        return
    from ..gpu import cuda_problem

    cls = cfg.engine_class()
    runtime = cls.gpu_runtime or ("torch" if cls.needs_torch_allocator else None)
    problem = cuda_problem(runtime)
    if problem is not None:
        raise UsageError(f"--device cuda: no usable CUDA GPU for the {cls.name} engine here: {problem}. "
                         "`cosybatch doctor` shows the set-up; or use --device cpu")


def configure_gpu_allocator(cfg: RunConfig) -> None:
    """For engines that run torch on a GPU: its allocator is chosen before torch can start CUDA."""
    if cfg.engine_class().needs_torch_allocator and cfg.device != "cpu":
        from ..gpu import configure_allocator

        note = configure_allocator()
        if note:
            log.warning(note)


def _about_output(cfg: RunConfig, exc: OSError) -> bool:
    """Is this I/O error about writing the output (and so resumable once fixed)?"""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return True
    name = exc.filename
    return name is not None and Path(name).resolve().is_relative_to(cfg.out.resolve())


def open_corpus(cfg: RunConfig) -> Corpus:
    return Corpus(cfg.corpus, Columns(
        id=cfg.id_col or "id", text=cfg.text_col, voice=cfg.voice_col or "voice",
        id_required=cfg.id_col is not None, voice_required=cfg.voice_col is not None,
        # An engine may read another column as the voice when there is no voice column.
        voice_fallback=cfg.engine_class().voice_column_fallback), cfg.format)


def check(cfg: RunConfig) -> dict:
    """Everything a run checks before its first batch, without loading a model: options, corpus
    format and columns, engine and voice. Returns the resolved settings."""
    from dataclasses import asdict

    corpus = open_corpus(cfg)
    configure_gpu_allocator(cfg)  # as a run does, before the device check may import torch
    check_device(cfg)
    resolved = engine_check(cfg.engine_class(), cfg.voice, cfg.engine_options_for())
    check_pool_voices(cfg)
    model = check_qc(cfg)
    return {"config": asdict(cfg), "corpus": {"format": corpus.format, "rows": corpus.num_rows},
            "voice": resolved.get("voice", resolved), **({"qc_asr_model": str(model)} if model else {})}


def check_pool_voices(cfg: RunConfig, device: Optional[str] = None) -> None:
    """Every voice a pool or the voice map names, checked as --voice is (an engine with one instance
    per voice: a multi-voice engine's rows fail one by one, with the reason, on a voice it lacks)."""
    cls = cfg.engine_class()
    if cls.multi_voice:
        return
    entries = (*cfg.voice_pool, *(e for pool in cfg.voice_map.values() for e in pool))
    for voice in sorted({e.voice for e in entries if e.voice is not None}):
        engine_check(cls, voice, cfg.engine_options_for(device))


def check_qc(cfg: RunConfig) -> Optional[Path]:
    """The ASR model folder `--qc asr` will load (None for the other modes); a usage error, before
    anything is written, when it or the runtime to run it is missing."""
    if cfg.qc_settings().mode != "asr":
        return None
    from ..qc.asr import ready_model

    return ready_model(cfg.qc_asr_model)


def open_transcriber(cfg: RunConfig, model: Optional[Path], device: str):
    """The ASR model on the engine's device (CUDA when the engine runs there and CTranslate2 has
    CUDA), or None when the gate does not transcribe."""
    if model is None:
        return None
    import ctranslate2

    from ..qc.asr import Transcriber

    where = "cpu"
    if device == "cuda":
        if ctranslate2.get_cuda_device_count() > 0:
            where = "cuda"
        else:
            log.warning("the engine runs on CUDA but CTranslate2 sees no CUDA device: the ASR runs on the CPU")
    return Transcriber(model, where, threads=max(1, cfg.threads))


def job_fingerprint(cfg: RunConfig, corpus: Corpus, engine: dict, runner: Optional[str] = None,
                    asr_model: Optional[Path] = None) -> dict:
    """Everything that changes the audio or which rows are read: a resume must match it. `engine`
    is the engine's fingerprint(), the device included (CPU and CUDA audio differ). A quality gate
    that retries or drops rows is part of it (its mode, limits and the ASR model's hash); the
    signals alone change no audio and are not."""
    from ..cache import file_sha256

    qc = cfg.qc_settings().fingerprint(file_sha256(asr_model / "model.bin") if asr_model else None)
    return {
        **({"qc": qc} if qc else {}),
        **({"runner": runner} if runner else {}),
        "corpus": corpus.fingerprint(),
        "columns": {"id": cfg.id_col, "text": cfg.text_col, "voice": cfg.voice_col, "format": corpus.format},
        "engine": engine,
        "seed": cfg.seed,
        "sentence_silence": cfg.sentence_silence,
        "normalize": cfg.normalize,
        "shard": None if cfg.shard_count is None else [cfg.shard_index, cfg.shard_count],
        **({"voices": voices} if (voices := cfg.voice_router().describe()) else {}),
    }


def adopt_legacy_fingerprint(out: OutputDir, cfg: RunConfig, corpus: Corpus, fingerprint: dict) -> None:
    """Jobs started by an older cosybatch recorded a hash of the corpus's first and last MiB only,
    no device and no corpus format. Where what was recorded still matches, the record is brought
    up to date, so an upgrade never asks for --allow-corpus-change or --restart."""
    recorded = out.recorded() if not cfg.restart else None
    if recorded is None:
        return
    old = recorded.get("fingerprint", {})
    changed = []
    was = old.get("corpus") or {}
    if "sha256_head_tail" in was and was == {"name": corpus.path.name, **file_fingerprint(corpus.path)}:
        old["corpus"] = fingerprint["corpus"]
        changed.append("the corpus fingerprint now covers the whole file")
    for part, key in (("engine", "device"), ("columns", "format")):
        have, new = old.get(part) or {}, fingerprint[part]
        if key not in have and have == {k: v for k, v in new.items() if k != key}:
            old[part] = new
            changed.append(f"{part}.{key} ({new[key]}) is recorded from now on")
    if changed:
        write_atomic(out.job_file, json_bytes(recorded))
        log.info("%s: %s", cfg.out, "; ".join(changed))


def _previous_success(out: Path) -> Optional[float]:
    """When an earlier run of this job completed, from its stats.json (None if none did)."""
    try:
        value = json.loads((out / STATS_FILE).read_text()).get("last_success_timestamp_seconds")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, (int, float)) else None


def _output_error(cfg: RunConfig, exc: OSError) -> OutputError:
    return OutputError(
        f"writing to {cfg.out} failed ({exc.strerror or exc}); everything committed before is "
        "intact: free space or fix the folder, then rerun the same command to resume"
    )


