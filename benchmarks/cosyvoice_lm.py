"""The CosyVoice2 LM's slot pool: tokens/s by slot count on mixed-length requests, how full the
slots stay, host reads and kernels per decode step, weight casts per step in bf16.

Random weights never emit the stop token, so it is kept off and each request stops at its own
``max_tokens``: 2x to 20x its text tokens, so stop lengths differ up to 10x within a run. Every
slot count decodes its own queue of max(8, 4 x slots) requests drawn the same way (rates, not
totals, are compared), one after another in one process.

    python benchmarks/cosyvoice_lm.py --json                     # real size, CPU, 1 thread
    python benchmarks/cosyvoice_lm.py --size tiny --slots 1,4    # a quick look
    python benchmarks/cosyvoice_lm.py --device cuda --slots 32,64,128 --precision bf16
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch
from common import Report, cli, parse, table
from torch.utils._python_dispatch import TorchDispatchMode

from cosybatch.cosyvoice.lm.slots import LMRequest, Sampling, SlotPool
from cosybatch.cosyvoice.lm.v2 import load_llm
from cosybatch.cosyvoice.tiny import write_model_dir

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Count(TorchDispatchMode):
    """Kernels (non-view aten ops) run, and casts whose input is one of ``weights``."""

    def __init__(self, weights=()):
        super().__init__()
        self.kernels = 0
        self.weight_casts = 0
        self.weights = {w.data_ptr() for w in weights}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.kernels += 1
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to) and args and \
                isinstance(args[0], torch.Tensor) and args[0].data_ptr() in self.weights:
            self.weight_casts += 1
        return func(*args, **(kwargs or {}))


def requests(n: int, seed: int) -> list[LMRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = rng.randint(8, 24)
        out.append(LMRequest(text=[rng.randrange(1000) for _ in range(text)], seed=seed * 1000 + i,
                             min_tokens=0, max_tokens=text * rng.randint(2, 20)))
    return out


def step_counts(lm, slots: int, sampling: Sampling, device: str) -> Count:
    with torch.inference_mode():
        pool = SlotPool(lm, slots, 512, 512, sampling, cuda_graphs=False)
        pool._step(slots, 256)
        count = Count(lm.parameters())
        with count:
            pool._step(slots, 256)
    return count


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = cli(__doc__, threads=1, device="cpu")
    ap.add_argument("--size", choices=("tiny", "real"), default="real", help="random weights of this size")
    ap.add_argument("--slots", default="1,4,8,16,32", help="comma-separated slot counts, each decoding its own queue")
    ap.add_argument("--precision", choices=sorted(DTYPES), default="fp32", help="the LM's weights")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA")
    args = parse(ap)
    torch.set_num_threads(args.threads)
    slot_counts = [int(s) for s in args.slots.split(",")]
    sampling = Sampling()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", size=args.size)
        lm = load_llm(model_dir, args.device, DTYPES[args.precision])
        with torch.no_grad():
            lm.llm_decoder.bias[6561:] = -1e4
        rows = []
        for slots in slot_counts:
            reqs = requests(max(8, 4 * slots), seed=slots)
            # The pool the timed run needs, made first, so the warm-up reuses it (and, on CUDA,
            # captures its graphs outside the timing).
            lm.slot_pool(slots, max(2 + len(r.text) + r.max_tokens for r in reqs) + 1,
                         max(r.max_tokens for r in reqs), sampling, not args.no_cuda_graphs)
            lm.generate(requests(2, seed=0), sampling, slots=slots, cuda_graphs=not args.no_cuda_graphs)  # warm
            sync(args.device)
            start = time.perf_counter()
            tokens = lm.generate(reqs, sampling, slots=slots, cuda_graphs=not args.no_cuda_graphs)
            sync(args.device)
            wall = time.perf_counter() - start
            stats = lm.last_stats
            made = sum(len(t) for t in tokens)
            assert made == sum(r.max_tokens for r in reqs)
            counts = step_counts(lm, slots, sampling, args.device) if args.device == "cpu" else None
            rows.append({
                "slots": slots, "requests": len(reqs), "tokens": made, "seconds": round(wall, 2),
                "tokens_per_s": round(made / wall, 1), "live_fraction": round(stats.live_fraction, 3),
                "host_syncs_per_step": round(stats.host_syncs / stats.steps, 3),
                "kernels_per_step": counts.kernels if counts else None,
                "steps": stats.steps, "prefills": stats.prefills, "graphs": stats.graphs,
            })
        casts = None
        if args.device == "cpu":
            half = lm if args.precision == "bf16" else load_llm(model_dir, args.device, torch.bfloat16)
            casts = step_counts(half, slot_counts[-1], sampling, args.device).weight_casts
            del half
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast_casts = step_counts(load_llm(model_dir, args.device), slot_counts[-1], sampling,
                                             args.device).weight_casts
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup_vs_first"] = round(row["tokens_per_s"] / base, 2)
    result = {"size": args.size, "device": args.device, "precision": args.precision, "threads": args.threads,
              "rows": rows, "weight_casts_per_step_bf16": casts,
              "weight_casts_per_step_fp32_under_autocast": autocast_casts if casts is not None else None}

    def show() -> None:
        print(f"{args.size} LM, {args.device}, {args.precision}, threads={args.threads}")
        table(["slots", "tokens/s", "x", "live", "syncs/step", "kernels/step"],
              [[r["slots"], r["tokens_per_s"], r["speedup_vs_first"], r["live_fraction"], r["host_syncs_per_step"],
                str(r["kernels_per_step"])] for r in rows])
        autocast = result["weight_casts_per_step_fp32_under_autocast"]
        print(f"weight casts per step: bf16 weights {casts}, fp32 weights under autocast {autocast}")

    Report(args.json, "cosyvoice_lm").emit(result, show)


if __name__ == "__main__":
    main()
