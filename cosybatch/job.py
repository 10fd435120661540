"""One job, end to end: corpus -> plan -> engine -> shards + journal -> stats.

Threads: the main thread reads and prepares rows and plans each window; `workers` inference
threads run batches (onnxruntime releases the GIL while it computes); one writer thread commits
finished batches in plan order. Queues between them are bounded, so memory stays bounded.
"""

from __future__ import annotations

import errno
import hashlib
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

import numpy as np

from . import __version__
from .checkpoint import (
    CORPUS_CHANGES_FILE,
    DUPLICATE_ID,
    RUN_FILE,
    STATS_FILE,
    Journal,
    Ledger,
    OutputDir,
    file_fingerprint,
    json_bytes,
    jsonl_bytes,
    write_atomic,
)
from .config import RunConfig, cpu_count
from .corpus import BadRow, Columns, Corpus, Row
from .distributed import part_name, shard_of
from .engines import EngineOptions, Prepared, RowRejected, VoiceRequest, open_engine
from .errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TOO_MANY_FAILURES,
    CorpusError,
    CosybatchError,
    OutputError,
    UsageError,
)
from .metrics import BatchHistogram
from .plan import Batch, BudgetGuard, Unit, plan_batches
from .repair import check_sizes, repair
from .shards import ShardWriter, item_key, wav_bytes
from .stats import Progress, Stats

log = logging.getLogger("cosybatch")

FIRST_WINDOW_ROWS = 64  # the first window is small so audio starts flowing at once
METRICS_EVERY_S = 10.0  # how often the Prometheus textfile is refreshed during a run
_DONE = object()


@dataclass
class _PendingRow:
    row: Row
    text: str  # what is spoken: the row's text after the engine's normalisation
    voice: str  # the engine's key in EngineSet
    parts: list  # audio per piece, filled in by finished batches
    remaining: int
    error: Optional[str] = None
    label: Optional[str] = None  # the row's voice for the manifest (multi-voice engines)


@dataclass
class _Outcome:
    batch: Batch
    audio: list  # per unit: np.ndarray, or an error string
    real_frames: int = 0
    padded_frames: int = 0
    infer_s: float = 0.0
    oom_retries: int = 0


@dataclass
class RunResult:
    status: str  # "complete", "interrupted", "too_many_failures" or "damaged"
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


def assemble_audio(parts: list, sample_rate: int, cfg: RunConfig) -> np.ndarray:
    """A row's sentences joined in order (with --sentence-silence between), peak-normalised."""
    if len(parts) == 1:
        audio = parts[0]
    else:
        gap = np.zeros(round(cfg.sentence_silence * sample_rate), dtype=np.float32)
        pieces = []
        for i, part in enumerate(parts):
            if i:
                pieces.append(gap)
            pieces.append(part)
        audio = np.concatenate(pieces)
    if cfg.normalize:
        peak = float(np.max(np.abs(audio))) if len(audio) else 0.0
        audio = audio / peak if peak > 1e-8 else np.zeros_like(audio)
    return audio


def render_item(row: Row, text: str, parts: list, engine, cfg: RunConfig,
                voice: Optional[str] = None) -> tuple[str, dict, dict]:
    """A finished row -> (shard key, tar members {ext: bytes}, manifest record). `voice` is the
    row's own voice when the engine serves several (fixed when the row was prepared)."""
    audio = assemble_audio(parts, engine.sample_rate, cfg)
    key = item_key(row.id)
    voice = voice or engine.voice_name
    meta = {
        "id": row.id, "text": text, "duration": len(audio) / engine.sample_rate,
        "sample_rate": engine.sample_rate, "num_samples": len(audio), "voice": voice,
        "engine": engine.name, "seed": cfg.seed, "row": row.index,
        "settings": {**engine.describe(), "sentence_silence": cfg.sentence_silence,
                     "normalize": cfg.normalize, "cosybatch": __version__},
    }
    if text != row.text:
        meta["source_text"] = row.text
    members = {"wav": wav_bytes(audio, engine.sample_rate), "json": json.dumps(meta, ensure_ascii=False).encode()}
    record = {"id": row.id, "key": key, "row": row.index, "text": text, "voice": voice,
              "duration_s": meta["duration"], "num_samples": len(audio), "sample_rate": engine.sample_rate,
              "source": source_hash(row)}
    return key, members, record


def source_hash(row: Row) -> str:
    """What a row asked for (text, voice, prompt): a later corpus whose row differs is reported."""
    fields = json.dumps([row.text, row.voice, row.prompt_wav, row.prompt_text], ensure_ascii=False)
    return hashlib.blake2b(fields.encode(), digest_size=8).hexdigest()


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


def run_batch(engine, batch: Batch, guard: Optional[BudgetGuard] = None) -> _Outcome:
    """Synthesise one batch, never letting one unit or an out-of-memory error end the job.

    Out of memory: the batch is split in halves and each is retried (recursively), and `guard`
    lowers the budget of that length range for the rest of the run. A unit that runs out of
    memory alone fails its row with the reason. Any other error: each unit is retried alone, so
    one bad unit fails only its own row."""
    from .gpu import is_oom

    t = time.monotonic()
    outcome = _Outcome(batch, [None] * len(batch.units))

    def attempt(indices: list[int]) -> None:
        units = tuple(batch.units[i] for i in indices)
        error = None
        try:
            syn = engine.synthesize(units)
            if len(syn.audio) != len(units):
                raise RuntimeError(f"the engine returned {len(syn.audio)} results for {len(units)} pieces")
        except Exception as exc:
            # Keep only the message: the traceback holds the failed call's frames, and with them
            # its (GPU) tensors, which the retries below need freed.
            error, oom = repr(exc), is_oom(exc)
            exc.__traceback__ = None
            del exc
        if error is None:
            for i, audio in zip(indices, syn.audio, strict=True):
                outcome.audio[i] = audio
            outcome.real_frames += syn.real_frames
            outcome.padded_frames += syn.padded_frames
        elif oom and len(indices) > 1:
            outcome.oom_retries += 1
            if guard is not None:
                guard.shrink(Batch(batch.seq, units))
            log.warning("out of memory on a batch of %d (padded cost %d); retrying it in halves",
                        len(units), len(units) * max(u.cost for u in units))
            half = len(indices) // 2
            attempt(indices[:half])
            attempt(indices[half:])
        elif len(indices) > 1:
            for i in indices:
                attempt([i])
        elif oom:
            outcome.audio[indices[0]] = (f"out of memory even alone (a piece of cost {units[0].cost}): {error}; "
                                         "split the row into shorter ones or give the job more GPU memory")
        else:
            outcome.audio[indices[0]] = f"synthesis failed: {error}"

    attempt(list(range(len(batch.units))))
    outcome.infer_s = time.monotonic() - t
    return outcome


class EngineSet:
    """Engines by voice, opened on first use. A voice that fails to load fails its rows, not the job."""

    def __init__(self, cfg: RunConfig, options: EngineOptions):
        self.cfg = cfg
        self.options = options
        self.by_voice: dict = {}
        self.errors: dict[str, str] = {}

    def get(self, voice: Optional[str], from_row: bool):
        shared = self.by_voice.get("")
        if shared is not None and getattr(shared, "multi_voice", False):
            return shared  # one instance serves every voice
        key = voice or ""
        if key in self.by_voice:
            return self.by_voice[key]
        if key in self.errors:
            raise RowRejected(self.errors[key])
        extra = dict(self.options.extra, allow_paths=not from_row)
        try:
            engine = open_engine(self.cfg.engine, voice, EngineOptions(
                self.options.device, self.options.threads, self.options.seed, extra))
        except CosybatchError as exc:
            if not from_row:
                raise
            self.errors[key] = str(exc)
            raise RowRejected(str(exc)) from None
        if getattr(engine, "multi_voice", False):
            key = ""
        self.by_voice[key] = engine
        return engine

    def prepare(self, row: Row) -> tuple[str, Prepared]:
        """Open (or reuse) the engine for the row's voice and prepare the row; returns the batch
        group (rows of one group may share a batch) and the prepared row. Raises RowRejected."""
        voice = row.voice or self.cfg.voice
        engine = self.get(voice, from_row=row.voice is not None)
        if getattr(engine, "multi_voice", False):
            from_row = row.voice is not None or row.prompt_wav is not None
            request = VoiceRequest(voice, row.prompt_wav, row.prompt_text, from_row)
            return "", engine.prepare(row.text, row.id, request)
        return voice or "", engine.prepare(row.text, row.id)


def run(cfg: RunConfig) -> RunResult:
    if cfg.engine == "cosyvoice" and cfg.device != "cpu":
        from .gpu import configure_allocator

        note = configure_allocator()  # before torch can initialise CUDA
        if note:
            log.warning(note)
    if cfg.shard_count is not None:
        # Each worker owns a self-contained folder; `cosybatch merge` presents them as one.
        part = part_name(cfg.shard_index, cfg.shard_count)
        metrics = cfg.metrics_file
        if metrics is not None:  # workers sharing a volume must not overwrite each other's file
            metrics = metrics.with_name(f"{metrics.stem}.{part}{metrics.suffix}")
        cfg = replace(cfg, out=cfg.out / part, metrics_file=metrics)
    out = OutputDir(cfg.out)
    try:
        cfg.out.mkdir(parents=True, exist_ok=True)
        out.lock()
    except OSError as exc:
        out.unlock()
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
        out.unlock()


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
        # CosyVoice's SFT voices are speakers; for Piper a speaker is a choice inside one voice.
        voice_fallback="speaker" if cfg.engine == "cosyvoice" else None), cfg.format)


def check(cfg: RunConfig) -> dict:
    """Everything a run checks before its first batch, without loading a model: options, corpus
    format and columns, engine and voice. Returns the resolved settings."""
    from dataclasses import asdict

    from .engines import ENGINES

    corpus = open_corpus(cfg)
    if cfg.engine not in ENGINES:
        raise UsageError(f"unknown engine {cfg.engine!r}; choose one of: {', '.join(sorted(ENGINES))}")
    voice = None
    if cfg.engine == "piper":
        from .engines.piper import resolve_voice

        voice = resolve_voice(cfg.voice, cfg.voice_dir)[0]
    elif cfg.engine == "cosyvoice":
        from .engines.cosyvoice import check_setup

        voice = check_setup(cfg.model, cfg.speaker or cfg.voice, cfg.prompt_wav, cfg.prompt_text)
    return {"config": asdict(cfg), "corpus": {"format": corpus.format, "rows": corpus.num_rows}, "voice": voice}


def _corpus_diff(was: dict, now: dict) -> list[str]:
    return [f"{k} was {was.get(k)!r}, now {now.get(k)!r}" for k in sorted(set(was) | set(now))
            if was.get(k) != now.get(k)]


def _output_error(cfg: RunConfig, exc: OSError) -> OutputError:
    return OutputError(
        f"writing to {cfg.out} failed ({exc.strerror or exc}); everything committed before is "
        "intact: free space or fix the folder, then rerun the same command to resume"
    )


class _Job:
    def __init__(self, cfg: RunConfig, out: OutputDir):
        self.cfg = cfg
        self.out = out
        self.stats = Stats()
        self.stop = threading.Event()
        self.interrupted_by: Optional[str] = None
        self.max_failed, self.max_failed_rate = cfg.failure_limit()
        self.batch_seconds = BatchHistogram()
        self.exhausted = False  # every row was read and every batch dispatched
        self.dropped_batches = 0  # batches skipped after a stop request
        self._metrics_failed = False
        self._metrics_written = 0.0
        self.too_many_failures = False
        self.corpus_error: Optional[CorpusError] = None
        self.read_whole_corpus = False
        self.repairs: list[str] = []

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
        self.engines = EngineSet(cfg, EngineOptions(cfg.device, cfg.threads, cfg.seed, cfg.engine_extra()))
        default = self.engines.get(cfg.voice, from_row=False)
        self.stats.stage_s["load"] = time.monotonic() - t0
        self.device = default.device
        size, per_item = getattr(default, "batch_defaults", lambda: (1 if self.device == "cpu" else 64, 256))()
        self.batch_size = cfg.batch_size or size
        self.workers = cfg.workers or (cpu_count() if self.device == "cpu" else 2)
        probed = getattr(default, "probed_budget", None)  # sized to the GPU pool; workers share it
        self.batch_budget = cfg.batch_budget or (max(1, probed // self.workers) if probed else None) \
            or self.batch_size * per_item
        self.guard = BudgetGuard(self.batch_budget)
        self.default_engine = default

        fingerprint = self._fingerprint(corpus, default)
        self._adopt_legacy_corpus_fingerprint(corpus, fingerprint)
        was = self.out.check_or_start(fingerprint, cfg.restart, cfg.allow_corpus_change)
        self.journal = Journal(self.out.journal_path)
        self.repairs = repair(self.out, self.journal)
        ledger = Ledger.replay(self.out.journal_path)
        if was and ledger.failures:  # rows that failed in the old corpus may be good in the new one
            log.warning("the corpus changed: the %d earlier failures are tried again", ledger.failures)
            self.journal.append({"t": "retry_failures", "ts": round(time.time(), 3)})
            ledger = Ledger.replay(self.out.journal_path)
        state = self.out.resume_state(ledger)
        self.stats.previous_items_done = state.items
        self.stats.previous_items_failed = state.failures
        self.stats.previous_audio_s = state.audio_s
        self.committed_sources = None
        if was:  # the corpus changed and --allow-corpus-change accepts it: compare the committed rows
            self.committed_sources = {item["id"]: item.get("source") for item in self.out.live_items(ledger)}
            log.warning("the corpus changed since this job started (%s); committed ids are kept, new ids are "
                        "synthesised, and committed rows that changed are listed in %s",
                        "; ".join(_corpus_diff(was, corpus.fingerprint())), CORPUS_CHANGES_FILE)
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
        self.shard = ShardWriter(cfg.out, state.open_shard, state.open_offset, state.open_items) \
            if state.open_shard is not None else None
        self.next_shard = state.next_shard
        self.rows: dict[int, _PendingRow] = {}
        self.rows_lock = threading.Lock()

        work: queue.Queue = queue.Queue(maxsize=2 * self.workers)
        # Batches dispatched but not yet committed, wherever they are (queued, computing, waiting
        # in the results queue or the reorder buffer): bounded, so audio never piles up in memory.
        self.uncommitted = threading.Semaphore(4 * self.workers + 4)
        results: queue.Queue = queue.Queue()
        workers = [threading.Thread(target=self._infer_loop, args=(work, results), daemon=True, name=f"infer-{i}")
                   for i in range(self.workers)]
        writer = threading.Thread(target=self._write_loop, args=(results,), daemon=True, name="writer")
        for t in [*workers, writer]:
            t.start()
        error: Optional[BaseException] = None
        try:
            self._produce(corpus, state.done_ids, state.failed_rows, work, results)
        except BaseException as exc:
            error = exc
            self.stop.set()
        finally:
            for _ in workers:
                work.put(_DONE)
            for t in workers:
                t.join()
            results.put(_DONE)
            writer.join()
            self.progress.close()
        if self.writer_error is not None:
            error = error or self.writer_error
        if error is not None:
            if self.shard is not None:
                self.shard.abandon()
            self.journal.close()
            raise error
        return self._finish()

    def _fingerprint(self, corpus: Corpus, engine) -> dict:
        """Everything that changes the audio or which rows are read: a resume must match it."""
        cfg = self.cfg
        return {
            "corpus": corpus.fingerprint(),
            "columns": {"id": cfg.id_col, "text": cfg.text_col, "voice": cfg.voice_col, "format": corpus.format},
            "engine": engine.describe(),
            "seed": cfg.seed,
            "sentence_silence": cfg.sentence_silence,
            "normalize": cfg.normalize,
            "shard": None if cfg.shard_count is None else [cfg.shard_index, cfg.shard_count],
        }

    def _adopt_legacy_corpus_fingerprint(self, corpus: Corpus, fingerprint: dict) -> None:
        """Jobs started before the fingerprint covered the whole corpus recorded a hash of its
        first and last MiB. When that still matches, the file is taken as the same one and the
        record gets the whole-file hash, so an upgrade needs no --allow-corpus-change."""
        recorded = self.out.recorded() if not self.cfg.restart else None
        old = (recorded or {}).get("fingerprint", {}).get("corpus") or {}
        if "sha256_head_tail" in old and old == {"name": corpus.path.name, **file_fingerprint(corpus.path)}:
            recorded["fingerprint"]["corpus"] = fingerprint["corpus"]
            write_atomic(self.out.job_file, json_bytes(recorded))
            log.info("%s: the corpus fingerprint now covers the whole file", self.cfg.out)

    # -- main thread: read, prepare, plan ----------------------------------------------------
    def _produce(self, corpus: Corpus, done_ids: set, failed_rows: set, work: queue.Queue,
                 results: queue.Queue) -> None:
        cfg = self.cfg
        gate = self.gate = RowGate(done_ids, failed_rows, cfg.max_chars, self.committed_sources)
        window_rows = FIRST_WINDOW_ROWS
        units: list[Unit] = []
        failures: list[dict] = []
        rows_in_window = 0
        next_key = 0
        seq = 0
        it = iter(corpus)
        read_s = prep_s = 0.0
        read_all = False
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                row = next(it, None)
            except CorpusError as exc:  # raised after every readable row was yielded
                self.corpus_error = exc
                row = None
            read_s += time.monotonic() - t
            if row is None or (cfg.limit is not None and row.index >= cfg.limit):
                read_all = True
                self.read_whole_corpus = row is None
                break
            if cfg.shard_count is not None and shard_of(row.id if row.id is not None else f"#row{row.index}",
                                                        cfg.shard_count) != cfg.shard_index:
                continue  # another worker's row
            admitted = gate.admit(row)
            if admitted is None:
                continue
            if isinstance(admitted, dict):
                failures.append(admitted)
                continue
            t = time.monotonic()
            try:
                group, prepared = self.engines.prepare(row)
            except RowRejected as exc:
                failures.append({"id": row.id, "row": row.index, "reason": str(exc)})
                prep_s += time.monotonic() - t
                continue
            prep_s += time.monotonic() - t
            key = next_key
            next_key += 1
            with self.rows_lock:
                self.rows[key] = _PendingRow(row, prepared.text, group, [None] * len(prepared.costs),
                                             len(prepared.costs), label=prepared.voice)
            units.extend(Unit(key, part, cost, group, payload)
                         for part, (cost, payload) in enumerate(zip(prepared.costs, prepared.payloads, strict=True)))
            rows_in_window += 1
            if rows_in_window >= window_rows:
                seq, _ = self._dispatch(units, seq, work)
                units, rows_in_window = [], 0
                window_rows = min(window_rows * 4, cfg.window)
            if len(failures) >= 256:
                results.put(("failed", failures))
                failures = []
        if read_all:
            self.exhausted = self._dispatch(units, seq, work)[1] if units else True
        if failures:
            results.put(("failed", failures))
        self.stats.stage_s["read"] += read_s
        self.stats.stage_s["prepare"] += prep_s

    def _dispatch(self, units: list[Unit], seq: int, work: queue.Queue) -> tuple[int, bool]:
        """Plan a window and queue its batches; returns (next seq, whether all were queued)."""
        batches = plan_batches(units, self.batch_size, self.guard, first_seq=seq)
        for batch in batches:
            while not self.uncommitted.acquire(timeout=0.2):
                if self.stop.is_set():
                    return seq + len(batches), False
            while True:
                if self.stop.is_set():
                    self.uncommitted.release()
                    return seq + len(batches), False
                try:
                    work.put(batch, timeout=0.2)
                    break
                except queue.Full:
                    continue
        return seq + len(batches), True

    # -- inference threads -------------------------------------------------------------------
    def _infer_loop(self, work: queue.Queue, results: queue.Queue) -> None:
        while True:
            batch = work.get()
            if batch is _DONE:
                return
            if self.stop.is_set():
                self.dropped_batches += 1  # interrupted: dropped now, redone on resume
                self.uncommitted.release()
                continue
            try:
                outcome = run_batch(self.engines.by_voice[batch.group], batch, self.guard)
            except Exception as exc:  # never leave the writer waiting for this batch
                log.exception("batch %d failed outside the engine", batch.seq)
                outcome = _Outcome(batch, [f"internal error: {exc!r}"] * len(batch.units))
            results.put(("batch", outcome))

    # -- writer thread -----------------------------------------------------------------------
    writer_error: Optional[BaseException] = None

    def _write_loop(self, results: queue.Queue) -> None:
        pending: dict[int, _Outcome] = {}
        next_seq = 0
        try:
            while True:
                msg = results.get()
                if msg is _DONE:
                    break
                kind, payload = msg
                if kind == "failed":
                    self._commit_failures(payload)
                    continue
                pending[payload.batch.seq] = payload
                while next_seq in pending:
                    self._commit_batch(pending.pop(next_seq))
                    self.uncommitted.release()
                    next_seq += 1
            # Interrupted: batches after a dropped one still hold finished rows worth keeping.
            for seq in sorted(pending):
                self._commit_batch(pending.pop(seq))
                self.uncommitted.release()
        except OSError as exc:
            # Nothing after the last commit counts; a rerun truncates it away.
            self.writer_error = _output_error(self.cfg, exc)
            self.stop.set()
        except BaseException as exc:
            self.writer_error = exc
            self.stop.set()

    def _commit_failures(self, failures: list[dict]) -> None:
        self.journal.append({"t": "failed", "ts": round(time.time(), 3), "items": failures})
        self.stats.items_failed += len(failures)
        self.progress.update(len(failures), 0.0)
        total_failed = self.stats.previous_items_failed + self.stats.items_failed
        if self.max_failed is not None and total_failed > self.max_failed and not self.too_many_failures:
            log.error("%d rows failed, more than --max-failures %d: stopping; see %s",
                      total_failed, self.max_failed, self.cfg.out / "failures.jsonl")
            self.too_many_failures = True
            self.stop.set()

    def _commit_batch(self, outcome: _Outcome) -> None:
        t = time.monotonic()
        stats = self.stats
        stats.batches += 1
        stats.batch_sizes[len(outcome.batch.units)] += 1
        stats.real_frames += outcome.real_frames
        stats.padded_frames += outcome.padded_frames
        stats.oom_retries += outcome.oom_retries
        stats.stage_s["infer"] += outcome.infer_s
        self.batch_seconds.observe(outcome.infer_s)
        finished: list[_PendingRow] = []
        with self.rows_lock:
            for unit, audio in zip(outcome.batch.units, outcome.audio, strict=True):
                pending = self.rows[unit.row_key]
                if isinstance(audio, str):
                    pending.error = pending.error or audio
                else:
                    pending.parts[unit.part] = audio
                pending.remaining -= 1
                if pending.remaining == 0:
                    finished.append(self.rows.pop(unit.row_key))
        items, failures = [], []
        mtime = int(time.time())
        for pending in sorted(finished, key=lambda p: p.row.index):
            row = pending.row
            if pending.error:
                failures.append({"id": row.id, "row": row.index, "reason": pending.error})
                continue
            engine = self.engines.by_voice[pending.voice]
            key, members, record = render_item(row, pending.text, pending.parts, engine, self.cfg, pending.label)
            if self.shard is None:
                self.shard = ShardWriter(self.cfg.out, self.next_shard)
                self.next_shard += 1
            self.shard.add(key, members, mtime)
            items.append(record)
        if items:
            end = self.shard.commit()
            self.journal.append({"t": "items", "ts": round(time.time(), 3), "shard": self.shard.index,
                                 "end": end, "items": items})
            stats.items_done += len(items)
            audio_s = sum(i["duration_s"] for i in items)
            stats.audio_s += audio_s
            self.progress.update(len(items), audio_s)
        if failures:
            self._commit_failures(failures)
        if self.shard is not None and (self.shard.items >= self.cfg.shard_max_items
                                       or self.shard.offset >= self.cfg.shard_max_bytes):
            self._close_shard()
        stats.stage_s["write"] += time.monotonic() - t
        if self.cfg.metrics_file is not None and time.monotonic() - self._metrics_written >= METRICS_EVERY_S:
            self._write_metrics(self._snapshot("running"))

    def _close_shard(self) -> None:
        index, items = self.shard.index, self.shard.items
        self.shard.close()
        self.journal.append({"t": "closed", "shard": index, "items": items})
        self.shard = None

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
    def _snapshot(self, status: str, **extra) -> dict:
        from .gpu import memory_stats

        engine = self.default_engine
        return self.stats.to_dict(
            status=status, out=str(self.cfg.out), engine=engine.name, voice=engine.voice_name,
            device=self.device, batch_size_limit=self.batch_size, batch_budget=self.batch_budget,
            workers=self.workers, cosybatch=__version__, budget_changes=list(self.guard.changes),
            gpu_memory=memory_stats(),
            cold_start_seconds=round(self.stats.stage_s["load"], 3),
            memory_pool=getattr(engine, "pool_info", None),
            shard=None if self.cfg.shard_count is None else [self.cfg.shard_index, self.cfg.shard_count],
            **extra,
        )

    def _metrics_registry(self, snapshot: dict):
        from .metrics import registry

        labels = {"job": self.cfg.out.name}
        if self.cfg.shard_count is not None:
            labels["job"] = self.cfg.out.parent.name  # the job, not the part folder
            labels["shard"] = f"{self.cfg.shard_index}/{self.cfg.shard_count}"
        return registry(snapshot, self.batch_seconds, labels)

    def _write_metrics(self, snapshot: dict) -> None:
        from .metrics import write_textfile

        self._metrics_written = time.monotonic()
        try:
            write_textfile(self.cfg.metrics_file, self._metrics_registry(snapshot))
        except Exception as exc:  # monitoring must never stop the audio
            if not self._metrics_failed:
                log.error("cannot write --metrics-file %s: %s", self.cfg.metrics_file, exc)
            self._metrics_failed = True

    def _finish(self) -> RunResult:
        # A stop that came after the last batch was committed interrupted nothing.
        interrupted = self.stop.is_set() and not (self.exhausted and self.dropped_batches == 0)
        failed = self.stats.previous_items_failed + self.stats.items_failed
        done = self.stats.previous_items_done + self.stats.items_done
        if self.max_failed_rate is not None and failed > self.max_failed_rate * max(done + failed, 1):
            self.too_many_failures = True
        if self.max_failed is not None and failed > self.max_failed:
            self.too_many_failures = True  # also on a rerun that adds no new failure
        if not interrupted and self.shard is not None:
            self._close_shard()
        elif self.shard is not None:
            self.shard.abandon()
        self.journal.close()
        self.out.write_failures()
        problems: list[str] = []
        changes = None
        if not interrupted:
            ledger = Ledger.replay(self.out.journal_path)
            self.out.write_manifest(ledger)
            problems = check_sizes(self.out, ledger)  # never report "complete" over a damaged folder
            changes = self._write_corpus_changes()
        status = ("too_many_failures" if self.too_many_failures else "interrupted" if interrupted
                  else "damaged" if problems else "corpus_error" if self.corpus_error else "complete")
        if status == "complete" and self.cfg.export:
            from .exports import export

            for fmt in self.cfg.export:
                export(self.cfg.out, fmt, require_complete=False)
        extra = {"repairs": self.repairs, "problems": problems}
        if changes is not None:
            extra["corpus_changes"] = changes
        stats = self._snapshot(status, **extra)
        write_atomic(self.cfg.out / STATS_FILE, json_bytes(stats))
        if self.cfg.metrics_file is not None:
            self._write_metrics(stats)
        if self.cfg.pushgateway:
            from .metrics import push

            try:
                push(self.cfg.pushgateway, self._metrics_registry(stats), job="cosybatch",
                     grouping={"instance": self.cfg.out.name})
            except Exception as exc:  # the audio is safe; no monitoring problem may fail the job
                log.warning("could not push metrics to %s: %s", self.cfg.pushgateway, exc)
        if self.too_many_failures:
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
        if self.corpus_error is not None:
            raise CorpusError(f"{self.corpus_error} Every readable row was processed and committed; fix the "
                              "file, then rerun with --allow-corpus-change to synthesise the rest.")
        return RunResult(status, EXIT_OK, stats)

    def _write_corpus_changes(self) -> Optional[dict]:
        """After --allow-corpus-change: list the committed ids whose row changed or is gone."""
        if self.committed_sources is None:
            return None
        changes = list(self.gate.changed)
        if self.read_whole_corpus and self.cfg.limit is None:
            changes += [{"id": i, "row": None, "change": "removed",
                         "detail": "not in the corpus any more; its committed audio was kept"}
                        for i in self.committed_sources if i not in self.gate.still_there]
        write_atomic(self.cfg.out / CORPUS_CHANGES_FILE, jsonl_bytes(changes))
        counts = {kind: sum(1 for c in changes if c["change"] == kind) for kind in ("changed", "removed")}
        if changes:
            log.warning("%d committed ids changed and %d are no longer in the corpus; see %s", counts["changed"],
                        counts["removed"], self.cfg.out / CORPUS_CHANGES_FILE)
        return counts
