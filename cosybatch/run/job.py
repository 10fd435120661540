"""One job, end to end: corpus -> plan -> engine -> shards + journal -> stats.

Threads: the main thread reads and prepares rows and plans each window; `workers` inference
threads run batches (onnxruntime releases the GIL while it computes); one writer thread commits
finished batches in plan order. Queues between them are bounded, so memory stays bounded.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Union

from .. import __version__
from ..config import RunConfig
from ..corpus import BadRow, Columns, Corpus, Row
from ..errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TOO_MANY_FAILURES,
    CorpusError,
    OutputError,
    UsageError,
)
from ..stats import Progress, Stats
from ..store.checkpoint import (
    CORPUS_CHANGES_FILE,
    DUPLICATE_ID,
    RUN_FILE,
    STATS_FILE,
    Journal,
    Ledger,
    OutputDir,
    differences,
    file_fingerprint,
    json_bytes,
    jsonl_bytes,
    write_atomic,
)
from ..store.distributed import part_name
from ..store.repair import check_sizes, repair
from .committer import DONE, Committer
from .executor import BatchPolicy, EngineSet, Outcome, RowAssembler, run_batch, source_hash
from .producer import Producer

log = logging.getLogger("cosybatch")

METRICS_EVERY_S = 10.0  # how often the Prometheus textfile is refreshed during a run


@dataclass
class RunResult:
    status: str  # "complete", "interrupted", "too_many_failures", "damaged" or "corpus_error"
    exit_code: int
    stats: dict = field(default_factory=dict)

    def summary_line(self) -> str:
        s = self.stats
        return json.dumps({
            "status": self.status,
            "out": s.get("out"),
            "items_done": s.get("job_totals", {}).get("items_done"),
            "items_failed": s.get("job_totals", {}).get("items_failed"),
            "audio_seconds": s.get("job_totals", {}).get("audio_seconds"),
            "audio_seconds_per_wall_second": s.get("audio_seconds_per_wall_second"),
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


def run(cfg: RunConfig) -> RunResult:
    configure_gpu_allocator(cfg)
    # What `run --check` checks, before anything is written: a start that fails here leaves no folder.
    check_device(cfg)
    cfg.engine_class().check(cfg.voice, cfg.engine_options_for())
    if cfg.shard_count is not None:
        # Each worker owns a self-contained folder; `cosybatch merge` presents them as one.
        part = part_name(cfg.shard_index, cfg.shard_count)
        metrics = cfg.metrics_file
        if metrics is not None:  # workers sharing a volume must not overwrite each other's file
            metrics = metrics.with_name(f"{metrics.stem}.{part}{metrics.suffix}")
        cfg = replace(cfg, out=cfg.out / part, metrics_file=metrics)
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
        return _Job(cfg, out).run()
    except OSError as exc:
        if _about_output(cfg, exc):
            raise _output_error(cfg, exc) from exc
        raise
    finally:
        _remove_unstarted(out, created, state_existed)
        out.unlock()


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
    resolved = cfg.engine_class().check(cfg.voice, cfg.engine_options_for())
    return {"config": asdict(cfg), "corpus": {"format": corpus.format, "rows": corpus.num_rows},
            "voice": resolved.get("voice", resolved)}


def job_fingerprint(cfg: RunConfig, corpus: Corpus, engine: dict, runner: Optional[str] = None) -> dict:
    """Everything that changes the audio or which rows are read: a resume must match it. `engine`
    is the engine's fingerprint(), the device included (CPU and CUDA audio differ)."""
    return {
        **({"runner": runner} if runner else {}),
        "corpus": corpus.fingerprint(),
        "columns": {"id": cfg.id_col, "text": cfg.text_col, "voice": cfg.voice_col, "format": corpus.format},
        "engine": engine,
        "seed": cfg.seed,
        "sentence_silence": cfg.sentence_silence,
        "normalize": cfg.normalize,
        "shard": None if cfg.shard_count is None else [cfg.shard_index, cfg.shard_count],
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


class _Job:
    """One run's lifecycle: set-up and resume, the threads (the Producer on this one, inference
    workers, the Committer), signals and --max-runtime, and the end (manifest, checks, stats,
    metrics, exports)."""

    def __init__(self, cfg: RunConfig, out: OutputDir):
        self.cfg = cfg
        self.out = out
        self.stats = Stats()
        self.stop = threading.Event()
        self.interrupted_by: Optional[str] = None
        self.dropped_batches = 0  # batches skipped after a stop request
        self._metrics_failed = False
        self._metrics_written = 0.0
        self.repairs: list[str] = []
        self.last_success: Optional[float] = None  # when a run of this job last completed (stats.json)

    def run(self) -> RunResult:
        """Signals and --max-runtime turn into a clean stop from the very start, model load included."""
        restore = self._install_signal_handlers()
        timer = None
        if self.cfg.max_runtime is not None:
            timer = threading.Timer(self.cfg.max_runtime, self._request_stop, args=("--max-runtime",))
            timer.daemon = True
            timer.start()
        try:
            return self._run()
        finally:
            if timer is not None:
                timer.cancel()
            restore()

    def _request_stop(self, why: str) -> None:
        if not self.stop.is_set():
            self.interrupted_by = why
            self.stop.set()

    # -- the straight line -------------------------------------------------------------------
    def _run(self) -> RunResult:
        cfg = self.cfg
        corpus = open_corpus(cfg)

        t0 = time.monotonic()
        self.engines = EngineSet(cfg)
        default = self.engines.get(cfg.voice, from_row=False)
        self.stats.stage_s["load"] = time.monotonic() - t0
        self.device = default.device
        self.policy = BatchPolicy.for_engine(cfg, default)
        self.workers = self.policy.workers
        self.default_engine = default

        fingerprint = job_fingerprint(cfg, corpus, default.fingerprint())
        adopt_legacy_fingerprint(self.out, cfg, corpus, fingerprint)
        was = self.out.check_or_start(fingerprint, cfg.restart, cfg.allow_corpus_change)
        self.journal = Journal(self.out.journal_path)
        self.repairs, ledger = repair(self.out, self.journal)
        if was and ledger.failures:  # rows that failed in the old corpus may be good in the new one
            log.warning("the corpus changed: the %d earlier failures are tried again", ledger.failures)
            self.journal.append({"t": "retry_failures", "ts": round(time.time(), 3)})
            ledger = Ledger.replay(self.out.journal_path)
        state = self.out.resume_state(ledger)
        self.last_success = _previous_success(cfg.out)
        self.stats.previous_items_done = state.items
        self.stats.previous_items_failed = state.failures
        self.stats.previous_audio_s = state.audio_s
        self.committed_sources = None
        was = was or self.out.unreported_corpus_change()  # also after an interrupted first run
        if was:  # the corpus changed and --allow-corpus-change accepts it: compare the committed rows
            self.committed_sources = {item["id"]: item.get("source") for item in self.out.live_items(ledger)}
            log.warning("the corpus changed since this job started (%s); committed ids are kept, new ids are "
                        "synthesised, and committed rows that changed are listed in %s",
                        "; ".join(differences(was, corpus.fingerprint())), CORPUS_CHANGES_FILE)
        if was is not None:
            log.info("resuming %s: %d items done, %d failed before", cfg.out, state.items, state.failures)

        total = corpus.num_rows
        if total is not None and cfg.limit:
            total = min(total, cfg.limit)
        if total is not None and cfg.shard_count is not None:
            total = -(-total // cfg.shard_count)  # an estimate: ids spread evenly over workers
        write_atomic(self.out.state / RUN_FILE, json_bytes({
            "pid": os.getpid(), "started": time.time(), "corpus": str(cfg.corpus.resolve()),
            "total_rows": total, "total_is_estimate": cfg.shard_count is not None,
            "shard": None if cfg.shard_count is None else [cfg.shard_index, cfg.shard_count]}))
        self.progress = Progress(total, state.items + state.failures, cfg.progress, cfg.log_every)
        assembler = RowAssembler()
        # Batches dispatched but not yet committed, wherever they are (queued, computing, waiting
        # in the results queue or the reorder buffer): bounded, so audio never piles up in memory.
        self.uncommitted = threading.Semaphore(4 * self.workers + 4)
        self.committer = Committer(cfg, self.journal, state, self.stats, self.progress, assembler, self.engines,
                                   self.stop, self.uncommitted, self._metrics_while_running)
        self.gate = RowGate(state.done_ids, state.failed_rows, cfg.max_chars, self.committed_sources)
        self.producer = Producer(cfg, corpus, self.gate, self.engines, assembler, self.policy, self.stats,
                                 self.stop, self.uncommitted)

        work: queue.Queue = queue.Queue(maxsize=2 * self.workers)
        results: queue.Queue = queue.Queue()
        workers = [threading.Thread(target=self._infer_loop, args=(work, results), daemon=True, name=f"infer-{i}")
                   for i in range(self.workers)]
        writer = threading.Thread(target=self.committer.loop, args=(results, lambda e: _output_error(cfg, e)),
                                  daemon=True, name="writer")
        for t in [*workers, writer]:
            t.start()
        error: Optional[BaseException] = None
        try:
            self.producer.run(work, results)
        except BaseException as exc:
            error = exc
            self.stop.set()
        finally:
            for _ in workers:
                work.put(DONE)
            for t in workers:
                t.join()
            results.put(DONE)
            writer.join()
            self.progress.close()
        error = error or self.committer.error
        if error is not None:
            self.committer.finish(interrupted=True)
            raise error
        return self._finish()

    # -- inference threads -------------------------------------------------------------------
    def _infer_loop(self, work: queue.Queue, results: queue.Queue) -> None:
        while True:
            batch = work.get()
            if batch is DONE:
                return
            if self.stop.is_set():
                self.dropped_batches += 1  # interrupted: dropped now, redone on resume
                self.uncommitted.release()
                continue
            try:
                outcome = run_batch(self.engines.by_voice[batch.group], batch, self.policy.guard)
            except Exception as exc:  # never leave the writer waiting for this batch
                log.exception("batch %d failed outside the engine", batch.seq)
                outcome = Outcome(batch, [f"internal error: {exc!r}"] * len(batch.units))
            results.put(("batch", outcome))

    # -- interruption ------------------------------------------------------------------------
    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum, _frame):
            self._request_stop(signal.Signals(signum).name)

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore():
            for s, h in previous.items():
                signal.signal(s, h)
        return restore

    # -- the end -----------------------------------------------------------------------------
    def _metrics_while_running(self) -> None:
        if self.cfg.metrics_file is not None and time.monotonic() - self._metrics_written >= METRICS_EVERY_S:
            self._write_metrics(self._snapshot("running"))

    def _snapshot(self, status: str, **extra) -> dict:
        from ..gpu import memory_stats

        engine = self.default_engine
        return self.stats.to_dict(
            status=status, out=str(self.cfg.out), engine=engine.name, voice=engine.voice_name,
            device=self.device, batch_size_limit=self.policy.batch_size, batch_budget=self.policy.batch_budget,
            workers=self.workers, cosybatch=__version__, budget_changes=list(self.policy.guard.changes),
            gpu_memory=memory_stats(),
            cold_start_seconds=round(self.stats.stage_s["load"], 3),
            memory_pool=engine.memory_plan().pool,
            shard=None if self.cfg.shard_count is None else [self.cfg.shard_index, self.cfg.shard_count],
            last_success_timestamp_seconds=self.last_success,
            **extra,
        )

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
        from ..metrics import registry

        # Not `job`: that is the target label a scrape sets (it would rename ours exported_job).
        labels = {"cosybatch_job": self._metrics_job(), **self._metrics_grouping()}
        return registry(snapshot, self.committer.batch_seconds, labels)

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
        # A stop that came after the last batch was committed interrupted nothing.
        interrupted = self.stop.is_set() and not (self.producer.exhausted and self.dropped_batches == 0)
        failed = self.stats.previous_items_failed + self.stats.items_failed
        done = self.stats.previous_items_done + self.stats.items_done
        max_failed, max_failed_rate = self.cfg.failure_limit()
        too_many_failures = self.committer.too_many_failures or (
            max_failed_rate is not None and failed > max_failed_rate * max(done + failed, 1)) or (
            max_failed is not None and failed > max_failed)  # also on a rerun that adds no new failure
        self.committer.finish(interrupted)
        self.out.write_failures()
        problems: list[str] = []
        changes = None
        if not interrupted:
            ledger = Ledger.replay(self.out.journal_path)
            self.out.write_manifest(ledger)
            problems = check_sizes(self.out, ledger)  # never report "complete" over a damaged folder
            changes = self._write_corpus_changes()
        corpus_error = self.producer.corpus_error
        status = ("too_many_failures" if too_many_failures else "interrupted" if interrupted
                  else "damaged" if problems else "corpus_error" if corpus_error else "complete")
        if status == "complete" and self.cfg.export:
            from ..store.exports import export

            for fmt in self.cfg.export:
                export(self.cfg.out, fmt, require_complete=False)
        if status == "complete":
            self.last_success = round(time.time(), 3)
        extra = {"repairs": self.repairs, "problems": problems}
        if changes is not None:
            extra["corpus_changes"] = changes
        stats = self._snapshot(status, **extra)
        write_atomic(self.cfg.out / STATS_FILE, json_bytes(stats))
        if self.cfg.metrics_file is not None:
            self._write_metrics(stats)
        if self.cfg.pushgateway:
            from ..metrics import push

            try:
                push(self.cfg.pushgateway, self._metrics_registry(stats), job=self._metrics_job(),
                     grouping=self._metrics_grouping())
            except Exception as exc:  # the audio is safe; no monitoring problem may fail the job
                log.warning("could not push metrics to %s: %s", self.cfg.pushgateway, exc)
        if too_many_failures:
            return RunResult(status, EXIT_TOO_MANY_FAILURES, stats)
        if interrupted:
            log.warning("interrupted by %s: committed work is kept; rerun the same command to resume",
                        self.interrupted_by or "a stop request")
            return RunResult(status, EXIT_INTERRUPTED, stats)
        if problems:
            for problem in problems:
                log.error("%s: %s", self.cfg.out, problem)
            log.error("the output folder changed under the run; rerun the same command to repair it")
            return RunResult(status, EXIT_INTERRUPTED, stats)
        if corpus_error is not None:
            raise CorpusError(f"{corpus_error} Every readable row was processed and committed; fix the "
                              "file, then rerun with --allow-corpus-change to synthesise the rest.")
        return RunResult(status, EXIT_OK, stats)

    def _write_corpus_changes(self) -> Optional[dict]:
        """After --allow-corpus-change: list the committed ids whose row changed or is gone."""
        if self.committed_sources is None:
            return None
        changes = list(self.gate.changed)
        if self.producer.read_whole_corpus and self.cfg.limit is None:
            changes += [{"id": i, "row": None, "change": "removed",
                         "detail": "not in the corpus any more; its committed audio was kept"}
                        for i in self.committed_sources if i not in self.gate.still_there]
        write_atomic(self.cfg.out / CORPUS_CHANGES_FILE, jsonl_bytes(changes))
        self.out.corpus_change_reported()
        counts = {kind: sum(1 for c in changes if c["change"] == kind) for kind in ("changed", "removed")}
        if changes:
            log.warning("%d committed ids changed and %d are no longer in the corpus; see %s", counts["changed"],
                        counts["removed"], self.cfg.out / CORPUS_CHANGES_FILE)
        return counts
