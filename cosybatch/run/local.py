"""`cosybatch run`: the job's rows synthesised on this machine, committed to the journal.

Threads: the main thread reads and prepares rows and plans each window (the Producer);
`workers` inference threads run batches (onnxruntime releases the GIL while it computes); one
writer thread (the Committer) commits finished batches in plan order. Queues between them are
bounded, so memory stays bounded. Everything around it (resume, limits, signals, stats) is the
job's: `job.py`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Optional

from ..config import RunConfig
from ..corpus import Corpus, Row
from ..engines import RowRejected, engine_check
from ..errors import CorpusError
from ..store.checkpoint import CORPUS_CHANGES_FILE, Journal, Ledger, differences, jsonl_bytes, write_atomic
from ..store.distributed import shard_of
from ..store.repair import check_sizes, repair
from .committer import DONE, Committer
from .executor import BatchPolicy, EngineSet, Outcome, RowAssembler, run_batch, source_hash
from .finish import RowFinisher
from .job import (
    Job,
    RowGate,
    Runner,
    RunResult,
    _output_error,
    check_device,
    check_pool_voices,
    check_qc,
    configure_gpu_allocator,
    open_transcriber,
    part_config,
    run_job,
)
from .producer import Producer

log = logging.getLogger("cosybatch")


def run(cfg: RunConfig) -> RunResult:
    """Run the job `cfg` describes on this machine (`cosybatch run`)."""
    return run_job(cfg, LocalRunner())


class LocalRunner(Runner):
    def check(self, cfg: RunConfig) -> RunConfig:
        configure_gpu_allocator(cfg)
        # What `run --check` checks, before anything is written: a start that fails here leaves no folder.
        check_device(cfg)
        engine_check(cfg.engine_class(), cfg.voice, cfg.engine_options_for())
        check_pool_voices(cfg)
        self.asr_model = check_qc(cfg)
        return part_config(cfg)

    def start(self, job: Job) -> dict:
        self.engines = EngineSet(job.cfg)
        default = self.engines.get(job.cfg.voice, from_row=False)
        self.default_engine = default
        self.device = default.device
        self.policy = BatchPolicy.for_engine(job.cfg, default)
        self.workers = self.policy.workers
        self.dropped_batches = 0  # batches skipped after a stop request
        self.transcriber = open_transcriber(job.cfg, self.asr_model, self.device)
        return {"fingerprint": default.fingerprint()}

    def _adopter(self, job: Job):
        """Whether an item the journal does not list is this job's: its id is in the corpus, made
        from the same row (source hash) with the engine, seed and settings this job would use for
        that row. The corpus is read only when some shard holds such an item."""
        cfg = job.cfg
        rows: dict = {}  # id -> (source hash, the row's voice)

        def admit(meta: dict) -> Optional[str]:
            if not rows:
                rows.update(_rows_of_this_job(job.corpus, cfg))
            if meta.get("id") not in rows:
                return "its id is not in this corpus" + (" part" if cfg.shard_count is not None else "")
            source, row = rows[meta["id"]]
            if "source" not in meta:
                return "its KEY.json has no source hash (written before cosybatch recorded one), so its row is unknown"
            if meta["source"] != source:
                return "it was made from a different row (text, voice or prompt)"
            try:
                if row.voice is not None or row.prompt_wav is not None or not self.engines.router.active:
                    engine = self.engines.get(row.voice or cfg.voice, from_row=row.voice is not None)
                else:  # a voice of the pool: the one it names
                    engine = next((e for e in self.engines.candidate_engines(row)
                                   if e.voice_name == meta.get("voice")), None)
                    if engine is None:
                        return "its voice is none of this job's pool"
            except RowRejected as exc:
                return f"its row's voice does not load here ({exc})"
            settings = {**engine.fingerprint(), "sentence_silence": cfg.sentence_silence, "normalize": cfg.normalize}
            made = meta.get("settings")
            made = {k: v for k, v in made.items() if k != "cosybatch"} if isinstance(made, dict) else None
            # (the version that wrote it does not change what the job asked for)
            if meta.get("engine") != engine.name or meta.get("seed") != cfg.seed or made != settings:
                return "it was made with other settings (engine, seed or voice settings)"
            return None

        return admit

    def resume(self, job: Job, corpus_was: Optional[dict]):
        out = job.out
        self.journal = Journal(out.journal_path)
        report = repair(out, self.journal, admit=self._adopter(job))
        job.repairs, job.quarantined, ledger = report.notes, report.quarantined, report.ledger
        if corpus_was and ledger.failures:  # rows that failed in the old corpus may be good in the new one
            log.warning("the corpus changed: the %d earlier failures are tried again", ledger.failures)
            self.journal.append({"t": "retry_failures", "ts": round(time.time(), 3)})
            ledger = Ledger.replay(out.journal_path)
        self.state = out.resume_state(ledger)
        self.ledger = ledger
        self.committed_sources = None
        corpus_was = corpus_was or out.unreported_corpus_change()  # also after an interrupted first run
        if corpus_was:  # the corpus changed and --allow-corpus-change accepts it: compare the committed rows
            self.committed_sources = {item["id"]: item.get("source") for item in out.live_items(ledger)}
            log.warning("the corpus changed since this job started (%s); committed ids are kept, new ids are "
                        "synthesised, and committed rows that changed are listed in %s",
                        "; ".join(differences(corpus_was, job.corpus.fingerprint())), CORPUS_CHANGES_FILE)
        return self.state, self.committed_sources

    def dispatch(self, job: Job, corpus: Corpus, gate: RowGate) -> None:
        cfg = job.cfg
        self.gate = gate
        assembler = RowAssembler()
        # Batches dispatched but not yet committed, wherever they are (queued, computing, waiting
        # in the results queue or the reorder buffer): bounded, so audio never piles up in memory.
        self.uncommitted = threading.Semaphore(4 * self.workers + 4)
        self.finisher = RowFinisher(cfg, self.engines, self.policy, self.transcriber, counts=job.qc_counts,
                                    on_retry=job.progress.retake)
        if self.finisher.settings.mode != "off":  # the committed clips' speech rates carry on in the gate
            self.finisher.seed_history(job.out.live_items(self.ledger))
        self.committer = Committer(cfg, self.journal, self.state, job.stats, job.progress, assembler, self.finisher,
                                   job.stop, self.uncommitted, job.metrics_while_running)
        self.finisher.account = self.committer.account
        self.batch_seconds = self.committer.batch_seconds
        self.producer = Producer(cfg, corpus, gate, self.engines, assembler, self.policy, job.stats,
                                 job.stop, self.uncommitted)

        work: queue.Queue = queue.Queue(maxsize=2 * self.workers)
        results: queue.Queue = queue.Queue()
        workers = [threading.Thread(target=self._infer_loop, args=(job.stop, work, results), daemon=True,
                                    name=f"infer-{i}") for i in range(self.workers)]
        writer = threading.Thread(target=self.committer.loop, args=(results, lambda e: _output_error(cfg, e)),
                                  daemon=True, name="writer")
        for t in [*workers, writer]:
            t.start()
        error: Optional[BaseException] = None
        try:
            self.producer.run(work, results)
        except BaseException as exc:
            error = exc
            job.stop.set()
        finally:
            for _ in workers:
                work.put(DONE)
            for t in workers:
                t.join()
            results.put(DONE)
            writer.join()
        error = error or self.committer.error
        if error is not None:
            self.committer.finish(interrupted=True)
            raise error
        self.corpus_error = self.producer.corpus_error

    def _infer_loop(self, stop: threading.Event, work: queue.Queue, results: queue.Queue) -> None:
        while True:
            batch = work.get()
            if batch is DONE:
                return
            if stop.is_set():
                self.dropped_batches += 1  # interrupted: dropped now, redone on resume
                self.uncommitted.release()
                continue
            try:
                outcome = run_batch(self.engines.by_voice[batch.group], batch, self.policy.guard)
            except Exception as exc:  # never leave the writer waiting for this batch
                log.exception("batch %d failed outside the engine", batch.seq)
                outcome = Outcome(batch, [f"internal error: {exc!r}"] * len(batch.units))
            results.put(("batch", outcome))

    def interrupted(self, job: Job) -> bool:
        # A stop that came after the last batch was committed interrupted nothing.
        return job.stop.is_set() and not (self.producer.exhausted and self.dropped_batches == 0)

    def stopped_for_failures(self) -> bool:
        return self.committer.too_many_failures

    def end(self, job: Job, interrupted: bool) -> tuple[list[str], dict]:
        self.committer.finish(interrupted)
        job.out.write_failures()
        problems: list[str] = []
        extra: dict = {}
        if not interrupted:
            ledger = Ledger.replay(job.out.journal_path)
            job.out.write_manifest(ledger)
            problems = check_sizes(job.out, ledger)
            changes = self._write_corpus_changes(job)
            if changes is not None:
                extra["corpus_changes"] = changes
        return problems, extra

    def describe(self) -> dict:
        from ..gpu import memory_stats

        engine = self.default_engine
        return {"engine": engine.name, "voice": engine.voice_name, "language": getattr(engine, "language", None),
                "device": self.device,
                "batch_size_limit": self.policy.batch_size, "batch_budget": self.policy.batch_budget,
                "workers": self.workers, "budget_changes": list(self.policy.guard.changes),
                "gpu_memory": memory_stats(), "memory_pool": engine.memory_plan().pool,
                "engine_stats": engine.runtime_stats()}

    def _write_corpus_changes(self, job: Job) -> Optional[dict]:
        """After --allow-corpus-change: list the committed ids whose row changed or is gone."""
        if self.committed_sources is None:
            return None
        cfg = job.cfg
        changes = list(self.gate.changed)
        if self.producer.read_whole_corpus and cfg.limit is None:
            changes += [{"id": i, "row": None, "change": "removed",
                         "detail": "not in the corpus any more; its committed audio was kept"}
                        for i in self.committed_sources if i not in self.gate.still_there]
        write_atomic(cfg.out / CORPUS_CHANGES_FILE, jsonl_bytes(changes))
        job.out.corpus_change_reported()
        counts = {kind: sum(1 for c in changes if c["change"] == kind) for kind in ("changed", "removed")}
        if changes:
            log.warning("%d committed ids changed and %d are no longer in the corpus; see %s", counts["changed"],
                        counts["removed"], cfg.out / CORPUS_CHANGES_FILE)
        return counts


def _rows_of_this_job(corpus: Corpus, cfg: RunConfig) -> dict:
    """id -> (source hash, the row) for the rows this job synthesises: within --limit, in
    this worker's part (--shard), the first row of a duplicated id."""
    rows: dict = {}
    try:
        for row in corpus:
            if cfg.limit is not None and row.index >= cfg.limit:
                break
            if not isinstance(row, Row) or row.id in rows:
                continue
            if cfg.shard_count is not None and shard_of(row.id, cfg.shard_count) != cfg.shard_index:
                continue
            rows[row.id] = (source_hash(row), row)
    except CorpusError:
        pass  # raised after every readable row was yielded: the run reports it; adopt among those
    return rows
