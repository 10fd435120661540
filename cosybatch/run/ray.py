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

import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Optional, Union

from ..config import RunConfig, cpu_count
from ..corpus import BadRow, Corpus, Row
from ..engines import RowRejected, engine_check
from ..errors import OutputError, UsageError
from ..qc.gate import qc_columns
from ..store.checkpoint import (
    FAILURES_FILE,
    RAY_FAILURES_DIR,
    OutputDir,
    ResumeState,
    jsonl_bytes,
    keyed_by_row,
    write_atomic,
    write_manifest_table,
)
from ..store.shards import ShardWriter
from .executor import RECORDED, BatchPolicy, EngineSet, RowAssembler, run_batch
from .finish import RowFinisher
from .job import (
    Job,
    RowGate,
    Runner,
    RunResult,
    check_pool_voices,
    check_qc,
    configure_gpu_allocator,
    open_transcriber,
    run_job,
)

log = logging.getLogger("cosybatch")


@dataclass(frozen=True)
class RayOptions:
    address: Optional[str] = None
    """Ray cluster to join: None starts a local one, "auto" joins the running one, or ray://host:10001."""
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
        if self.num_gpus < 0 or self.num_cpus <= 0:
            raise UsageError("--num-gpus must be >= 0 and --num-cpus > 0")


def chunk_digest(ids: list[str]) -> str:
    return hashlib.blake2b("\x00".join(sorted(ids)).encode("utf-8", "surrogatepass"), digest_size=10).hexdigest()


class SynthWorker:
    """The actor: the engines, batched exactly as `cosybatch run` batches them (the same
    executor: batch size and budget from the engine, the budget guard, out-of-memory halving),
    and one tar shard per chunk of rows."""

    def __init__(self, cfg: RunConfig, device: str):
        cfg = replace(cfg, device=device)
        self.cfg = cfg
        configure_gpu_allocator(cfg)  # this actor's own process: before its engine imports torch
        self.engines = EngineSet(cfg)
        self.default = self.engines.get(cfg.voice, from_row=False)
        self.policy = BatchPolicy.for_engine(cfg, self.default, workers=1)  # an actor runs one batch at a time
        self.transcriber = open_transcriber(cfg, check_qc(cfg), self.default.device)

    def describe(self) -> dict:
        """What the driver needs to know of the engine, so that it never opens one itself."""
        e = self.default
        return {"fingerprint": e.fingerprint(), "name": e.name, "voice": e.voice_name, "device": e.device,
                "language": getattr(e, "language", None),
                "batch_size_limit": self.policy.batch_size, "batch_budget": self.policy.batch_budget}

    def process(self, rows: list[Row]) -> dict:
        cfg = self.cfg
        digest = chunk_digest([r.id for r in rows])
        assembler = RowAssembler()
        units, failures, rendered = [], [], []
        for row in rows:
            try:
                group, prepared, entry = self.engines.prepare(row)
            except RowRejected as exc:
                failures.append({"id": row.id, "row": row.index, "reason": str(exc)})
                continue
            units += assembler.add(row, prepared, group, entry)
        stats = {"batches": 0, "batch_sizes": Counter(), "real_frames": 0, "padded_frames": 0, "infer_s": 0.0,
                 "oom_retries": 0}

        def account(outcome) -> None:
            stats["batches"] += 1
            stats["batch_sizes"][len(outcome.batch.units)] += 1
            stats["real_frames"] += outcome.real_frames
            stats["padded_frames"] += outcome.padded_frames
            stats["infer_s"] += outcome.infer_s
            stats["oom_retries"] += outcome.oom_retries

        # One finisher per chunk: its counts go back with the chunk (the driver sums them). The
        # speech-rate history starts anew in each chunk, so the first rows of a chunk are judged
        # without a z-score (min_history).
        finisher = RowFinisher(cfg, self.engines, self.policy, self.transcriber, account=account)
        for batch in self.policy.plan(units):
            outcome = run_batch(self.engines.by_voice[batch.group], batch, self.policy.guard)
            account(outcome)
            done, failed = finisher.finish(assembler.take(outcome))
            rendered += done
            failures += failed
        name = f"shard-{digest}.tar"
        shard = None
        items = []
        for tar_key, members, record in sorted(rendered, key=lambda r: r[2]["row"]):  # the same bytes on a retry
            if shard is None:
                shard = ShardWriter(cfg.out, 0, name=name)
            shard.add(tar_key, members, int(time.time()))
            items.append({**record, "shard": name})
        # Failures first: if the process dies before the rename, the rows are simply redone.
        if failures:
            write_atomic(cfg.out / ".cosybatch" / RAY_FAILURES_DIR / f"{digest}.jsonl",
                         jsonl_bytes(failures))
        if shard is not None:
            shard.close()
        stats["qc"], stats["qc_s"] = finisher.counts.raw(), finisher.seconds
        return {"items": items, "failures": failures, "stats": stats}


def scan_output(out: OutputDir) -> tuple[list[dict], list[dict]]:
    """(item records from every finished shard, failure records) - the state of a ray-run job."""
    from ..store.exports import iter_shard

    items = []
    for shard in sorted(out.root.glob("shard-*.tar")):
        for key, meta, _wav in iter_shard(shard):
            items.append({"key": key, "id": meta["id"], "shard": shard.name, "text": meta["text"],
                          "voice": meta["voice"], "duration_s": meta["duration"],
                          "num_samples": meta["num_samples"], "sample_rate": meta["sample_rate"], "row": meta["row"],
                          **{name: meta[name] for name in ("instruct", *RECORDED) if name in meta},
                          **(qc_columns(meta["qc"]) if isinstance(meta.get("qc"), dict) else {})})
    failures = []
    for path in sorted((out.state / RAY_FAILURES_DIR).glob("*.jsonl")):
        failures += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return items, failures


def read_rows(corpus: Corpus) -> Iterator[Union[Row, BadRow]]:
    """The corpus in file order, with the same row checks as `Corpus`. Parquet is read through
    Ray Data. JSONL is read by the driver itself: Ray's text reader splits lines on every Unicode
    line break (U+0085, U+2028...), which would cut rows apart and renumber the rest."""
    if corpus.format != "parquet":
        yield from corpus
        return
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False  # cosybatch reports progress itself
    index = 0
    ds = ray.data.read_parquet(str(corpus.path)).select_columns(corpus.read_columns)
    for batch in ds.iter_batches(batch_size=4096, batch_format="pyarrow"):
        yield from corpus.rows_from_columns(batch.to_pydict(), index)
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
        self.cut_short = False  # a stop request left rows unread or undispatched

    def check(self, cfg: RunConfig) -> RunConfig:
        if cfg.shard_count is not None:
            raise UsageError("ray-run spreads the work over its actors itself; drop --shard")
        if cfg.voice_pool_mode == "balanced" and (cfg.voice_pool or cfg.voice_map):
            raise UsageError("ray-run cannot balance a voice pool (its actors take rows in no fixed order); use "
                             "--voice-pool-mode hash, which gives each id the same voice on any actor")
        defaults = RunConfig(corpus=cfg.corpus, out=cfg.out)
        unsupported = [name for name in ("metrics_file", "pushgateway", "metrics_job", "max_runtime",
                                         "shard_max_items", "shard_max_bytes", "workers", "window",
                                         "allow_corpus_change")
                       if getattr(cfg, name) != getattr(defaults, name)]
        if unsupported:
            raise UsageError(f"ray-run does not support {', '.join(unsupported)}: Ray's dashboard and job "
                             "timeouts cover metrics and time limits, and each ray-run shard is one chunk "
                             "(--rows-per-task); remove them from the flags or the job spec")
        self.device = "cuda" if self.opts.num_gpus > 0 else "cpu" if cfg.device == "auto" else cfg.device
        engine_check(cfg.engine_class(), cfg.voice, cfg.engine_options_for(self.device))  # a bad voice: exit 2 here
        check_pool_voices(cfg, self.device)
        self.asr_model = check_qc(cfg)
        return cfg

    def start(self, job: Job) -> dict:
        import ray
        from ray.util import ActorPool

        opts = self.opts
        if not ray.is_initialized():
            extra = {}
            if opts.address is None:
                # A local cluster gets one logical CPU beyond what the actors hold, for Ray Data's
                # read tasks: with every CPU held by an actor, the read would wait forever.
                extra["num_cpus"] = max(cpu_count(), int(opts.actors * opts.num_cpus + 0.999) + 1)
                # Its actors are the job itself: Ray's default worker niceness (15) let two other
                # busy processes starve them to 2.5% of a core here. The raylet reads this variable.
                os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(address=opts.address, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING, configure_logging=False, **extra)
            self.started_ray = True
        remote = ray.remote(num_cpus=opts.num_cpus, num_gpus=opts.num_gpus, max_restarts=2,
                            max_task_retries=2)(SynthWorker)
        actors = [remote.remote(job.cfg, self.device) for _ in range(opts.actors)]
        try:
            self.engine = ray.get(actors[0].describe.remote())  # the driver never opens an engine (nor CUDA)
        except ray.exceptions.RayActorError as exc:
            raise UsageError(f"the engine could not start in a Ray actor: {exc}") from None
        self.pool = ActorPool(actors)
        return self.engine

    def resume(self, job: Job, corpus_was: Optional[dict]) -> tuple[ResumeState, None]:
        for partial in job.cfg.out.glob("shard-*.tar.partial"):
            partial.unlink()  # a chunk that never finished; its rows are redone
        items, failures = scan_output(job.out)
        state = ResumeState(done_ids={i["id"] for i in items} | {f["id"] for f in failures if not keyed_by_row(f)},
                            failed_rows={f["row"] for f in failures if keyed_by_row(f)},
                            items=len(items), failures=len(failures),
                            audio_s=sum(i["duration_s"] for i in items))
        return state, None

    def dispatch(self, job: Job, corpus: Corpus, gate: RowGate) -> None:
        import ray

        cfg, stats, progress, pool = job.cfg, job.stats, job.progress, self.pool
        driver_failures: list[dict] = []

        def next_result() -> dict:
            try:
                return pool.get_next_unordered()
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, OSError):  # an actor could not write (disk full): resumable
                    raise OutputError(f"an actor could not write to {cfg.out} ({exc.cause}); finished "
                                      "shards are intact: free space, then rerun the same command") from None
                raise

        def collect(result: dict) -> None:
            stats.items_done += len(result["items"])
            stats.items_failed += len(result["failures"])
            audio_s = sum(i["duration_s"] for i in result["items"])
            stats.audio_s += audio_s
            s = result["stats"]
            stats.batches += s["batches"]
            stats.batch_sizes.update(s["batch_sizes"])
            stats.real_frames += s["real_frames"]
            stats.padded_frames += s["padded_frames"]
            stats.stage_s["infer"] += s["infer_s"]
            stats.oom_retries += s["oom_retries"]
            stats.stage_s["qc"] += s["qc_s"]
            job.qc_counts.merge(s["qc"])
            if s["qc"]["retries"]:
                progress.retake(s["qc"]["retries"])
            progress.update(len(result["items"]) + len(result["failures"]), audio_s)

        def flush_driver_failures() -> None:
            if driver_failures:
                digest = chunk_digest([f"{f['row']}" for f in driver_failures])
                write_atomic(job.out.state / RAY_FAILURES_DIR / f"driver-{digest}.jsonl",
                             jsonl_bytes(driver_failures))
                stats.items_failed += len(driver_failures)
                progress.update(len(driver_failures), 0.0)
                driver_failures.clear()

        (job.out.state / RAY_FAILURES_DIR).mkdir(parents=True, exist_ok=True)
        chunk: list[Row] = []
        t_read = time.monotonic()
        for row in read_rows(corpus):
            if cfg.limit is not None and row.index >= cfg.limit:
                break
            if job.stop.is_set():
                self.cut_short = True
                break
            admitted = gate.admit(row)
            if admitted is None:
                continue
            if isinstance(admitted, dict):
                driver_failures.append(admitted)
                continue
            chunk.append(row)
            if len(chunk) >= self.opts.rows_per_task:
                while not pool.has_free():
                    collect(next_result())
                pool.submit(lambda actor, rows: actor.process.remote(rows), chunk)
                chunk = []
                flush_driver_failures()
        if chunk and job.stop.is_set():
            self.cut_short = True
        elif chunk:
            pool.submit(lambda actor, rows: actor.process.remote(rows), chunk)
        flush_driver_failures()
        stats.stage_s["read"] = time.monotonic() - t_read
        while pool.has_next():
            collect(next_result())

    def interrupted(self, job: Job) -> bool:
        # A stop that came after every chunk was dispatched interrupted nothing: they all finished.
        return self.cut_short

    def end(self, job: Job, interrupted: bool) -> tuple[list[str], dict]:
        items, failures = scan_output(job.out)
        write_manifest_table(job.cfg.out, items)
        write_atomic(job.cfg.out / FAILURES_FILE, jsonl_bytes(failures))
        return [], {}

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
