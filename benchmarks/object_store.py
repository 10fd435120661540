"""What writing a dataset to object storage (`--out s3://BUCKET/PREFIX`, cosybatch/store/objects.py)
costs, against a local moto S3 server that this script starts on a free loopback port (moto_server
from the venv; nothing leaves the machine). Three measurements, each chosen with --only:

upload   `cosybatch run examples/corpus.jsonl` (Piper, the default engine; --threads 1, --progress
         none, --shard-max-items 20: six shards, so uploads overlap with synthesis) into a local
         folder and into s3://bench/upload-N with a fresh --staging, the two taking turns within
         every round (the order rotating), as whole processes. Prints the median wall time, the
         ratio s3 / folder of the medians and the median of the per-round ratios (goal: at most
         1.05), and the runs' own stats.json wall_seconds and write stage.

resume   a store job of --shards committed shards (one tiny item each), built directly in the
         store as ObjectSink leaves it when killed after its last commit (shard-NNNNNN.tar objects
         in ShardWriter's tar layout; one commit segment per shard holding its `items` and `closed`
         lines, the first of them in one checkpoint upto-N.jsonl as one is written every
         CHECKPOINT_EVERY commits, the rest as .cosybatch/commits/NNNNNNNN.jsonl; the job.json of a
         real `cosybatch run --engine tone` of the same 10,000-row corpus). Then, in a fresh
         interpreter, from an empty staging folder:
         ObjectSink(Store(uri), OutputDir(staging), lease_s=2).open(restart=False), then repair()
         and resume_state() as LocalRunner.resume calls them; the time of each part (store check,
         lease, listings, segment reads, journal replays) is printed. Also a whole rerun,
         `cosybatch run CORPUS --engine tone --out s3://... --qc off` (--rerun-qc signals: with the
         quality gate's report, whose clips are read by range), which must find every row done
         (items_done 0). Goal: the open under 10 s.

parts    peak RSS of `cosybatch run FOLDER --engine tone --qc off` (the test plugin's engine: pip
         install ./tests/plugin) on the same --part-rows rows as 10 Parquet parts and as 1,000
         (and, with --parts-store, 1,000 parts read from s3://bench/parts/), each run in a fresh
         wrapper process that reads getrusage(RUSAGE_CHILDREN); the ratio 1,000 / 10 should be
         about 1.

On these 2-core shared machines whole-process times vary by several per cent from run to run:
compare the ratios measured side by side, not the absolute times.

    python benchmarks/object_store.py                              # all three, defaults
    python benchmarks/object_store.py --only upload --rounds 5
    python benchmarks/object_store.py --only resume --shards 10000 --json /tmp/object_store.json
    python benchmarks/object_store.py --only parts --parts-store
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import ROOT, Report, alternate, cli, median, parse, table, write_corpus

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "bench"
PARTS = ("upload", "resume", "parts")

# Runs in a fresh interpreter: the open of a store job from an empty staging folder, as a rerun
# does it, with the time of each step. argv: URI, staging folder, expected items.
OPEN_TIMER = r"""
import collections, json, sys, time
t0 = time.perf_counter()
from pathlib import Path
import cosybatch.store.objects as o
import cosybatch.store.checkpoint as c
import cosybatch.store.repair as r
import_s = time.perf_counter() - t0
spent, calls = collections.defaultdict(float), collections.Counter()

def timed(owner, name, label, kind=None):
    fn = getattr(owner, name)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a[1:], **k) if kind == "classmethod" else fn(*a, **k)
        finally:
            spent[label] += time.perf_counter() - t
            calls[label] += 1
    setattr(owner, name, classmethod(wrapper) if kind == "classmethod" else wrapper)

timed(o.Store, "check", "store.check (bucket, HEAD job.json)")
timed(o.Lease, "acquire", "lease.acquire (incl. read-back sleep)")
timed(o, "journal_objects", "journal_objects() (which objects hold the journal)")
timed(o, "store_journal", "store_journal() (GET the checkpoint and the segments after it, 32 threads)")
timed(o.Store, "list", "Store.list, all calls")
timed(o.Store, "read", "Store.read, all calls (summed over threads)")
timed(o, "stored_shards", "stored_shards() (parse journal)")
timed(c.Ledger, "replay", "Ledger.replay, all calls", "classmethod")
uri, staging, expected = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
t = time.perf_counter()
sink = o.ObjectSink(o.Store(uri), c.OutputDir(staging), lease_s=2)
sink.open(restart=False)
open_s = time.perf_counter() - t
t = time.perf_counter()
journal = c.Journal(sink.out.journal_path)
report = r.repair(sink.out, journal)
repair_s = time.perf_counter() - t
t = time.perf_counter()
state = sink.out.resume_state(report.ledger)
resume_state_s = time.perf_counter() - t
journal.close()
total_s = open_s + repair_s + resume_state_s
t = time.perf_counter()
sink.close()
close_s = time.perf_counter() - t
assert not report.notes and state.items == expected, (report.notes[:3], state.items, expected)
print(json.dumps({"import_s": import_s, "open_s": open_s, "repair_s": repair_s, "resume_state_s": resume_state_s,
                  "total_s": total_s, "close_s": close_s, "items": state.items, "segments": sink.segments,
                  "journal_bytes": sink.out.journal_path.stat().st_size,
                  "steps": {k: {"s": round(v, 4), "calls": calls[k]} for k, v in spent.items()}}))
"""

# A wrapper process: runs argv, prints the child's peak RSS (KiB on Linux) and its wall time.
RSS_WRAPPER = r"""
import json, resource, subprocess, sys, time
t = time.perf_counter()
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.perf_counter() - t
if proc.returncode:
    sys.stderr.write(proc.stderr[-4000:]); sys.exit(proc.returncode)
print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "wall_s": wall,
                  "summary": json.loads(proc.stdout.strip().splitlines()[-1])}))
"""


# -- the S3 server ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's standalone S3 server on a free loopback port, with the bucket `bench`."""

    def __init__(self, log: Path):
        exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
        if exe is None:
            raise SystemExit("moto_server is missing: pip install -e '.[test]' (it holds moto[server])")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"moto_server exited: {log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("moto_server did not open its port in 60 s") from None
                time.sleep(0.05)
        self.env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": self.endpoint}
        os.environ.update(S3_ENV, AWS_ENDPOINT_URL=self.endpoint)  # this process's own Store() calls
        self.fs().create_dir(BUCKET)

    def fs(self):
        from pyarrow import fs as pafs

        return pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{self.port}", scheme="http", access_key="testing",
                                 secret_key="testing", region="us-east-1", allow_bucket_creation=True)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def cosybatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "cosybatch", "run", *args, "--progress", "none"]


def run_cli(cmd: list[str], env: dict) -> tuple[float, dict]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


# -- 1. upload overhead -----------------------------------------------------------------------------
def upload_overhead(server: MotoServer, tmp: Path, args) -> dict:
    corpus = ROOT / "examples" / "corpus.jsonl"
    common = ["--threads", str(args.threads), "--shard-max-items", str(args.shard_max_items)]
    own: dict[str, dict] = {"folder": {}, "s3": {}}

    def read_stats(name: str, rnd: int, path: Path) -> dict:
        stats = json.loads(path.read_text())
        for key in ("wall_seconds", "write"):
            value = stats["wall_seconds"] if key == "wall_seconds" else stats["stage_seconds"]["write"]
            own[name].setdefault(key, []).append(value)
        return stats

    def folder(rnd: int) -> dict:
        out = tmp / f"folder-{rnd}"
        wall, summary = run_cli(cosybatch(str(corpus), "--out", str(out), *common), server.env)
        stats = read_stats("folder", rnd, out / "stats.json")
        shards = len(list(out.glob("shard-*.tar")))
        shutil.rmtree(out)
        print(f"round {rnd} folder {wall:6.1f} s  ({stats['wall_seconds']:.1f} s in stats.json, {shards} shards, "
              f"{summary['items_done']} items)", flush=True)
        return {"wall_s": wall}

    def s3(rnd: int) -> dict:
        uri, staging = f"s3://{BUCKET}/upload-{rnd}", tmp / f"staging-{rnd}"
        wall, summary = run_cli(cosybatch(str(corpus), "--out", uri, "--staging", str(staging), "--lease",
                                          str(args.lease), *common), server.env)
        stats_path = tmp / f"stats-{rnd}.json"
        stats_path.write_bytes(_get(server, f"{BUCKET}/upload-{rnd}/stats.json"))
        stats = read_stats("s3", rnd, stats_path)
        from pyarrow import fs as pafs

        listed = [i.path for i in server.fs().get_file_info(pafs.FileSelector(f"{BUCKET}/upload-{rnd}",
                                                                              recursive=True))]
        shards = sum(1 for p in listed if p.rsplit("/", 1)[-1].startswith("shard-"))
        segments = sum(1 for p in listed if "/commits/" in p)
        shutil.rmtree(staging)
        print(f"round {rnd} s3     {wall:6.1f} s  ({stats['wall_seconds']:.1f} s in stats.json, {shards} shards, "
              f"{segments} commit objects, {summary['items_done']} items)", flush=True)
        return {"wall_s": wall}

    runs = alternate({"folder": folder, "s3": s3}, args.rounds, baseline="folder")
    result = runs.as_dict()
    for name in ("folder", "s3"):
        result["variants"][name]["stats_wall_seconds"] = own[name]["wall_seconds"]
        result["variants"][name]["stats_write_stage_s"] = own[name]["write"]
    result["ratio_s3_to_folder"] = round(runs.ratio("s3", "wall_s"), 4)
    result["median_round_ratio"] = round(median(runs.round_ratios("s3", "wall_s")), 4)
    result["stats_wall_ratio"] = round(median(own["s3"]["wall_seconds"]) / median(own["folder"]["wall_seconds"]), 4)
    result["goal_at_most_1.05"] = result["median_round_ratio"] <= 1.05
    result["runs"] = runs
    return result


def _get(server: MotoServer, path: str) -> bytes:
    with server.fs().open_input_stream(path) as f:
        return f.read()


# -- 2. resume open with N committed shards ---------------------------------------------------------
def tar_bytes(members: dict[str, bytes]) -> bytes:
    """A shard as ShardWriter writes it: ustar members, each padded to 512 B, then end-of-archive."""
    out = bytearray()
    for name, data in members.items():
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        out += info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict") + data + b"\0" * ((-len(data)) % 512)
    return bytes(out + b"\0" * 1024)


def build_store_job(server: MotoServer, tmp: Path, shards: int, prefix: str) -> tuple[Path, dict]:
    """A corpus of `shards` rows and a store job under `prefix` that has committed every row, one
    shard each. The job.json (and the item record's fields) come from a real tone run of the same
    corpus into a local folder, stopped after a moment."""
    import numpy as np

    from cosybatch.store.audio import encode
    from cosybatch.store.objects import COMMITS, Store
    from cosybatch.store.shards import item_key, pcm16, shard_name

    corpus = write_corpus([f"Sentence number {i} of the synthetic corpus." for i in range(shards)],
                          tmp / "resume-corpus.parquet")
    seed = tmp / "seed-run"
    proc = subprocess.run(cosybatch(str(corpus), "--engine", "tone", "--out", str(seed), "--max-runtime", "1"),
                          capture_output=True, text=True, env=server.env, cwd=ROOT)
    if proc.returncode not in (0, 4):
        raise SystemExit(f"the seed run failed:\n{proc.stderr[-4000:]}")
    job = (seed / ".cosybatch" / "job.json").read_bytes()
    template = next(json.loads(line) for line in (seed / ".cosybatch" / "journal.jsonl").read_text().splitlines()
                    if '"t":"items"' in line)["items"][0]
    shutil.rmtree(seed)
    audio = np.random.default_rng(0).uniform(-0.5, 0.5, 160).astype(np.float32)
    wav = encode(pcm16(audio), 16000)
    digest = hashlib.sha256(wav).hexdigest()
    store = Store(f"s3://{BUCKET}/{prefix}")
    store.write(".cosybatch/job.json", job)

    def one(k: int) -> None:
        item_id = f"s{k:05d}"  # write_corpus's ids
        key = item_key(item_id)
        text = f"Sentence number {k} of the synthetic corpus."
        meta = {"id": item_id, "text": text, "duration": 0.01, "sample_rate": 16000, "num_samples": 160,
                "voice": template["voice"], "engine": "tone", "seed": 0, "row": k, "wav_sha256": digest}
        data = tar_bytes({f"{key}.wav": wav, f"{key}.json": json.dumps(meta).encode()})
        record = {**template, "id": item_id, "key": key, "row": k, "text": text, "duration_s": 0.01,
                  "num_samples": 160, "sample_rate": 16000, "wav_sha256": digest}
        segment = (json.dumps({"t": "items", "ts": round(time.time(), 3), "shard": k, "end": len(data) - 1024,
                               "items": [record]}, separators=(",", ":")) + "\n"
                   + json.dumps({"t": "closed", "shard": k, "items": 1}, separators=(",", ":")) + "\n")
        store.write(shard_name(k), data)
        return segment.encode()

    t = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        segments = list(pool.map(one, range(shards)))
    # As a run killed after its last commit leaves it: a checkpoint every CHECKPOINT_EVERY commits,
    # and the segments after the newest one.
    every = args_checkpoint_every()
    cut = shards - shards % every
    if cut:
        store.write(f"{COMMITS}/upto-{cut:08d}.jsonl", b"".join(segments[:cut]))
    for k in range(cut, shards):
        store.write(f"{COMMITS}/{k:08d}.jsonl", segments[k])
    listed = store.list()
    built = {"build_s": round(time.perf_counter() - t, 1), "objects": len(listed),
             "bytes": sum(listed.values()), "checkpoint_upto": cut, "segments_after": shards - cut}
    return corpus, built


def args_checkpoint_every() -> int:
    from cosybatch.store.objects import CHECKPOINT_EVERY

    return CHECKPOINT_EVERY


def resume_open(server: MotoServer, tmp: Path, args) -> dict:
    prefix = f"resume-{args.shards}"
    print(f"building a store job of {args.shards} committed shards ...", flush=True)
    corpus, built = build_store_job(server, tmp, args.shards, prefix)
    print(f"built {built['objects']} objects ({built['bytes'] / 1e6:.1f} MB) in {built['build_s']} s", flush=True)
    uri = f"s3://{BUCKET}/{prefix}"
    opens = []
    for rnd in range(args.resume_rounds):
        staging = tmp / f"resume-staging-{rnd}"
        proc = subprocess.run([sys.executable, "-c", OPEN_TIMER, uri, str(staging), str(args.shards)],
                              capture_output=True, text=True, env={**server.env, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(f"the open timing failed:\n{proc.stderr[-4000:]}")
        opens.append(json.loads(proc.stdout.splitlines()[-1]))
        shutil.rmtree(staging)
        print(f"open {rnd}: {opens[-1]['total_s']:.2f} s (open {opens[-1]['open_s']:.2f}, repair "
              f"{opens[-1]['repair_s']:.2f}, resume_state {opens[-1]['resume_state_s']:.2f})", flush=True)
    reruns = []
    for rnd in range(args.rerun_rounds):
        staging = tmp / f"rerun-staging-{rnd}"
        wall, summary = run_cli(cosybatch(str(corpus), "--engine", "tone", "--out", uri, "--staging", str(staging),
                                          "--lease", "2", "--qc", args.rerun_qc), server.env)
        if summary["items_done"] != 0 or summary["job_totals"]["items_done"] != args.shards:
            raise SystemExit(f"the rerun did not find every row done: {summary}")
        shutil.rmtree(staging)
        reruns.append(wall)
        print(f"rerun {rnd}: {wall:.2f} s (items_done {summary['items_done']}, job_totals.items_done "
              f"{summary['job_totals']['items_done']})", flush=True)
    best = min(opens, key=lambda o: o["total_s"])
    return {"shards": args.shards, "build": built, "opens": opens, "best": best,
            "open_total_s_median": round(median([o["total_s"] for o in opens]), 3),
            "rerun_wall_s": [round(w, 2) for w in reruns], "rerun_qc": args.rerun_qc,
            "goal_open_under_10s": best["total_s"] < 10}


# -- 3. peak memory against the number of parts -----------------------------------------------------
def parts_memory(server: MotoServer, tmp: Path, args) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = args.part_rows
    if rows < 1000:
        raise SystemExit("--part-rows: at least 1000, one row or more in each of 1,000 parts")
    layouts = {"10 parts": 10, "1000 parts": 1000}
    folders = {}
    for name, n in layouts.items():
        folder = tmp / f"parts-{n}"
        folder.mkdir()
        for p in range(n):
            ids = range(p * rows // n, (p + 1) * rows // n)
            pq.write_table(pa.table({"id": [f"r{i:06d}" for i in ids],
                                     "text": [f"Row {i} of a corpus read in parts." for i in ids]}),
                           folder / f"part-{p:05d}.parquet")
        folders[name] = str(folder)
    if args.parts_store:
        fs = server.fs()
        src = Path(folders["1000 parts"])

        def put(path: Path) -> None:
            with fs.open_output_stream(f"{BUCKET}/parts/{path.name}") as f:
                f.write(path.read_bytes())

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, sorted(src.glob("*.parquet"))))
        folders["1000 parts s3"] = f"s3://{BUCKET}/parts/"

    def variant(name: str):
        def once(rnd: int) -> dict:
            out = tmp / f"parts-out-{rnd}-{name.replace(' ', '-')}"
            cmd = [sys.executable, "-c", RSS_WRAPPER, *cosybatch(folders[name], "--engine", "tone", "--out", str(out),
                                                                  "--qc", "off")]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=server.env, cwd=ROOT)
            if proc.returncode:
                raise SystemExit(f"{name}: {proc.stderr[-4000:]}")
            got = json.loads(proc.stdout.splitlines()[-1])
            shutil.rmtree(out)
            if got["summary"]["items_done"] != rows:
                raise SystemExit(f"{name}: {got['summary']}")
            print(f"round {rnd} {name:13s} peak RSS {got['maxrss_kib'] / 1024:7.1f} MiB  wall {got['wall_s']:.1f} s",
                  flush=True)
            return {"peak_rss_mib": got["maxrss_kib"] / 1024, "wall_s": got["wall_s"]}
        return once

    runs = alternate({name: variant(name) for name in folders}, args.parts_rounds, baseline="10 parts")
    result = runs.as_dict()
    result["rows"] = rows
    result["rss_ratio_1000_to_10"] = round(runs.ratio("1000 parts", "peak_rss_mib"), 4)
    result["runs"] = runs
    return result


def main() -> None:
    ap = cli(__doc__, rounds=3, threads=1,
             helps={"rounds": "rounds of the upload measurement (folder and s3 taking turns)",
                    "threads": "--threads of the upload measurement's `cosybatch run`"})
    ap.add_argument("--only", default=",".join(PARTS),
                    help="comma-separated measurements to run: upload, resume, parts")
    ap.add_argument("--shard-max-items", type=int, default=20, help="--shard-max-items of the upload measurement")
    ap.add_argument("--lease", type=float, default=60.0, help="--lease of the upload measurement's s3 runs")
    ap.add_argument("--shards", type=int, default=10_000, help="committed shards in the resume measurement's store job")
    ap.add_argument("--resume-rounds", type=int, default=1, help="timed opens of the store job (fresh interpreters)")
    ap.add_argument("--rerun-rounds", type=int, default=1,
                    help="whole `cosybatch run` reruns of the store job (0: only the open is timed)")
    ap.add_argument("--rerun-qc", default="off",
                    help="--qc of the whole rerun (signals, the default of `cosybatch run`: the end of a complete "
                         "run fetches every shard back from the store for report.html)")
    ap.add_argument("--part-rows", type=int, default=2000, help="rows of the parts measurement's corpus")
    ap.add_argument("--parts-rounds", type=int, default=1, help="rounds of the parts measurement")
    ap.add_argument("--parts-store", action="store_true",
                    help="also read the 1,000 parts from the S3 server (s3://bench/parts/)")
    args = parse(ap)
    chosen = [p for p in args.only.split(",") if p]
    if unknown := set(chosen) - set(PARTS):
        raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}")

    result: dict = {"benchmark": "object_store", "load_at_start": os.getloadavg(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="object-store-") as tmp_name:
        tmp = Path(tmp_name)
        server = MotoServer(tmp / "moto.log")
        try:
            if "upload" in chosen:
                result["upload"] = upload_overhead(server, tmp, args)
            if "resume" in chosen:
                result["resume"] = resume_open(server, tmp, args)
            if "parts" in chosen:
                result["parts"] = parts_memory(server, tmp, args)
        finally:
            server.close()
    result["load_at_end"] = os.getloadavg()
    upload_runs = result.get("upload", {}).pop("runs", None)
    parts_runs = result.get("parts", {}).pop("runs", None)

    def show() -> None:
        print(f"\nload average at start {result['load_at_start']}, at end {result['load_at_end']} "
              f"({result['cpus']} CPUs)")
        if upload_runs is not None:
            u = result["upload"]
            print(f"\n1. upload overhead: cosybatch run examples/corpus.jsonl (piper), {args.rounds} rounds, "
                  f"--shard-max-items {args.shard_max_items}")
            table(["variant", "median wall s", "min..max", "wall / folder", "per-round", "stats wall s",
                   "write stage s"],
                  [[n, f"{upload_runs.median(n, 'wall_s'):.2f}", upload_runs.cell(n, "wall_s", ".2f", "range"),
                    f"{upload_runs.ratio(n, 'wall_s'):.3f}", f"{median(upload_runs.round_ratios(n, 'wall_s')):.3f}",
                    f"{median(u['variants'][n]['stats_wall_seconds']):.2f}",
                    f"{median(u['variants'][n]['stats_write_stage_s']):.2f}"] for n in upload_runs.names])
            print(f"s3 / folder: {u['ratio_s3_to_folder']:.3f} (medians), {u['median_round_ratio']:.3f} "
                  f"(median per-round), {u['stats_wall_ratio']:.3f} (stats.json wall_seconds); goal <= 1.05: "
                  f"{u['goal_at_most_1.05']}")
        if "resume" in result:
            r = result["resume"]
            b = r["best"]
            print(f"\n2. resume open of a store job of {r['shards']} committed shards (empty staging, fresh "
                  f"interpreter; best of {len(r['opens'])})")
            table(["step", "s", "calls"],
                  [["import cosybatch.store.objects", f"{b['import_s']:.2f}", ""],
                   ["ObjectSink.open", f"{b['open_s']:.2f}", "1"],
                   *[[f"  {k}", f"{v['s']:.2f}", v["calls"]] for k, v in b["steps"].items()],
                   ["repair", f"{b['repair_s']:.2f}", "1"],
                   ["resume_state", f"{b['resume_state_s']:.2f}", "1"],
                   ["open + repair + resume_state", f"{b['total_s']:.2f}", ""],
                   ["sink.close (lease release)", f"{b['close_s']:.2f}", ""]], left=(0,))
            print(f"journal {b['journal_bytes'] / 1e6:.1f} MB of {b['segments']} commits, {b['items']} items; "
                  f"goal open < 10 s: {r['goal_open_under_10s']}")
            if r["rerun_wall_s"]:
                print(f"whole rerun (cosybatch run ... --engine tone --qc {args.rerun_qc}, items_done 0): "
                      f"{', '.join(f'{w:.1f}' for w in r['rerun_wall_s'])} s")
        if parts_runs is not None:
            p = result["parts"]
            print(f"\n3. peak RSS of cosybatch run FOLDER --engine tone --qc off, {p['rows']} rows")
            table(["variant", "peak RSS MiB", "vs 10 parts", "wall s"],
                  [[n, f"{parts_runs.median(n, 'peak_rss_mib'):.1f}", f"{parts_runs.ratio(n, 'peak_rss_mib'):.3f}",
                    f"{parts_runs.median(n, 'wall_s'):.1f}"] for n in parts_runs.names])

    Report(args.json, "object_store").emit(result, show)


if __name__ == "__main__":
    main()
