"""One job's life, for `cosybatch run` and `cosybatch ray-run` alike: check, open and lock the
output folder, fingerprint the job, resume what is committed, run the row line through a
runner (runner.py), keep the statistics, progress and limits (--max-failures, --max-runtime),
turn signals into a clean stop, and finish (manifest, checks, stats, report, card, metrics,
exports, exit code). The line itself, in `Job._run`:

    corpus -> admission -> prepare -> plan -> engine -> quality gate -> shards + journal -> stats
              (line.py, run by the runner's threads or actors)
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .. import __version__
from ..config import RunConfig
from ..corpus import Corpus
from ..errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TOO_MANY_FAILURES,
    CorpusError,
)
from ..metrics import BatchHistogram
from ..qc.gate import QCCounts
from ..sources import describe
from ..stats import Progress, Stats, failure_summary
from ..store.checkpoint import FAILURES_FILE, RUN_FILE, STATS_FILE, OutputDir, ResumeState, json_bytes, write_atomic
from ..store.objects import ObjectSink, open_sink
from .fingerprint import adopt_legacy_fingerprint, job_fingerprint
from .folder import claimed
from .line import Admission
from .preflight import open_corpus, preflight
from .runner import Committed, Dispatch, Dispatched, Runner

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


def run_job(cfg: RunConfig, runner: Runner) -> RunResult:
    """Check the job, claim the output folder, run the job with `runner`, and leave the folder
    unlocked (and, if the job never started, as it was)."""
    cfg = runner.check(cfg)  # what `run --check` checks, before anything is written
    _, asr_model = preflight(cfg, runner.device(cfg))
    with claimed(cfg.output.folder) as out:
        sink = None
        try:
            sink = open_sink(cfg, out)  # --out in object storage: staging synced with the store, lease taken
            result = Job(cfg, out, runner, asr_model, sink).run()
            if sink is not None:
                sink.finish(result.status)  # the last uploads and commit, then the job's files
            return result
        finally:
            runner.close()
            if sink is not None:
                sink.close()


class Job:
    """One run of a job: set-up and resume, the runner's dispatch, signals and --max-runtime,
    the failure limit, and the end (manifest, checks, stats, metrics, exports)."""

    def __init__(self, cfg: RunConfig, out: OutputDir, runner: Runner, asr_model: Optional[Path] = None,
                 sink: Optional[ObjectSink] = None):
        self.cfg = cfg
        self.out = out
        self.sink = sink  # the object store the job lives in, for --out s3://...; None for a folder
        self.runner = runner
        self.asr_model = asr_model
        self.stats = Stats()
        self.batch_seconds = BatchHistogram()  # batch compute times, for the metrics
        self.too_many_failures = False  # the count limit of --max-failures stopped the run
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
        self.qc_counts = QCCounts()  # the quality gate's counts, from the runner's reports

    def run(self) -> RunResult:
        """Signals and --max-runtime turn into a clean stop from the very start, model load included."""
        restore = self._install_signal_handlers()
        timer = None
        if self.cfg.ops.max_runtime_s is not None:
            timer = threading.Timer(self.cfg.ops.max_runtime_s, self.request_stop, args=("--max-runtime",))
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
        fingerprint = self.runner.start(cfg, self.asr_model)      # engines: loaded where they run
        self.stats.stage_s["load"] = time.monotonic() - t0
        self._claim_signals()
        state, committed = self._open(corpus, fingerprint)         # checkpoint: what is done
        admission = Admission(cfg, state.done_ids, state.failed_rows, committed)
        self.progress = Progress(self._total_rows(corpus), state.items + state.failures, cfg.ops.progress,
                                 cfg.ops.log_every_s)
        try:                                                       # the row line, run by the runner
            dispatched = self.runner.dispatch(Dispatch(cfg, self.out, corpus, admission, self.stop, self.report))
        finally:
            self.progress.close()
        return self._finish(dispatched)                            # manifest -> stats

    def report(self, done: Committed) -> None:
        """A commit the runner made: into the statistics, progress, metrics and the failure limit."""
        stats = self.stats
        for work in done.batches:
            stats.add_batch(work)
            self.batch_seconds.observe(work.infer_s)
        stats.items_done += done.items
        stats.audio_s += done.audio_s
        stats.items_failed += done.failed
        stats.stage_s["qc"] += done.qc_s
        stats.stage_s["shape"] += done.shape_s
        stats.stage_s["write"] += done.write_s
        if done.qc is not None:
            self.qc_counts.merge(done.qc.raw())
            if done.qc.retries:
                self.progress.retake(done.qc.retries)
        self.progress.update(done.items + done.failed, done.audio_s)
        max_failed = self.cfg.failure_limit()[0]
        failed = stats.previous_items_failed + stats.items_failed
        if done.failed and max_failed is not None and failed > max_failed and not self.too_many_failures:
            rows = stats.previous_items_done + stats.items_done + failed
            log.error("%s: stopping; see %s", failure_summary(failed, rows, self.cfg.ops.max_failures),
                      self.cfg.output.folder / FAILURES_FILE)
            self.too_many_failures = True
            self.stop.set()
        self.metrics_while_running()

    def _open(self, corpus: Corpus, engine_fingerprint: dict) -> tuple[ResumeState, Optional[dict]]:
        """Record the job, or check that the folder holds this job, and read what is committed."""
        cfg = self.cfg
        fingerprint = job_fingerprint(cfg, corpus, engine_fingerprint, runner=self.runner.name,
                                      asr_model=self.asr_model)
        adopt_legacy_fingerprint(self.out, cfg, corpus, fingerprint)
        was = self.out.check_or_start(fingerprint, cfg.output.restart, cfg.output.allow_corpus_change)
        resumed = self.runner.resume(self.out, corpus, was)
        if self.sink is not None:
            self.sink.resumed()  # staging repaired: what it sealed before a kill is uploaded first
        state = resumed.state
        self.repairs, self.quarantined = resumed.repairs, resumed.quarantined
        self.last_success = _previous_success(cfg.output.folder)
        self.stats.previous_items_done = state.items
        self.stats.previous_items_failed = state.failures
        self.stats.previous_audio_s = state.audio_s
        if was is not None:
            log.info("resuming %s: %d items done, %d failed before", cfg.output.folder, state.items, state.failures)
        write_atomic(self.out.state / RUN_FILE, json_bytes({
            "pid": os.getpid(), "started": time.time(), "corpus": describe(cfg.input.corpus),
            "total_rows": self._total_rows(corpus), "total_is_estimate": cfg.output.shard_count is not None,
            "shard": None if cfg.output.shard_count is None else [cfg.output.shard_index, cfg.output.shard_count]}))
        return state, resumed.committed

    def _total_rows(self, corpus: Corpus) -> Optional[int]:
        cfg = self.cfg
        total = corpus.num_rows
        if total is not None and cfg.input.limit:
            total = min(total, cfg.input.limit)
        if total is not None and cfg.output.shard_count is not None:
            total = -(-total // cfg.output.shard_count)  # an estimate: ids spread evenly over workers
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
        if not over and not self.too_many_failures:
            return None
        return failure_summary(failed, done + failed, self.cfg.ops.max_failures)

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
        if self.cfg.ops.metrics_file is not None and time.monotonic() - self._metrics_written >= METRICS_EVERY_S:
            self._write_metrics(self._snapshot("running"))

    def _snapshot(self, status: str, **extra) -> dict:
        cfg = self.cfg
        if self.qc_settings.mode != "off":
            self.stats.qc = self.qc_counts.summary(self.qc_settings)
        return self.stats.to_dict(
            status=status, out=cfg.output.store or str(cfg.output.folder), **self.runner.describe(),
            cosybatch=__version__,
            cold_start_seconds=round(self.stats.stage_s["load"], 3),
            shard=None if cfg.output.shard_count is None else [cfg.output.shard_index, cfg.output.shard_count],
            last_success_timestamp_seconds=self.last_success,
            **extra,
        )

    def _write_report(self, stats: dict) -> None:
        """OUT/report.html, the audit page of the finished job (never fails the job: the audio is safe)."""
        from ..qc.audit import write_job_report

        try:
            totals = stats["job_totals"]
            summary = {"items": totals["items_done"], "failed": totals["items_failed"],
                       "audio_hours": round(totals["audio_seconds"] / 3600, 4), "engine": stats.get("engine"),
                       "voice": stats.get("voice"), "qc": stats.get("qc")}
            write_job_report(self.cfg.output.folder, summary=summary, seed=self.cfg.engine.seed,
                             clip=self.sink.clip_reader() if self.sink is not None else None)
        except Exception as exc:
            log.warning("could not write %s: %s", self.cfg.output.folder / "report.html", exc)

    def _metrics_job(self) -> str:
        from ..metrics import default_job_name

        # the job, not the part
        root = self.cfg.output.folder.parent if self.cfg.output.shard_count is not None else self.cfg.output.folder
        return self.cfg.ops.metrics_job or default_job_name(root)

    def _metrics_grouping(self) -> dict[str, str]:
        """The shard, when sharded: one Pushgateway group (and one series) per worker."""
        if self.cfg.output.shard_count is None:
            return {}
        return {"shard": f"{self.cfg.output.shard_index}/{self.cfg.output.shard_count}"}

    def _metrics_registry(self, snapshot: dict):
        from ..metrics import registry

        # Not `job`: that is the target label a scrape sets (it would rename ours exported_job).
        labels = {"cosybatch_job": self._metrics_job(), **self._metrics_grouping()}
        return registry(snapshot, self.batch_seconds, labels)

    def _write_metrics(self, snapshot: dict) -> None:
        from ..metrics import write_textfile

        self._metrics_written = time.monotonic()
        try:
            write_textfile(self.cfg.ops.metrics_file, self._metrics_registry(snapshot))
        except Exception as exc:  # monitoring must never stop the audio
            if not self._metrics_failed:
                log.error("cannot write --metrics-file %s: %s", self.cfg.ops.metrics_file, exc)
            self._metrics_failed = True

    def _finish(self, dispatched: Dispatched) -> RunResult:
        cfg = self.cfg
        interrupted = dispatched.interrupted
        self.stats.stage_s["read"] += dispatched.read_s
        self.stats.stage_s["prepare"] += dispatched.prepare_s
        too_many_failures = self.failure_limit_passed()  # also on a rerun that adds no new failure
        ended = self.runner.end(self.out, interrupted)  # never "complete" over a damaged folder
        if self.sink is not None:  # the last shard's upload and commit, before stats.json counts it
            self.sink.drain()
            self.stats.stage_s["upload"] = self.sink.upload_s  # beside the run: its own thread
        problems, extra = ended.problems, ended.extra
        corpus_error = dispatched.corpus_error
        status = ("too_many_failures" if too_many_failures else "interrupted" if interrupted
                  else "damaged" if problems else "corpus_error" if corpus_error else "complete")
        if status == "complete" and self.sink is not None and cfg.output.exports:
            self.sink.fetch_shards()  # the exports read the audio: every shard back in staging
        if status == "complete" and cfg.output.exports:
            from ..store.exports import export

            for fmt in cfg.output.exports:
                export(cfg.output.folder, fmt, require_complete=False, copy=cfg.output.export_copy)
        if status == "complete":
            self.last_success = round(time.time(), 3)
        if self.quarantined:
            extra["quarantined"] = self.quarantined
        stats = self._snapshot(status, repairs=self.repairs, problems=problems, **extra)
        write_atomic(cfg.output.folder / STATS_FILE, json_bytes(stats))
        if status == "complete" and self.qc_settings.mode != "off":
            self._write_report(stats)
        if status == "complete":
            from ..store.card import write_card

            write_card(cfg.output.folder)  # OUT/README.md, the dataset card (never fails the job)
        if cfg.ops.metrics_file is not None:
            self._write_metrics(stats)
        if cfg.ops.pushgateway:
            from ..metrics import push

            try:
                push(cfg.ops.pushgateway, self._metrics_registry(stats), job=self._metrics_job(),
                     grouping=self._metrics_grouping())
            except Exception as exc:  # the audio is safe; no monitoring problem may fail the job
                log.warning("could not push metrics to %s: %s", cfg.ops.pushgateway, exc)
        if too_many_failures:
            log.error("%s; see %s", too_many_failures, cfg.output.folder / FAILURES_FILE)
            return RunResult(status, EXIT_TOO_MANY_FAILURES, stats, error=too_many_failures)
        if interrupted:
            log.warning("interrupted by %s: committed work is kept; rerun the same command to resume",
                        self.interrupted_by or "a stop request")
            return RunResult(status, EXIT_INTERRUPTED, stats)
        if problems:
            for problem in problems:
                log.error("%s: %s", cfg.output.folder, problem)
            log.error("the output folder changed under the run; rerun the same command to repair it")
            return RunResult(status, EXIT_INTERRUPTED, stats)
        if corpus_error is not None:
            raise CorpusError(f"{corpus_error} Every readable row was processed and committed; fix the "
                              "file, then rerun with --allow-corpus-change to synthesise the rest.")
        return RunResult(status, EXIT_OK, stats)


def _previous_success(out: Path) -> Optional[float]:
    """When an earlier run of this job completed, from its stats.json (None if none did)."""
    try:
        value = json.loads((out / STATS_FILE).read_text()).get("last_success_timestamp_seconds")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, (int, float)) else None
