"""GPU memory with the CosyVoice engine at real size (random weights): one prepared run for a lent GPU.

Sections, each in a fresh child process (the allocator backend and the memory fraction are per
process), each bounded by its own time budget:

  (a) flat   reserved memory across --batches batches of mixed sizes and lengths after
             setup_pool(--fraction): min/max reserved, growth after batch 10
  (b) low    --low-fraction with the longest rows (--long-tokens text tokens, batch --long-batch):
             per-stage bytes per padded unit (probe_stage), the budget that fits the pool
             (budget_from_probe), then the batch itself: OOM or not (is_oom), the peak; on OOM the
             batch is halved and retried, to show the process survives
  (c) speed  the same batches in fresh processes with and without the pre-allocated pool (and with
             the native allocator): wall time and ratios

token2wav and end-to-end timings against upstream are in token2wav.py and cosyvoice_e2e.py.
The stop token is disabled, so every row yields exactly 20 speech tokens per text token.

    python benchmarks/gpu_memory.py --dry-run                 # anywhere: parse options, print the plan
    python benchmarks/gpu_memory.py --json out.json           # a GPU: about 7 minutes in all
    python benchmarks/gpu_memory.py --quick                   # a GPU: about 3 minutes
    python benchmarks/gpu_memory.py --device cpu --size tiny --quick   # CPU smoke run of the code paths

The last stdout line is every figure as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from common import Report, cli, parse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cosybatch import gpu  # noqa: E402  (torch-free: children configure the allocator before torch)
from cosybatch.errors import UsageError  # noqa: E402

MiB = 1 << 20
SPEECH_PER_TEXT = 20  # the LM's maximum ratio: with the stop token disabled every row runs to it
SAMPLES_PER_SPEECH_TOKEN = 2 * 480  # 2 mel frames per token, 480 samples per frame
SAMPLE_RATE = 24000
STOP_TOKEN = 6561
LOAD_S = 60  # allowance for a child's start-up and model load, on top of its section budget

# Section budgets in seconds of batch work per child: (full run, --quick).
BUDGETS = {"flat": (140, 50), "low": (80, 50), "speed": (35, 20)}


# -- plans (torch-free, shared by the parent's dry run and the children) -----------------------
Batch = list[tuple[tuple[int, ...], int]]  # rows: (text tokens, seed)


def mixed_batches(n: int, sizes: tuple[int, int], max_tokens: int, seed: int, long_every: int = 0) -> list[Batch]:
    """``n`` batches of random sizes in ``sizes`` and rows of 1..max_tokens text tokens; every
    ``long_every``-th batch allows twice the length (shape variety for the allocator)."""
    rng = random.Random(seed)
    out: list[Batch] = []
    row_seed = 0
    for b in range(n):
        limit = max_tokens * 2 if long_every and b % long_every == long_every - 1 else max_tokens
        batch: Batch = []
        for _ in range(rng.randint(*sizes)):
            length = rng.randint(1, limit)
            batch.append((tuple(rng.randrange(0, 900) for _ in range(length)), row_seed))
            row_seed += 1
        out.append(batch)
    return out


def audio_seconds(batches: list[Batch]) -> float:
    tokens = sum(len(t) for batch in batches for t, _ in batch)
    return tokens * SPEECH_PER_TEXT * SAMPLES_PER_SPEECH_TOKEN / SAMPLE_RATE


def describe(batches: list[Batch]) -> dict:
    rows = [len(t) for batch in batches for t, _ in batch]
    return {
        "batches": len(batches),
        "rows": len(rows),
        "text_tokens": [min(rows, default=0), max(rows, default=0)],
        "batch_sizes": [min((len(b) for b in batches), default=0), max((len(b) for b in batches), default=0)],
        "lm_steps": sum(SPEECH_PER_TEXT * max(len(t) for t, _ in b) for b in batches if b),
        "audio_s": round(audio_seconds(batches), 1),
    }


def section_batches(kind: str, cfg: dict) -> list[Batch]:
    if kind == "flat":
        return mixed_batches(cfg["batches"], (1, 32), cfg["flat_tokens"], cfg["seed"], long_every=10)
    if kind == "speed":
        size = cfg["speed_batch"]
        return mixed_batches(cfg["speed_batches"], (size, size), cfg["speed_tokens"], cfg["seed"] + 1)
    if kind == "low":
        rng = random.Random(cfg["seed"] + 2)
        n = cfg["long_tokens"]
        return [[(tuple(rng.randrange(0, 900) for _ in range(n)), i) for i in range(cfg["long_batch"])]]
    raise ValueError(kind)


# -- child side ---------------------------------------------------------------------------------
class Recorder:
    """A child's results, saved to its file after every step so a timeout still leaves figures."""

    def __init__(self, path: Path, tag: str):
        self.path, self.tag, self.data = path, tag, {"errors": {}, "seconds": {}}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, default=str), encoding="utf-8")
        os.replace(tmp, self.path)

    def say(self, message: str) -> None:
        print(f"[{self.tag}] {message}", flush=True)

    def step(self, name: str, fn: Callable[[], object]) -> object:
        start = time.perf_counter()
        value = None
        try:
            value = fn()
        except Exception as exc:
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"[:1000]
            self.say(f"{name} failed: {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc(limit=4)
        self.data["seconds"][name] = round(time.perf_counter() - start, 3)
        self.save()
        return value


def mib(n: float | None) -> float | None:
    return None if n is None else round(n / MiB, 1)


def child(config_path: Path) -> None:
    cfg = json.loads(config_path.read_text(encoding="utf-8"))
    kind, variant = cfg["kind"], cfg["variant"]
    rec = Recorder(Path(cfg["result"]), f"{kind}/{variant}")
    # Before torch: the backend is fixed when torch's CUDA library loads.
    rec.data["configure_note"] = gpu.configure_allocator()
    rec.data["alloc_conf"] = os.environ.get(gpu.ENV)
    rec.save()
    import torch

    deadline = time.perf_counter() + LOAD_S + cfg["budget_s"]
    cuda = cfg["device"] == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def device_used() -> int | None:
        if not (cuda and torch.cuda.is_initialized()):
            return None
        free, total = torch.cuda.mem_get_info(dev)
        return int(total - free)

    def load():
        from pathlib import Path

        from cosybatch.engines import EngineOptions, open_engine
        from cosybatch.engines.cosyvoice import CosyVoiceOptions

        options = EngineOptions(device=cfg["device"],
                                engine=CosyVoiceOptions(model=Path(cfg["model_dir"]), speaker="alice"))
        engine = open_engine("cosyvoice", None, options)
        with torch.no_grad():
            engine.lm.llm_decoder.bias[STOP_TOKEN:] = -1e4  # fixed work: 20 speech tokens per text token
        sync()
        return engine

    engine = rec.step("load", load)
    if engine is None:
        return
    rec.data["backend"] = rec.step("backend", lambda: torch.cuda.get_allocator_backend() if cuda else "cpu")
    rec.data["after_load"] = {"device_used_mib": mib(device_used()), **gpu.memory_stats(dev if cuda else None)}
    rec.say(f"loaded in {rec.data['seconds']['load']:.1f} s; backend {rec.data['backend']}; "
            f"{gpu.ENV}={rec.data['alloc_conf']}; note {rec.data['configure_note']!r}")

    from cosybatch.cosyvoice.pipeline import Segment
    from cosybatch.engines.cosyvoice.engine import TOKENS_PER_TEXT_TOKEN
    from cosybatch.plan import Unit

    voice = engine.default_voice

    def units(batch: Batch) -> list:
        return [Unit(k, 0, 1, "", Segment(tokens, voice, (), seed)) for k, (tokens, seed) in enumerate(batch)]

    if cfg["pool_fraction"] is not None:
        info = rec.step("setup_pool", lambda: gpu.setup_pool(cfg["pool_fraction"], dev))
        rec.data["pool"] = asdict(info) if info is not None else None
        rec.data["after_pool"] = {"device_used_mib": mib(device_used()), **gpu.memory_stats(dev if cuda else None)}
        if info is not None:
            rec.say(f"pool: {mib(info.pool_bytes)} MiB reserved under a cap of {mib(info.cap_bytes)} MiB "
                    f"(models {mib(info.model_bytes)} MiB) in {info.seconds:.2f} s; notes {list(info.notes)}")

    def run_batches(batches: list[Batch], stats: bool) -> None:
        times, reserved, peak_reserved, peaks, frag, ooms = [], [], [], [], [], []
        rec.data["batches_planned"] = len(batches)
        for i, batch in enumerate(batches):
            if time.perf_counter() > deadline:
                rec.data["stopped_early"] = f"time budget reached after {i} batches"
                break
            if stats and cuda:
                torch.cuda.reset_peak_memory_stats(dev)  # per-batch peaks
            start = time.perf_counter()
            try:
                engine.synthesize(units(batch))
                sync()
            except Exception as exc:
                ooms.append({"batch": i, "oom": gpu.is_oom(exc), "error": f"{type(exc).__name__}: {exc}"[:300]})
                rec.say(f"batch {i} failed (oom={gpu.is_oom(exc)}): {str(exc)[:200]}")
            times.append(round(time.perf_counter() - start, 4))
            if stats:
                s = gpu.memory_stats(dev if cuda else None)
                reserved.append(mib(s.get("reserved_bytes")))
                peak_reserved.append(mib(s.get("peak_reserved_bytes")))
                peaks.append(mib(s.get("peak_allocated_bytes")))
                frag.append(None if "fragmentation" not in s else round(s["fragmentation"], 4))
            rec.data.update(batch_s=times, reserved_mib=reserved, peak_reserved_mib=peak_reserved,
                            peak_allocated_mib=peaks, fragmentation=frag, failures=ooms, batches_done=len(times))
            if i % 10 == 9:
                rec.say(f"{i + 1} batches, last {times[-1]:.2f} s, reserved {reserved[-1] if reserved else None} MiB")
                rec.save()
        rec.save()

    batches = section_batches(kind, cfg)
    if kind == "flat":
        rec.step("batches", lambda: run_batches(batches, stats=True))
    elif kind == "speed":
        # No warm-up batch: the first batches are where a pre-allocated pool pays off.
        rec.step("batches", lambda: run_batches(batches, stats=False))
        done = rec.data.get("batches_done", 0)
        rec.data["audio_s"] = round(audio_seconds(batches[:done]), 2)
    elif kind == "low":
        low_section(cfg, rec, engine, voice, batches[0], units, dev, cuda, sync, deadline, TOKENS_PER_TEXT_TOKEN)
    rec.data["final"] = {"device_used_mib": mib(device_used()), **gpu.memory_stats(dev if cuda else None)}
    rec.save()
    rec.say("done")


def low_section(cfg, rec, engine, voice, batch, units, dev, cuda, sync, deadline, per_text) -> None:
    """(b): per-stage probes, the budget they give, then the longest rows at the low fraction."""
    import torch

    from cosybatch.cosyvoice.flow.cfm import FlowInput
    from cosybatch.cosyvoice.lm.slots import LMRequest

    n_text = cfg["long_tokens"]
    gen = torch.Generator().manual_seed(cfg["seed"])
    probe_rows = 2
    per_unit: dict[str, float] = {}

    def probe_lm() -> float:
        # The LM's memory is linear in length (KV cache): 10 text tokens per row keep the probe short.
        n_lm = min(10, n_text)
        reqs = [LMRequest(text=batch[i][0][:n_lm], seed=i) for i in range(probe_rows)]
        return gpu.probe_stage(lambda: engine.lm.generate(reqs, engine.sampling), probe_rows * per_text * n_lm, dev)

    speech = [torch.randint(0, STOP_TOKEN, (n_text * SPEECH_PER_TEXT,), generator=gen) for _ in range(probe_rows)]
    items = [FlowInput(t, voice.embedding, voice.prompt_tokens, voice.prompt_mel) for t in speech]
    units_long = probe_rows * per_text * n_text  # padded cost units as the planner counts them
    mels: list = []

    def probe_flow() -> float:
        return gpu.probe_stage(lambda: mels.extend(engine.t2w.mels(items)), units_long, dev)

    def probe_hift() -> float:
        return gpu.probe_stage(lambda: engine.t2w.vocode(mels, list(range(probe_rows))), units_long, dev)

    for name, fn in (("lm", probe_lm), ("flow", probe_flow), ("hift", probe_hift)):
        value = rec.step(f"probe_{name}", fn)
        if value is not None:
            per_unit[name] = value
    rec.data["bytes_per_unit"] = {k: round(v, 1) for k, v in per_unit.items()}
    pool = rec.data.get("pool") or {}
    long_units = len(batch) * per_text * n_text
    rec.data["long_batch_units"] = long_units
    if per_unit and pool:
        budget = rec.step("budget", lambda: gpu.budget_from_probe(per_unit, pool["pool_bytes"]))
        rec.data["budget_units"] = budget
        rec.data["budget_fits_long_batch"] = None if budget is None else budget >= long_units
        rec.say(f"bytes per unit {rec.data['bytes_per_unit']}; budget {budget} units; long batch {long_units}")

    attempts = []
    size = len(batch)
    while size >= 1:
        if time.perf_counter() > deadline:
            rec.data["stopped_early"] = f"time budget reached before batch {size}"
            break
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        start = time.perf_counter()
        entry: dict = {"batch": size}
        try:
            engine.synthesize(units(batch[:size]))
            sync()
            entry.update(ok=True, oom=False)
        except Exception as exc:
            entry.update(ok=False, oom=gpu.is_oom(exc), error=f"{type(exc).__name__}: {exc}"[:400])
        entry["seconds"] = round(time.perf_counter() - start, 2)
        entry["stats"] = gpu.memory_stats(dev if cuda else None)
        attempts.append(entry)
        rec.data["attempts"] = attempts
        rec.save()
        rec.say(f"batch {size} x {n_text} text tokens: ok={entry['ok']} oom={entry['oom']} "
                f"in {entry['seconds']} s, peak {mib(entry['stats'].get('peak_allocated_bytes'))} MiB")
        if entry["ok"] or not entry["oom"]:
            break
        size //= 2  # what a job does with an OOM: split the batch, keep the process
    rec.data["oom_happened"] = any(a["oom"] for a in attempts)


# -- parent side --------------------------------------------------------------------------------
def make_plan(args: argparse.Namespace) -> dict:
    quick = 1 if args.quick else 0
    cfg = {
        "device": args.device,
        "size": args.size,
        "seed": args.seed,
        "batches": args.batches or (30 if quick else 100),
        "flat_tokens": 3 if quick else 4,
        "speed_batches": args.speed_batches or (5 if quick else 10),
        "speed_batch": 16,
        "speed_tokens": 8,
        "long_tokens": args.long_tokens,
        "long_batch": args.long_batch,
    }
    children = []
    for section in args.sections:
        if section == "a":
            children.append(("flat", "pool", args.fraction))
        elif section == "b":
            children.append(("low", "pool", args.low_fraction))
        elif section == "c":
            for variant in args.variants or (["pool", "nopool"] if quick else ["pool", "nopool", "native"]):
                children.append(("speed", variant, args.fraction if variant == "pool" else None))
    plan = {"config": cfg, "children": [], "budget_s": args.budget_s}
    for kind, variant, fraction in children:
        plan["children"].append({
            "kind": kind, "variant": variant, "pool_fraction": fraction,
            "budget_s": BUDGETS[kind][quick], "alloc_conf": "backend:native" if variant == "native" else gpu.ALLOC_CONF,
            "work": describe(section_batches(kind, cfg)),
        })
    return plan


def child_env(variant: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (gpu.ENV, gpu.ENV_GENERIC)}
    env["PYTHONUNBUFFERED"] = "1"
    if variant == "native":
        env[gpu.ENV] = "backend:native"  # the child's configure_allocator keeps it, with a note
    return env  # otherwise the child's configure_allocator selects cudaMallocAsync itself


def run_child(spec: dict, cfg: dict, model_dir: Path, work: Path, remaining: float) -> dict:
    tag = f"{spec['kind']}-{spec['variant']}"
    result = work / f"{tag}.json"
    config = work / f"{tag}.config.json"
    budget = max(5.0, min(spec["budget_s"], remaining - LOAD_S))
    config.write_text(json.dumps({**cfg, **spec, "budget_s": budget, "model_dir": str(model_dir),
                                  "result": str(result)}), encoding="utf-8")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(config)]
    start = time.perf_counter()
    status = "ok"
    try:
        proc = subprocess.run(cmd, env=child_env(spec["variant"]), timeout=budget + LOAD_S + 30, check=False)
        if proc.returncode != 0:
            status = f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = "killed at its timeout"
    data: dict = {}
    try:
        data = json.loads(result.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        data = {"errors": {"result": f"no result file: {exc}"}}
    data["status"] = status
    data["wall_s"] = round(time.perf_counter() - start, 1)
    return data


def summarise(results: dict) -> dict:
    """The headline figures of each section, from the children's raw results."""
    out: dict = {}
    flat = results.get("flat-pool")
    if flat:
        reserved = [r for r in flat.get("reserved_mib", []) if r is not None]
        peaks = [p for p in flat.get("peak_allocated_mib", []) if p is not None]
        times = flat.get("batch_s", [])
        out["a_flat"] = {
            "batches_done": flat.get("batches_done", 0),
            "reserved_min_mib": min(reserved, default=None),
            "reserved_max_mib": max(reserved, default=None),
            "reserved_growth_after_batch_10_mib": round(reserved[-1] - reserved[9], 1) if len(reserved) > 10 else None,
            "reserved_max_growth_after_batch_10_mib": (round(max(reserved[10:]) - reserved[9], 1)
                                                       if len(reserved) > 10 else None),
            "peak_allocated_max_mib": max(peaks, default=None),
            "peak_reserved_max_mib": max((p for p in flat.get("peak_reserved_mib", []) if p is not None), default=None),
            "fragmentation_last": (flat.get("fragmentation") or [None])[-1],
            "failures": len(flat.get("failures", [])),
            "batch_s_median": round(statistics.median(times), 3) if times else None,
            "pool_mib": mib((flat.get("pool") or {}).get("pool_bytes")),
            "cap_mib": mib((flat.get("pool") or {}).get("cap_bytes")),
            "backend": flat.get("backend"),
        }
    low = results.get("low-pool")
    if low:
        attempts = low.get("attempts", [])
        first = attempts[0] if attempts else {}
        out["b_low_fraction"] = {
            "oom_happened": low.get("oom_happened"),
            "first_attempt_ok": first.get("ok"),
            "survived_with_batch": next((a["batch"] for a in attempts if a.get("ok")), None),
            "peak_allocated_mib": mib((first.get("stats") or {}).get("peak_allocated_bytes")),
            "peak_reserved_mib": mib((first.get("stats") or {}).get("peak_reserved_bytes")),
            "cap_mib": mib((low.get("pool") or {}).get("cap_bytes")),
            "bytes_per_unit": low.get("bytes_per_unit"),
            "budget_units": low.get("budget_units"),
            "long_batch_units": low.get("long_batch_units"),
            "budget_fits_long_batch": low.get("budget_fits_long_batch"),
        }
    speed = {k.split("-", 1)[1]: v for k, v in results.items() if k.startswith("speed-")}
    if speed:
        done = min((len(v.get("batch_s", [])) for v in speed.values()), default=0)
        rows = {}
        for variant, v in speed.items():
            times = v.get("batch_s", [])[:done]
            rows[variant] = {
                "backend": v.get("backend"),
                "batches": done,
                "total_s": round(sum(times), 3) if times else None,
                "first_batch_s": times[0] if times else None,
                "rest_s": round(sum(times[1:]), 3) if len(times) > 1 else None,
            }
        base = rows.get("pool", {})
        for variant, row in rows.items():
            if variant != "pool" and base.get("total_s") and row.get("total_s"):
                row["time_ratio_vs_pool"] = round(row["total_s"] / base["total_s"], 3)
                if base.get("rest_s") and row.get("rest_s"):
                    row["rest_ratio_vs_pool"] = round(row["rest_s"] / base["rest_s"], 3)
        out["c_throughput"] = rows
    return out


def print_summary(summary: dict) -> None:
    a = summary.get("a_flat")
    if a:
        print(
            f"(a) {a['batches_done']} batches, backend {a['backend']}: reserved {a['reserved_min_mib']} .. "
            f"{a['reserved_max_mib']} MiB, growth after batch 10 {a['reserved_growth_after_batch_10_mib']} MiB "
            f"(max {a['reserved_max_growth_after_batch_10_mib']}), peak reserved {a['peak_reserved_max_mib']} MiB, "
            f"pool {a['pool_mib']} MiB of a {a['cap_mib']} MiB cap, {a['failures']} failed batches, "
            f"median batch {a['batch_s_median']} s"
        )
    b = summary.get("b_low_fraction")
    if b:
        print(f"(b) OOM: {b['oom_happened']}, first attempt ok: {b['first_attempt_ok']}, survived with batch "
              f"{b['survived_with_batch']}; peak allocated {b['peak_allocated_mib']} MiB, peak reserved "
              f"{b['peak_reserved_mib']} MiB, cap {b['cap_mib']} MiB; budget {b['budget_units']} units "
              f"for a {b['long_batch_units']}-unit batch; bytes/unit {b['bytes_per_unit']}")
    for variant, row in (summary.get("c_throughput") or {}).items():
        print(f"(c) {variant:<7} backend {row['backend']}: {row['batches']} batches in {row['total_s']} s "
              f"(first {row['first_batch_s']} s), x{row.get('time_ratio_vs_pool', 1.0)} the pool's time")


def main() -> None:
    ap = cli(__doc__, seed=0, helps={"seed": "seed of the batches' rows",
                                      "json": "also write the final JSON here (a .json file, or a folder to write "
                                              "gpu_memory.json in)"})
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no torch, no GPU)")
    ap.add_argument("--quick", action="store_true", help="fewer batches and shorter budgets (about 3 minutes)")
    ap.add_argument("--batches", type=int, default=None, help="section (a) batches (default 100, quick 30)")
    ap.add_argument("--speed-batches", type=int, default=None, help="section (c) batches (default 10, quick 5)")
    ap.add_argument("--sections", default="a,b,c", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                    help="comma-separated sections to run: a (flat), b (low fraction), c (speed)")
    ap.add_argument("--variants", default=None, type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                    help="section (c): pool,nopool,native (default all three; quick: pool,nopool)")
    ap.add_argument("--fraction", type=float, default=0.9, help="setup_pool's memory fraction, sections (a), (c)")
    ap.add_argument("--low-fraction", type=float, default=0.3, help="section (b)'s memory fraction")
    ap.add_argument("--long-tokens", type=int, default=40, help="section (b) text tokens per row (x20 speech)")
    ap.add_argument("--long-batch", type=int, default=32, help="section (b) rows in its batch")
    ap.add_argument("--budget-s", type=float, default=450, help="stop starting sections after this many seconds")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of the code paths")
    ap.add_argument("--size", choices=("real", "tiny"), default="real", help="random weights of this size")
    ap.add_argument("--model-dir", type=Path, default=None, help="reused when complete (default: under /tmp)")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parse(ap)
    if args.child is not None:
        child(args.child)
        return
    for flag, value in (("--fraction", args.fraction), ("--low-fraction", args.low_fraction)):
        try:
            gpu.validate_fraction(value)
        except UsageError as exc:
            ap.error(f"{flag}: {exc}")
    unknown = (set(args.sections) - {"a", "b", "c"}) | (set(args.variants or ()) - {"pool", "nopool", "native"})
    if unknown:
        ap.error(f"unknown sections or variants: {sorted(unknown)}")

    plan = make_plan(args)
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"cosybatch-gpu-memory-{args.size}"
    plan["model_dir"] = str(model_dir)
    print(f"plan: {args.size} weights on {args.device}, model dir {model_dir}, budget {args.budget_s:.0f} s")
    for spec in plan["children"]:
        w = spec["work"]
        print(f"  {spec['kind']:<5} {spec['variant']:<6} fraction {spec['pool_fraction']}, {spec['alloc_conf']}, "
              f"<= {spec['budget_s']} s of batches (+{LOAD_S} s load): {w['batches']} batches, {w['rows']} rows, "
              f"{w['text_tokens'][0]}..{w['text_tokens'][1]} text tokens, sizes {w['batch_sizes'][0]}.."
              f"{w['batch_sizes'][1]}, {w['lm_steps']} LM steps, {w['audio_s']} s of audio")
    if args.dry_run:
        print(json.dumps({"dry_run": True, "plan": plan}))
        return

    t0 = time.perf_counter()
    out: dict = {"plan": plan, "elapsed_s": {}, "results": {}, "errors": {}}

    def model() -> None:
        if (model_dir / ".complete").is_file():
            print(f"model: reusing {model_dir}")
            return
        from cosybatch.cosyvoice.tiny import write_model_dir  # imports torch (CPU only) in the parent

        write_model_dir(model_dir, size=args.size)
        (model_dir / ".complete").write_text(args.size, encoding="utf-8")

    start = time.perf_counter()
    try:
        model()
    except Exception as exc:
        out["errors"]["model"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    out["elapsed_s"]["model"] = round(time.perf_counter() - start, 1)
    print(f"model: {out['elapsed_s']['model']} s", flush=True)

    with tempfile.TemporaryDirectory(prefix="gpu-memory-") as tmp:
        for spec in plan["children"]:
            tag = f"{spec['kind']}-{spec['variant']}"
            remaining = args.budget_s - (time.perf_counter() - t0)
            if "model" in out["errors"]:
                out["errors"][tag] = "skipped: no model"
                continue
            if remaining < LOAD_S + 10:
                out["errors"][tag] = f"skipped: {remaining:.0f} s of the budget left"
                print(f"{tag}: skipped, {remaining:.0f} s left", flush=True)
                continue
            start = time.perf_counter()
            try:
                out["results"][tag] = run_child(spec, plan["config"], model_dir, Path(tmp), remaining)
            except Exception as exc:
                out["errors"][tag] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            out["elapsed_s"][tag] = round(time.perf_counter() - start, 1)
            print(f"{tag}: {out['elapsed_s'][tag]} s ({out['results'].get(tag, {}).get('status')})", flush=True)

    try:
        out["summary"] = summarise(out["results"])
        print_summary(out["summary"])
    except Exception as exc:
        out["errors"]["summary"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    out["elapsed_s"]["total"] = round(time.perf_counter() - t0, 1)
    print(f"total: {out['elapsed_s']['total']} s")
    line = json.dumps(out, default=str, separators=(",", ":"))
    try:
        Report(None if args.json == "-" else args.json, "gpu_memory", indent=None).save(out)
    except OSError as exc:
        print(f"could not write {args.json}: {exc}", file=sys.stderr)
    print(line)


if __name__ == "__main__":
    main()
