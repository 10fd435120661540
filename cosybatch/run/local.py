"""`cosybatch run`: the job's rows made on this machine, through the row line, committed to the
journal.

Threads: the main thread reads, admits and prepares rows and plans each window (`RowLine.windows`);
`workers` inference threads run batches (`RowLine.run`; onnxruntime and torch release the GIL while
they compute); one writer thread (the Committer) finishes batches (`RowLine.finish`: the quality
gate and its retakes) and commits them in plan order. Queues between them are bounded, and so is
the number of batches dispatched but not yet committed, so memory stays bounded. Everything
around it (resume, statistics, limits, signals) is the job's: `job.py`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Optional

from ..config import RunConfig
from ..corpus import Corpus, Row
from ..engines import RowRejected
from ..errors import CorpusError
from ..store.checkpoint import (
    CORPUS_CHANGES_FILE,
    Journal,
    Ledger,
    OutputDir,
    differences,
    jsonl_bytes,
    write_atomic,
)
from ..store.items import source_hash
from ..store.repair import check_sizes, repair
from .committer import DONE, Committer
from .executor import BatchPolicy, EngineSet, Outcome
from .folder import output_error
from .job import RunResult, run_job
from .line import Admission, Reading, RowLine, open_gate
from .preflight import check_device, configure_gpu_allocator, open_transcriber, part_config
from .runner import Dispatch, Dispatched, Ended, Resumed, Runner

log = logging.getLogger("cosybatch")


def run(cfg: RunConfig) -> RunResult:
    """Run the job `cfg` describes on this machine (`cosybatch run`)."""
    return run_job(cfg, LocalRunner())


class LocalRunner(Runner):
    def check(self, cfg: RunConfig) -> RunConfig:
        configure_gpu_allocator(cfg)  # before anything may import torch
        check_device(cfg)
        return part_config(cfg)

    def device(self, cfg: RunConfig) -> Optional[str]:
        return None

    def start(self, cfg: RunConfig, asr_model: Optional[Path]) -> dict:
        self.cfg = cfg
        self.engines = EngineSet(cfg)
        default = self.engines.get(cfg.engine.voice, from_row=False)
        self.default_engine = default
        self.policy = BatchPolicy.for_engine(cfg, default)
        self.workers = self.policy.workers
        self.dropped_batches = 0  # batches skipped after a stop request
        self.line = RowLine(cfg, self.engines, self.policy,
                            open_gate(cfg, self.engines, open_transcriber(cfg, asr_model, default.device)))
        return default.fingerprint()

    def _adopter(self, corpus: Corpus):
        """Whether an item the journal does not list is this job's: its id is in the corpus, made
        from the same row (source hash) with the engine, seed and settings this job would use for
        that row. The corpus is read only when some shard holds such an item."""
        cfg = self.cfg
        rows: dict = {}  # id -> (source hash, the row's voice)

        def admit(meta: dict) -> Optional[str]:
            if not rows:
                rows.update(_rows_of_this_job(corpus, cfg))
            if meta.get("id") not in rows:
                return "its id is not in this corpus" + (" part" if cfg.output.shard_count is not None else "")
            source, row = rows[meta["id"]]
            if "source" not in meta:
                return "its KEY.json has no source hash (written before cosybatch recorded one), so its row is unknown"
            if meta["source"] != source:
                return "it was made from a different row (text, voice or prompt)"
            try:
                if row.voice is not None or row.prompt_wav is not None or not self.engines.router.active:
                    engine = self.engines.get(row.voice or cfg.engine.voice, from_row=row.voice is not None)
                else:  # a voice of the pool: the one it names
                    engine = next((e for e in self.engines.candidate_engines(row)
                                   if e.voice_name == meta.get("voice")), None)
                    if engine is None:
                        return "its voice is none of this job's pool"
            except RowRejected as exc:
                return f"its row's voice does not load here ({exc})"
            settings = {**engine.fingerprint(), "sentence_silence": cfg.output.sentence_silence_s,
                        "normalize": cfg.output.normalize}
            made = meta.get("settings")
            made = {k: v for k, v in made.items() if k != "cosybatch"} if isinstance(made, dict) else None
            # (the version that wrote it does not change what the job asked for)
            if meta.get("engine") != engine.name or meta.get("seed") != cfg.engine.seed or made != settings:
                return "it was made with other settings (engine, seed or voice settings)"
            return None

        return admit

    def resume(self, out: OutputDir, corpus: Corpus, corpus_was: Optional[dict]) -> Resumed:
        self.out = out
        self.journal = Journal(out.journal_path)
        report = repair(out, self.journal, admit=self._adopter(corpus))
        ledger = report.ledger
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
                        "; ".join(differences(corpus_was, corpus.fingerprint())), CORPUS_CHANGES_FILE)
        return Resumed(self.state, self.committed_sources, report.notes, report.quarantined)

    def dispatch(self, job: Dispatch) -> Dispatched:
        cfg, stop = job.cfg, job.stop
        self.admission, self.reading = job.admission, Reading()
        if self.line.gate.active:  # the committed clips' speech rates carry on in the gate
            self.line.gate.seed_history(job.out.live_items(self.ledger))
        # Batches dispatched but not yet committed, wherever they are (queued, computing, waiting
        # in the results queue or the reorder buffer): bounded, so audio never piles up in memory.
        self.uncommitted = threading.Semaphore(4 * self.workers + 4)
        self.committer = Committer(cfg, self.journal, self.state, self.line, job.report, stop, self.uncommitted,
                                   on_sealed=job.out.sealed_hook)

        work: queue.Queue = queue.Queue(maxsize=2 * self.workers)
        results: queue.Queue = queue.Queue()
        workers = [threading.Thread(target=self._infer_loop, args=(stop, work, results), daemon=True,
                                    name=f"infer-{i}") for i in range(self.workers)]
        writer = threading.Thread(target=self.committer.loop, args=(results, lambda e: output_error(cfg.output.folder,
                                                                                                    e)),
                                  daemon=True, name="writer")
        for t in [*workers, writer]:
            t.start()
        error: Optional[BaseException] = None
        all_queued = True
        try:
            for kind, payload in self.line.windows(job.corpus, job.admission, stop.is_set, self.reading):
                if kind == "failed":
                    results.put(("failed", payload))
                else:
                    all_queued = self._queue(payload, work, stop) and all_queued
        except BaseException as exc:
            error = exc
            stop.set()
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
        exhausted = self.reading.read_all and all_queued
        # A stop that came after the last batch was committed interrupted nothing.
        return Dispatched(interrupted=stop.is_set() and not (exhausted and self.dropped_batches == 0),
                          corpus_error=self.reading.corpus_error, read_s=self.reading.read_s,
                          prepare_s=self.reading.prepare_s)

    def _queue(self, batches: list, work: queue.Queue, stop: threading.Event) -> bool:
        """Queue a window's batches, never more uncommitted than allowed; False if a stop cut it short."""
        for batch in batches:
            while not self.uncommitted.acquire(timeout=0.2):
                if stop.is_set():
                    return False
            while True:
                if stop.is_set():
                    self.uncommitted.release()
                    return False
                try:
                    work.put(batch, timeout=0.2)
                    break
                except queue.Full:
                    continue
        return True

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
                outcome = self.line.run(batch)
            except Exception as exc:  # never leave the writer waiting for this batch
                log.exception("batch %d failed outside the engine", batch.seq)
                outcome = Outcome(batch, [f"internal error: {exc!r}"] * len(batch.units))
            results.put(("batch", outcome))

    def end(self, out: OutputDir, interrupted: bool) -> Ended:
        self.committer.finish(interrupted)
        out.write_failures()
        ended = Ended()
        if not interrupted:
            ledger = Ledger.replay(out.journal_path)
            out.write_manifest(ledger)
            ended.problems = check_sizes(out, ledger)
            changes = self._write_corpus_changes(out)
            if changes is not None:
                ended.extra["corpus_changes"] = changes
        return ended

    def describe(self) -> dict:
        from ..gpu import memory_stats

        engine = self.default_engine
        return {"engine": engine.name, "voice": engine.voice_name, "language": getattr(engine, "language", None),
                "device": engine.device,
                "batch_size_limit": self.policy.batch_size, "batch_budget": self.policy.batch_budget,
                "workers": self.workers, "budget_changes": list(self.policy.guard.changes),
                "gpu_memory": memory_stats(), "memory_pool": engine.memory_plan().pool,
                "engine_stats": engine.runtime_stats()}

    def _write_corpus_changes(self, out: OutputDir) -> Optional[dict]:
        """After --allow-corpus-change: list the committed ids whose row changed or is gone."""
        if self.committed_sources is None:
            return None
        cfg = self.cfg
        changes = list(self.admission.changed)
        if self.reading.whole_corpus and cfg.input.limit is None:
            changes += [{"id": i, "row": None, "change": "removed",
                         "detail": "not in the corpus any more; its committed audio was kept"}
                        for i in self.committed_sources if i not in self.admission.still_there]
        write_atomic(cfg.output.folder / CORPUS_CHANGES_FILE, jsonl_bytes(changes))
        out.corpus_change_reported()
        counts = {kind: sum(1 for c in changes if c["change"] == kind) for kind in ("changed", "removed")}
        if changes:
            log.warning("%d committed ids changed and %d are no longer in the corpus; see %s", counts["changed"],
                        counts["removed"], cfg.output.folder / CORPUS_CHANGES_FILE)
        return counts


def _rows_of_this_job(corpus: Corpus, cfg: RunConfig) -> dict:
    """id -> (source hash, the row) for the rows this job synthesises: within --limit, in
    this worker's part (--shard), the first row of a duplicated id."""
    rows: dict = {}
    admission = Admission(cfg)
    try:
        for row in corpus:
            if admission.past_limit(row):
                break
            if not isinstance(row, Row) or row.id in rows or admission.others(row):
                continue
            rows[row.id] = (source_hash(row), row)
    except CorpusError:
        pass  # raised after every readable row was yielded: the run reports it; adopt among those
    return rows
