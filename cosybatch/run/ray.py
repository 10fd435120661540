"""cosybatch on Ray: the same engines and output format, across a Ray cluster's machines.

    from cosybatch.config import RunConfig
    from cosybatch.run.ray import RayOptions, ray_run
    ray_run(RunConfig(corpus=Path("corpus.parquet"), out=Path("s3-mounted/out")),
            RayOptions(address="auto", actors=8, num_gpus=1))

The driver reads the corpus in file order (Parquet through Ray Data, JSONL line by line), so
row numbers and "first id wins" mean what they mean for `cosybatch run`. It applies the same
row checks and hands chunks of rows to a pool of actors. Each actor holds an engine (`num_gpus`
per actor), buckets its chunk by length, synthesises it and writes the chunk as one tar shard,
`shard-<digest>.tar`, where the digest is a hash of the chunk's ids.

The tar shards themselves are the checkpoint. A shard is written as `.partial` and renamed when
whole, and a rerun reads the ids in the finished shards. A run that died after writing a shard
but before recording it therefore loses nothing and duplicates nothing. A chunk that Ray retries
rewrites the same file name, so a retry cannot duplicate rows either. Ray Data's own
checkpointing can duplicate rows in exactly these cases.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ..config import RunConfig, cpu_count
from ..corpus import BadRow, Corpus, Row
from ..errors import OutputError, UsageError
from ..store.checkpoint import (
    FAILURES_FILE,
    RAY_FAILURES_DIR,
    RAY_ITEMS_DIR,
    STATE_DIR,
    OutputDir,
    ResumeState,
    jsonl_bytes,
    keyed_by_row,
    write_atomic,
    write_manifest_table,
)
from ..store.items import RECORDED, qc_columns
from ..store.objects import Store
from ..store.shards import ShardWriter
from .executor import BatchPolicy, EngineSet
from .job import RunResult, run_job
from .line import RowLine, open_gate
from .preflight import check_qc, configure_gpu_allocator, open_transcriber
from .runner import Committed, Dispatch, Dispatched, Ended, Resumed, Runner

log = logging.getLogger("cosybatch")


@dataclass(frozen=True)
class RayOptions:
    address: Optional[str] = None
    """Ray cluster to join: None starts a local one of its own (even where another runs on this machine),
    "auto" joins the running one, or ray://host:10001."""
    actors: int = 2
    """Actors in the pool, each holding one engine."""
    num_gpus: float = 0.0
    """GPUs per actor (1 on a GPU cluster: one engine per GPU)."""
    num_cpus: float = 1.0
    """CPUs per actor."""
    rows_per_task: int = 64
    """Rows per actor call; each call writes one tar shard."""

    def __post_init__(self) -> None:
        if self.actors < 1 or self.rows_per_task < 1:
            raise UsageError("--actors and --rows-per-task must be at least 1")
        if not (0 <= self.num_gpus <= 1024 and 0 < self.num_cpus <= 1024):  # NaN fails both
            raise UsageError(f"--num-gpus must be in 0..1024 and --num-cpus in (0, 1024] "
                             f"(got {self.num_gpus} and {self.num_cpus})")
        if self.actors > 100_000 or self.rows_per_task > 1_000_000:
            raise UsageError("--actors is at most 100000 and --rows-per-task at most 1000000")


def chunk_digest(ids: list[str]) -> str:
    return hashlib.blake2b("\x00".join(sorted(ids)).encode("utf-8", "surrogatepass"), digest_size=10).hexdigest()


class SynthWorker:
    """The actor: the engines, batched exactly as `cosybatch run` batches them (the same
    executor: batch size and budget from the engine, the budget guard, out-of-memory halving),
    and one tar shard per chunk of rows."""

    def __init__(self, cfg: RunConfig, device: str):
        cfg = cfg.with_options(device=device)
        self.cfg = cfg
        configure_gpu_allocator(cfg)  # this actor's own process: before its engine imports torch
        self.engines = EngineSet(cfg)
        self.default = self.engines.get(cfg.engine.voice, from_row=False)
        self.policy = BatchPolicy.for_engine(cfg, self.default, workers=1)  # an actor runs one batch at a time
        # The ASR model as this actor's machine has it (the driver's path may not exist here).
        self.transcriber = open_transcriber(cfg, check_qc(cfg), self.default.device)

    def describe(self) -> dict:
        """What the driver needs to know of the engine, so that it never opens one itself."""
        e = self.default
        return {"fingerprint": e.fingerprint(), "name": e.name, "voice": e.voice_name, "device": e.device,
                "language": getattr(e, "language", None),
                "batch_size_limit": self.policy.batch_size, "batch_budget": self.policy.batch_budget}

    def process(self, rows: list[Row]) -> dict:
        """One chunk through the row line, written as one tar shard named by its ids."""
        cfg = self.cfg
        digest = chunk_digest([r.id for r in rows])
        # One line (and gate) per chunk: its counts go back with the chunk (the driver sums them).
        # The speech-rate history starts anew in each chunk, so the first rows of a chunk are
        # judged without a z-score (min_history).
        line = RowLine(cfg, self.engines, self.policy, open_gate(cfg, self.engines, self.transcriber))
        done = line.make(rows)
        name = f"shard-{digest}.tar"
        with _chunk_folder(cfg) as folder:
            shard = None
            items = []
            for tar_key, members, record in sorted(done.items, key=lambda r: r[2]["row"]):  # same bytes on a retry
                if shard is None:
                    shard = ShardWriter(folder, 0, name=name)
                shard.add(tar_key, members, int(time.time()))
                items.append({**record, "shard": name})
            # Failures first: if the process dies before the rename (or the upload), the rows are simply redone.
            failures = f"{STATE_DIR}/{RAY_FAILURES_DIR}/{digest}.jsonl"
            if done.failures:
                write_atomic(folder / failures, jsonl_bytes(done.failures))
            if shard is not None:
                shard.close()
            if cfg.output.store is not None:  # this actor uploads its own shard: nodes share no disk
                _upload_chunk(Store(cfg.output.store), folder, name if shard is not None else None,
                              failures if done.failures else None, items, digest)
        return {"items": items, "failures": done.failures,
                "committed": Committed(items=len(items), audio_s=sum(i["duration_s"] for i in items),
                                       failed=len(done.failures), batches=[o.work() for o in done.batches],
                                       qc=done.qc, qc_s=done.qc_s, shape_s=done.shape_s)}


@contextlib.contextmanager
def _chunk_folder(cfg: RunConfig) -> Iterator[Path]:
    """Where an actor writes a chunk's shard: the output folder, or for a store a folder of its
    own on this node (removed once the chunk is uploaded)."""
    if cfg.output.store is None:
        yield cfg.output.folder
        return
    with tempfile.TemporaryDirectory(prefix="cosybatch-chunk-") as folder:
        (Path(folder) / STATE_DIR / RAY_FAILURES_DIR).mkdir(parents=True)
        yield Path(folder)


def _upload_chunk(store: Store, folder: Path, shard: Optional[str], failures: Optional[str], items: list[dict],
                  digest: str) -> None:
    """A chunk into the store, each object whole or not at all, in the order a kill can stop
    anywhere in: the failures, the shard, then its items' records (`ray-items/DIGEST.jsonl`, what a
    resume reads instead of the shard; a shard without them is read whole)."""
    if failures is not None:
        store.upload(folder / failures, failures)
    if shard is not None:
        store.upload(folder / shard, shard)
        store.write(f"{STATE_DIR}/{RAY_ITEMS_DIR}/{digest}.jsonl", jsonl_bytes(items))


def _record(key: str, meta: dict, shard: str) -> dict:
    """A manifest record from an item's KEY.json."""
    return {"key": key, "id": meta["id"], "shard": shard, "text": meta["text"],
            "voice": meta["voice"], "duration_s": meta["duration"],
            "num_samples": meta["num_samples"], "sample_rate": meta["sample_rate"], "row": meta["row"],
            **{name: meta[name] for name in ("instruct", *RECORDED) if name in meta},
            **(qc_columns(meta["qc"]) if isinstance(meta.get("qc"), dict) else {})}


def scan_output(out: OutputDir) -> tuple[list[dict], list[dict]]:
    """(item records from every finished shard, failure records) - the state of a ray-run job.
    A staging folder of a store's job holds the records of the store's shards
    (`pull_store_state`), not the shards."""
    from ..store.exports import iter_shard

    items = []
    for records in sorted((out.state / RAY_ITEMS_DIR).glob("*.jsonl")):
        items += [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    for shard in sorted(out.root.glob("shard-*.tar")):
        for key, meta, _wav in iter_shard(shard):
            items.append(_record(key, meta, shard.name))
    failures = []
    for path in sorted((out.state / RAY_FAILURES_DIR).glob("*.jsonl")):
        failures += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return items, failures


def pull_store_state(store: Store, out: OutputDir) -> None:
    """A store's ray-run state into its staging folder: every chunk's failures and item records,
    and the records of a shard uploaded without them (read from the shard, which is then let go)."""
    from ..store.exports import iter_shard

    listed = store.list()
    for folder in (RAY_FAILURES_DIR, RAY_ITEMS_DIR):
        local = out.state / folder
        shutil.rmtree(local, ignore_errors=True)  # the store's are the truth; staging's may be stale
        local.mkdir(parents=True)
        for name in listed:
            if name.startswith(f"{STATE_DIR}/{folder}/") and name.endswith(".jsonl"):
                store.download(name, out.root / name)
    recorded = {p.stem for p in (out.state / RAY_ITEMS_DIR).glob("*.jsonl")}
    for name in listed:
        if re.fullmatch(r"shard-[0-9a-f]{20}\.tar", name) and name[6:-4] not in recorded:
            path = out.root / name
            store.download(name, path)
            items = [_record(key, meta, name) for key, meta, _wav in iter_shard(path)]
            write_atomic(out.state / RAY_ITEMS_DIR / f"{name[6:-4]}.jsonl", jsonl_bytes(items))
            path.unlink()


def read_rows(corpus: Corpus) -> Iterator[Union[Row, BadRow]]:
    """The corpus in file order, with the same row checks as `Corpus`. Parquet is read through
    Ray Data. JSONL is read by the driver itself: Ray's text reader splits lines on every Unicode
    line break (U+0085, U+2028...), which would cut rows apart and renumber the rest. A corpus of
    parts (a folder, a glob, a URI) is streamed by the driver too, part by part: its default ids
    name the part, which Ray Data's rows would not."""
    if corpus.format != "parquet" or not isinstance(corpus, Corpus):
        yield from corpus
        return
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False  # cosybatch reports progress itself
    index = 0
    ds = ray.data.read_parquet(str(corpus.path)).select_columns(corpus.read_columns)
    for batch in ds.iter_batches(batch_size=4096, batch_format="pyarrow"):
        yield from corpus.rows_from_batch(batch, index)
        index += batch.num_rows


def ray_run(cfg: RunConfig, opts: RayOptions = RayOptions()) -> RunResult:
    """Run the job `cfg` describes on a Ray cluster (`cosybatch ray-run`)."""
    return run_job(cfg, RayRunner(opts))


class RayRunner(Runner):
    """Dispatch chunks of admitted rows to an actor pool and collect what each wrote; the finished
    shards are the checkpoint (see the module's docstring)."""

    name = "ray"
    stopping = "finishing the chunks in flight, then stopping"

    def __init__(self, opts: RayOptions):
        self.opts = opts
        self.started_ray = False

    def check(self, cfg: RunConfig) -> RunConfig:
        if cfg.output.shard_count is not None:
            raise UsageError("ray-run spreads the work over its actors itself; drop --shard")
        if cfg.engine.voice_pool_mode == "balanced" and (cfg.engine.voice_pool or cfg.engine.voice_map):
            raise UsageError("ray-run cannot balance a voice pool (its actors take rows in no fixed order); use "
                             "--voice-pool-mode hash, which gives each id the same voice on any actor")
        defaults = RunConfig.from_options(corpus=cfg.input.corpus, out=cfg.output.folder)
        unsupported = [name for name in ("metrics_file", "pushgateway", "metrics_job", "max_runtime",
                                         "shard_max_items", "shard_max_bytes", "workers", "window",
                                         "allow_corpus_change")
                       if cfg.option(name) != defaults.option(name)]
        if unsupported:
            raise UsageError(f"ray-run does not support {', '.join(unsupported)}: Ray's dashboard and job "
                             "timeouts cover metrics and time limits, and each ray-run shard is one chunk "
                             "(--rows-per-task); remove them from the flags or the job spec")
        return cfg

    def device(self, cfg: RunConfig) -> Optional[str]:
        return "cuda" if self.opts.num_gpus > 0 else "cpu" if cfg.engine.device == "auto" else cfg.engine.device

    def start(self, cfg: RunConfig, asr_model: Optional[Path]) -> dict:
        import ray
        from ray.util import ActorPool

        opts = self.opts
        if not ray.is_initialized():
            address, extra = opts.address, {}
            if address is None:
                # A cluster of its own, even where `ray start` (or another tool) left one running on
                # this machine: ray.init() without an address would join that one, and then refuse
                # the num_cpus below.
                address = "local"
                # A local cluster gets one logical CPU beyond what the actors hold, for Ray Data's
                # read tasks: with every CPU held by an actor, the read would wait forever.
                extra["num_cpus"] = max(cpu_count(), int(opts.actors * opts.num_cpus + 0.999) + 1)
                # Its actors are the job itself: Ray's default worker niceness (15) let two other
                # busy processes starve them to 2.5% of a core here. The raylet reads this variable.
                os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING, configure_logging=False, **extra)
            self.started_ray = True
        remote = ray.remote(num_cpus=opts.num_cpus, num_gpus=opts.num_gpus, max_restarts=2,
                            max_task_retries=2)(SynthWorker)
        self.cfg = cfg
        actors = [remote.remote(cfg, self.device(cfg)) for _ in range(opts.actors)]
        try:
            self.engine = ray.get(actors[0].describe.remote())  # the driver never opens an engine (nor CUDA)
        except ray.exceptions.RayActorError as exc:
            raise UsageError(f"the engine could not start in a Ray actor: {exc}") from None
        self.pool = ActorPool(actors)
        return self.engine["fingerprint"]

    def resume(self, out: OutputDir, corpus: Corpus, corpus_was: Optional[dict]) -> Resumed:
        for partial in out.root.glob("shard-*.tar.partial"):
            partial.unlink()  # a chunk that never finished; its rows are redone
        if self.cfg.output.store is not None:
            pull_store_state(Store(self.cfg.output.store), out)
        items, failures = scan_output(out)
        state = ResumeState(done_ids={i["id"] for i in items} | {f["id"] for f in failures if not keyed_by_row(f)},
                            failed_rows={f["row"] for f in failures if keyed_by_row(f)},
                            items=len(items), failures=len(failures),
                            audio_s=sum(i["duration_s"] for i in items))
        return Resumed(state)

    def dispatch(self, job: Dispatch) -> Dispatched:
        import ray

        cfg, pool, admission = job.cfg, self.pool, job.admission
        driver_failures: list[dict] = []
        cut_short = False  # a stop request left rows unread or undispatched

        def next_result() -> dict:
            try:
                return pool.get_next_unordered()
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, OSError):  # an actor could not write (disk full): resumable
                    raise OutputError(f"an actor could not write to {cfg.output.folder} ({exc.cause}); finished "
                                      "shards are intact: free space, then rerun the same command") from None
                raise

        def flush_driver_failures() -> None:
            if driver_failures:
                digest = chunk_digest([f"{f['row']}" for f in driver_failures])
                write_atomic(job.out.state / RAY_FAILURES_DIR / f"driver-{digest}.jsonl",
                             jsonl_bytes(driver_failures))
                job.report(Committed(failed=len(driver_failures)))
                driver_failures.clear()

        (job.out.state / RAY_FAILURES_DIR).mkdir(parents=True, exist_ok=True)
        chunk: list[Row] = []
        t_read = time.monotonic()
        for row in read_rows(job.corpus):
            if admission.past_limit(row):
                break
            if job.stop.is_set():
                cut_short = True
                break
            admitted = admission.admit(row)
            if admitted is None:
                continue
            if isinstance(admitted, dict):
                driver_failures.append(admitted)
                continue
            chunk.append(row)
            if len(chunk) >= self.opts.rows_per_task:
                while not pool.has_free():
                    job.report(next_result()["committed"])
                pool.submit(lambda actor, rows: actor.process.remote(rows), chunk)
                chunk = []
                flush_driver_failures()
        if chunk and job.stop.is_set():
            cut_short = True
        elif chunk:
            pool.submit(lambda actor, rows: actor.process.remote(rows), chunk)
        flush_driver_failures()
        read_s = time.monotonic() - t_read
        while pool.has_next():
            job.report(next_result()["committed"])
        # A stop that came after every chunk was dispatched interrupted nothing: they all finished.
        return Dispatched(interrupted=cut_short, read_s=read_s)

    def end(self, out: OutputDir, interrupted: bool) -> Ended:
        if self.cfg.output.store is not None:
            pull_store_state(Store(self.cfg.output.store), out)
        items, failures = scan_output(out)
        write_manifest_table(out.root, items)
        write_atomic(out.root / FAILURES_FILE, jsonl_bytes(failures))
        return Ended()

    def describe(self) -> dict:
        e = self.engine
        return {"engine": e["name"], "voice": e["voice"], "language": e.get("language"), "device": e["device"],
                "runner": "ray",
                "actors": self.opts.actors, "batch_size_limit": e["batch_size_limit"],
                "batch_budget": e["batch_budget"]}

    def close(self) -> None:
        if self.started_ray:
            import ray

            ray.shutdown()
