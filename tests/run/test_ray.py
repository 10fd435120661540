"""`cosybatch ray-run` on a local Ray cluster started by the test (CPU, 2 actors)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import read_output, write_parquet

ray = pytest.importorskip("ray")

from cosybatch.config import RunConfig  # noqa: E402
from cosybatch.corpus import Row  # noqa: E402
from cosybatch.run.local import run  # noqa: E402
from cosybatch.run.ray import RayOptions, SynthWorker, ray_run  # noqa: E402

# Each test starts a local Ray cluster (or a ray-run driver): seconds of start-up apiece.
# These tests run in a pytest process of their own (`-m ray`), not under pytest-xdist: one sends
# SIGTERM to its own process, which a pytest-xdist worker connected to a Ray cluster takes through
# Ray's handler and dies of. .ci/test runs that process beside the pytest-xdist part: each test
# stops only the Ray processes it started, and the other Ray runs of the suite (docs/production.md's
# blocks, tests/ops/test_plugin.py) do the same.
pytestmark = [pytest.mark.slow, pytest.mark.ray]


def stop_session(sid: int, timeout: float = 30) -> None:
    """SIGKILL every process of the session until none of them runs (a zombie left for init to
    reap runs nothing). Ray puts each worker in a process group of its own, not in a session."""
    deadline = time.monotonic() + timeout
    while True:
        running = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
                if int(fields[3]) == sid and fields[0] != "Z":
                    running.append(int(stat.parent.name))
                    os.kill(int(stat.parent.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):  # ended meanwhile
                continue
        if not running:
            return
        assert time.monotonic() < deadline, f"processes {running} of session {sid} outlive SIGKILL"
        time.sleep(0.1)


# Six chunks of 8 rows over two actors: the driver is killed once three shards are written, with
# chunks still to run; three chunks of 16 for the rest. (100 rows each took 108 s and 74 s of the
# suite's wall time beside the other tests, and proved nothing more.)
ROWS_KILLED, ROWS_MANY = 48, 48


def rows(n: int) -> list[dict]:
    words = ["red", "green", "blue", "small", "large", "quiet", "bright"]
    return [{"id": f"r{i}", "text": f"Row {i} is {' '.join(words[: 1 + i % len(words)])}."} for i in range(n)]


# -- before the shared cluster starts: the bad voice's test asserts that no cluster is up in this
# process, and the two-node test starts a cluster of its own in it
def test_a_bad_voice_is_a_usage_error_before_the_cluster_starts(tmp_path):
    from cosybatch.errors import VoiceError

    corpus = write_parquet(tmp_path / "c.parquet", rows(1))
    with pytest.raises(VoiceError, match="no-such-voice"):
        ray_run(RunConfig.from_options(corpus=corpus, out=tmp_path / "out", voice="no-such-voice"),
                RayOptions(actors=1))
    assert not ray.is_initialized()


def test_a_retried_chunk_rewrites_the_same_shard(tmp_path):
    """Ray retries a chunk whose actor died; the retry must not add a second copy of its rows."""
    from cosybatch.store.checkpoint import OutputDir

    corpus = write_parquet(tmp_path / "c.parquet", rows(3))
    cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "out", progress="none")
    OutputDir(cfg.output.folder).state.mkdir(parents=True)
    worker = SynthWorker(cfg, "cpu")
    chunk = [Row(i, r["id"], r["text"]) for i, r in enumerate(rows(3))]
    first = worker.process(chunk)
    second = worker.process(list(reversed(chunk)))
    assert first["items"][0]["shard"] == second["items"][0]["shard"]
    assert len(list(cfg.output.folder.glob("shard-*.tar"))) == 1
    assert sorted(read_output(cfg.output.folder)) == ["r0", "r1", "r2"]


def test_options_ray_run_cannot_honour_are_refused(tmp_path):
    from cosybatch.errors import UsageError

    corpus = write_parquet(tmp_path / "c.parquet", rows(1))
    with pytest.raises(UsageError, match="ray-run does not support metrics_file"):
        ray_run(RunConfig.from_options(corpus=corpus, out=tmp_path / "o", metrics_file=tmp_path / "m.prom"),
                RayOptions())


def test_ray_run_on_two_nodes_writes_to_s3_each_actor_uploading_its_shards(s3, tmp_path, monkeypatch):
    """Two Ray nodes (ray.cluster_utils.Cluster, one actor CPU each, so the two actors sit on two
    nodes) and a store holding the corpus (three parts) and the dataset: each actor uploads its
    chunk's shard; the driver's staging folder never holds one; a rerun from an empty staging
    folder adds nothing; the store's manifest lists every id once and each is in the shard it
    names."""
    import pyarrow.parquet as pq
    from helpers import S3_ENV, download_prefix, s3_fs
    from ray.cluster_utils import Cluster

    # Before the nodes start: their workers inherit it. Worker niceness 0, as ray-run's own local
    # cluster has it: at Ray's default (15) the actors starved beside the rest of the suite (285 s).
    for key, value in {**S3_ENV, "AWS_ENDPOINT_URL": s3.endpoint, "RAY_worker_niceness": "0"}.items():
        monkeypatch.setenv(key, value)
    fs = s3_fs(s3.endpoint)
    data = rows(24)
    for part in range(3):  # the corpus in the store too, as JSONL parts
        with fs.open_output_stream(f"{s3.bucket}/corpus/part-{part}.jsonl", compression=None) as f:
            f.write("".join(json.dumps(r) + "\n" for r in data[part * 8:(part + 1) * 8]).encode())
    corpus = f"s3://{s3.bucket}/corpus/"
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        cfg = RunConfig.from_options(corpus=corpus, out=f"s3://{s3.bucket}/ray", staging=tmp_path / "driver",
                                     progress="none")
        result = ray_run(cfg, RayOptions(address=nodes.address, actors=2, rows_per_task=4))
        assert result.status == "complete" and result.stats["items_done"] == 24
        assert result.stats["out"] == f"s3://{s3.bucket}/ray"
        assert not list((tmp_path / "driver").rglob("shard-*"))
        again = ray_run(cfg.with_options(out=f"s3://{s3.bucket}/ray", staging=tmp_path / "other-driver"),
                        RayOptions(address=nodes.address, actors=2, rows_per_task=4))
        assert again.status == "complete" and again.stats["items_done"] == 0
        assert again.stats["job_totals"]["items_done"] == 24
        from cosybatch.store.objects import job_view
        from cosybatch.store.status import job_status

        with job_view(f"s3://{s3.bucket}/ray", folder=tmp_path / "view") as view:  # `cosybatch status s3://...`
            status = job_status(view)
        assert (status["status"], status["done"], status["failed"]) == ("complete", 24, 0)
        assert not list((tmp_path / "view").glob("shard-*"))  # from the shards' records, no shard fetched
    finally:
        ray.shutdown()
        nodes.shutdown()
    dest = tmp_path / "read"
    download_prefix(fs, f"{s3.bucket}/ray", dest)
    manifest = pq.read_table(dest / "manifest.parquet").to_pylist()
    assert sorted(m["id"] for m in manifest) == sorted(r["id"] for r in data)
    shards = {m["shard"] for m in manifest}
    assert len(shards) == 6 and shards == {p.name for p in dest.glob("shard-*.tar")}
    found = read_output(dest)
    assert sorted(found) == sorted(r["id"] for r in data)
    assert all(found[m["id"]]["shard"] == m["shard"] for m in manifest)


# -- in process on one shared cluster ----------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the in-process ray_run tests below. ray_run uses a cluster that is
    running (and leaves it running), so its start-up and shutdown, seconds apiece, are paid once
    for the module. It is started as ray_run starts its own (a CPU beyond two actors for Ray Data's
    reads, worker niceness 0), but as `ray start` starts one: it becomes the machine's current
    cluster, which `ray.init()` without an address would join. So a `ray-run` without --address
    started meanwhile (the killed driver's below, the docs' and the plugin's in other test
    processes) shows that it starts a cluster of its own all the same, as its docs say."""
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_worker_niceness", "0")
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": max(os.cpu_count() or 1, 3),
                                                           "include_dashboard": False})
    ray.init(address=nodes.address, log_to_driver=False, logging_level=logging.WARNING, configure_logging=False)
    yield
    ray.shutdown()
    nodes.shutdown()


def test_killed_driver_then_rerun_completes_exactly_once(cluster, tmp_path):
    data = rows(ROWS_KILLED)
    corpus = write_parquet(tmp_path / "c.parquet", data)
    out = tmp_path / "out"
    # The killed driver starts a local cluster of its own (not the module's, although that one is
    # the machine's current cluster), in a session of its own: the cluster it starts (GCS, raylet,
    # agents, actors) is in the driver's session, so it can be stopped without `ray stop --force`,
    # which would stop every Ray process on the machine, those of other tests included. The rerun
    # joins the module's shared cluster (a second cluster start would add seconds of CPU and test
    # nothing more).
    proc = subprocess.Popen([sys.executable, "-m", "cosybatch", "ray-run", str(corpus), "--out", str(out),
                             "--actors", "2", "--rows-per-task", "8", "--progress", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while len(list(out.glob("shard-*.tar"))) < 3:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stop_session(proc.pid)  # what is left of the killed driver's cluster
    finished_before = len(read_output(out))
    assert 0 < finished_before < ROWS_KILLED

    result = ray_run(RunConfig.from_options(corpus=corpus, out=out, progress="none"), RayOptions(actors=2,
                                                                                                 rows_per_task=8))
    assert result.status == "complete"
    assert result.stats["items_done"] == ROWS_KILLED - finished_before  # finished shards were not redone
    items = read_output(out)  # raises if any id is in two shards
    assert sorted(items) == sorted(r["id"] for r in data)


def test_every_id_once_and_same_bytes_as_run(cluster, tmp_path):
    data = rows(ROWS_MANY)
    corpus = write_parquet(tmp_path / "c.parquet", data)
    result = ray_run(RunConfig.from_options(corpus=corpus, out=tmp_path / "ray", progress="none"),
                     RayOptions(actors=2, rows_per_task=16))
    assert result.status == "complete" and result.stats["items_done"] == ROWS_MANY
    items = read_output(tmp_path / "ray")
    from cosybatch.store.status import job_status

    status = job_status(tmp_path / "ray")
    assert (status["status"], status["done"], status["failed"]) == ("complete", ROWS_MANY, 0)
    assert sorted(items) == sorted(r["id"] for r in data)
    assert not list((tmp_path / "ray").glob("*.partial"))

    import pyarrow.parquet as pq
    import webdataset as wds

    manifest = pq.read_table(tmp_path / "ray" / "manifest.parquet").to_pylist()
    assert sorted(m["id"] for m in manifest) == sorted(items)
    # The quality signals of each clip, measured in its actor, are the manifest's qc columns.
    assert result.stats["qc"]["measured"] == ROWS_MANY
    assert {m["id"]: m["qc_speech_share"] for m in manifest} == \
        {i: item["meta"]["qc"]["signals"]["speech_share"] for i, item in items.items()}
    shards = sorted(str(p) for p in (tmp_path / "ray").glob("shard-*.tar"))
    assert sum(1 for _ in wds.WebDataset(shards, shardshuffle=False)) == ROWS_MANY

    # The same rows through `cosybatch run`: per-item seeded noise makes the audio identical.
    run(RunConfig.from_options(corpus=corpus, out=tmp_path / "local", limit=12, progress="none"))
    local = read_output(tmp_path / "local")
    for item_id, item in local.items():
        assert (items[item_id]["audio"] == item["audio"]).all()
        assert items[item_id]["meta"]["text"] == item["meta"]["text"]


def test_jsonl_with_unicode_line_breaks_inside_rows(cluster, tmp_path):
    """U+0085 and U+2028 are line breaks to str.splitlines; inside JSON strings they are text."""
    import json

    lines = [{"id": "a", "text": "Åse went home."}, {"id": "b", "text": "One\u2028two."}, {"text": "x", "id": "c"}]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines), encoding="utf-8")
    result = ray_run(RunConfig.from_options(corpus=corpus, out=tmp_path / "out", progress="none"), RayOptions(actors=1))
    items = read_output(tmp_path / "out")
    assert set(items) == {"a", "b", "c"} and result.stats["items_failed"] == 0
    assert [items[k]["meta"]["row"] for k in "abc"] == [0, 1, 2]


def test_cosyvoice_batches_as_run_does_and_sounds_the_same(cluster, tmp_path, cosyvoice_dir, monkeypatch):
    """One executor: ray-run's actors size batches from the engine exactly as `run` does, and the
    driver never opens an engine (on a GPU it would start CUDA and pre-allocate the pool)."""
    from cosybatch.run import executor

    texts = ["Hello there.", "A somewhat longer sentence for the model.", "Yes.", "Good morning to you all.",
             "The rain stopped at noon.", "No.", "Bright lights, big city.", "Thanks a lot."]
    corpus = write_parquet(tmp_path / "c.parquet", [{"id": f"c{i}", "text": t} for i, t in enumerate(texts)])
    cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "local", engine="cosyvoice", device="cpu", batch_size=3,
                    engine_options={"model": cosyvoice_dir, "speaker": "alice"}, normalize=False, progress="none")
    local = run(cfg)

    def refuse(*args, **kwargs):
        raise AssertionError("the driver opened an engine")

    monkeypatch.setattr(executor, "open_engine", refuse)  # actors are other processes: unaffected
    remote = ray_run(RunConfig.from_options(**{**cfg.options(), "out": tmp_path / "ray"}), RayOptions(actors=1,
                                                                                                      rows_per_task=64))
    assert remote.status == local.status == "complete"
    assert remote.stats["batch_sizes"] == local.stats["batch_sizes"] and max(map(int, local.stats["batch_sizes"])) == 3
    assert (remote.stats["batch_size_limit"], remote.stats["batch_budget"]) == \
        (local.stats["batch_size_limit"], local.stats["batch_budget"])
    a, b = read_output(tmp_path / "local"), read_output(tmp_path / "ray")
    assert sorted(a) == sorted(b) == sorted(f"c{i}" for i in range(len(texts)))
    for item_id in a:
        assert (a[item_id]["audio"] == b[item_id]["audio"]).all()


def test_ray_run_sigterm_mid_way_is_interrupted_and_after_the_last_chunk_is_complete(cluster, tmp_path, monkeypatch):
    """SIGTERM is sent from inside the driver at a known point: once when the first chunk comes
    back (rows are still unread: interrupted, exit 4), then, on the rerun, once every chunk has
    been dispatched and has finished (nothing was cut short: complete, exit 0)."""
    import logging
    import signal

    pytest.importorskip("ray")
    from helpers import read_output

    from cosybatch.run import job as job_module
    from cosybatch.run.ray import RayOptions, ray_run

    handled = []

    class Seen(logging.Handler):
        def emit(self, record):
            if "finishing the chunks in flight" in record.getMessage():
                handled.append(record)

    def sigterm_and_wait_until_handled():
        before = len(handled)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while len(handled) == before:  # the driver's handler runs on this (the main) thread
            assert time.monotonic() < deadline, "the SIGTERM handler never ran"
            time.sleep(0.01)

    when = {"point": "first chunk"}

    class Progress(job_module.Progress):
        def update(self, items, audio_s):
            super().update(items, audio_s)
            if when["point"] == "first chunk":
                when["point"] = None
                sigterm_and_wait_until_handled()

        def close(self):
            super().close()
            if when["point"] == "all finished":
                when["point"] = None
                sigterm_and_wait_until_handled()

    seen = Seen()
    logging.getLogger("cosybatch").addHandler(seen)
    monkeypatch.setattr(job_module, "Progress", Progress)
    data = [{"id": f"r{i}", "text": f"Row {i} is here."} for i in range(24)]
    corpus = write_parquet(tmp_path / "c.parquet", data)
    cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "out", progress="none")
    try:
        first = ray_run(cfg, RayOptions(actors=1, rows_per_task=4))
        assert (first.status, first.exit_code) == ("interrupted", 4)
        assert 0 < len(read_output(cfg.output.folder)) < len(data)

        when["point"] = "all finished"
        second = ray_run(cfg, RayOptions(actors=1, rows_per_task=4))
        assert when["point"] is None and len(handled) == 2  # the SIGTERM did come, after the last chunk
        assert (second.status, second.exit_code) == ("complete", 0)
    finally:
        logging.getLogger("cosybatch").removeHandler(seen)
    assert sorted(read_output(cfg.output.folder)) == sorted(r["id"] for r in data)
    assert json.loads((cfg.output.folder / "stats.json").read_text())["status"] == "complete"
    handler = signal.getsignal(signal.SIGTERM)  # Ray's own, or the default: not the finished run's
    assert not getattr(handler, "__qualname__", "").startswith("ray_run.")


def test_the_quality_gate_runs_in_the_actors_as_in_run(cluster, tmp_path):
    """The same gate in ray-run: each chunk's rows measured, retaken and failed in its actor, the
    counts summed by the driver, the QC columns in the manifest."""
    data = rows(6)
    corpus = write_parquet(tmp_path / "c.parquet", data)
    cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "gated", progress="none", qc="gate", qc_retries=1,
                    qc_limits={"min_speech_share": 0.999})  # no clip is that full of speech
    gated = ray_run(cfg, RayOptions(actors=2, rows_per_task=3))
    assert (gated.stats["items_done"], gated.stats["items_failed"]) == (0, 6)
    failures = [json.loads(line) for line in (tmp_path / "gated" / "failures.jsonl").read_text().splitlines()]
    assert sorted(f["id"] for f in failures) == sorted(r["id"] for r in data)
    assert {f["reason"] for f in failures} == {"qc: low_speech after 2 attempts"}
    assert (gated.stats["qc"]["retries"], gated.stats["qc"]["failed"]) == (6, 6)


@pytest.mark.parametrize("options", [{"num_gpus": float("nan")}, {"num_cpus": float("nan")}, {"num_gpus": -1},
                                     {"num_cpus": float("inf")}, {"actors": 10**9}])
def test_ray_options_are_finite_and_bounded(options):
    from cosybatch.errors import UsageError

    with pytest.raises(UsageError, match=r"--num-gpus|--actors"):
        RayOptions(**options)
