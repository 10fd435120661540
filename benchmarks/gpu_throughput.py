"""CosyVoice2 throughput on one GPU at real size (random weights): one prepared run for a lent GPU.

Each configuration runs in its own process (``cosyvoice_e2e.py``'s worker: the model loads
untimed, a warm-up, then the timed segments) and reports end-to-end RTF, the LM's tokens/s, how
full the decode slots stayed and the peak allocated memory:

  graphs        first, a correctness check: greedy LM tokens with CUDA graphs equal the eager
                ones (12 mixed-length rows through 4 slots, so steps are replayed, rows are admitted
                mid-run and the pool shrinks), in bf16 and fp32
  upstream      upstream's per-utterance loop on --upstream-items segments (its RTF per item)
  ours          cosybatch on --items segments for each (precision, slots, CUDA graphs[, flow
                backend]) in the plan; the last runs the flow's estimator as a TensorRT fp16 engine
                (built on first use, untimed; skipped when the budget is spent)

The plan runs in order until the deadline (--budget seconds); configurations not reached are
listed as skipped. Segments are drawn as in cosyvoice_e2e.py (3 to 15 text tokens, 20 speech tokens
per text token, the stop token kept off).

    python benchmarks/gpu_throughput.py --json gpu_throughput.json     # an H200: about 8 minutes
    python benchmarks/gpu_throughput.py --dry-run                      # CPU, tiny: the code paths

The last stdout line is every figure as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cosyvoice_e2e import segments_spec  # noqa: E402

# (precision, slots, CUDA graphs[, flow backend: torch unless given]), most telling first.
PLAN = [
    ("bf16", 64, True), ("bf16", 128, True), ("bf16", 32, True), ("bf16", 64, False),
    ("fp32", 64, True), ("fp32", 64, False), ("bf16", 128, False), ("fp32", 128, True),
    ("bf16", 32, False), ("fp32", 32, True), ("bf16", 64, True, "tensorrt"),
]


def graph_check(model: Path, device: str) -> dict:
    """Greedy tokens with and without CUDA graphs, per precision (run in a child process)."""
    import random

    import torch

    from cosybatch.cosyvoice.lm.pool import LMRequest, Sampling
    from cosybatch.cosyvoice.lm.v2 import load_llm

    if device == "cpu":
        torch.set_num_threads(1)  # a dry run beside other work: more threads than free cores crawl
    rng = random.Random(3)
    texts = [[rng.randrange(1000) for _ in range(rng.randint(2, 16))] for _ in range(12)]
    out = {}
    precisions = (("bf16", torch.bfloat16), ("fp32", torch.float32)) if device == "cuda" else (("fp32", torch.float32),)
    for name, dtype in precisions:
        lm = load_llm(model, device, dtype)
        with torch.no_grad():
            lm.llm_decoder.bias[6561:] = -1e4
        runs = {}
        for graphs in (False, True):
            reqs = [LMRequest(text=t, seed=i) for i, t in enumerate(texts)]
            tokens, stats = lm.decode(reqs, Sampling(greedy=True), slots=4, cuda_graphs=graphs)
            runs[graphs] = (tokens, stats)
        out[name] = {"identical": runs[True][0] == runs[False][0], "graphs_captured": runs[True][1].graphs,
                     "tokens": sum(len(t) for t in runs[True][0])}
        del lm
    return out


def run_worker(path: str, model: Path, device: str, texts: list, precision: str, slots: int | None,
               graphs: bool, timeout: float, flow_backend: str = "torch") -> dict:
    cmd = [sys.executable, str(HERE / "cosyvoice_e2e.py"), "--worker", path, "--model", str(model),
           "--device", device, "--precision", precision, "--segments", json.dumps(texts)]
    if slots:
        cmd += ["--lm-slots", str(slots)]
    if not graphs:
        cmd += ["--no-cuda-graphs"]
    if flow_backend != "torch":
        cmd += ["--flow-backend", flow_backend]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout), check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "seconds": round(time.monotonic() - start, 1)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=256)
    ap.add_argument("--upstream-items", type=int, default=12)
    ap.add_argument("--budget", type=float, default=480, help="seconds for everything, model writing included")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny weights, 6 segments, 2 configurations")
    ap.add_argument("--graph-check", nargs=2, metavar=("MODEL", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.graph_check:
        print(json.dumps(graph_check(Path(args.graph_check[0]), args.graph_check[1])))
        return
    deadline = time.monotonic() + args.budget
    device, size, plan = "cuda", "real", PLAN
    if args.dry_run:
        device, size, plan = "cpu", "tiny", [("fp32", 4, True), ("fp32", 2, False)]
        args.items, args.upstream_items = 6, 2
    from cosybatch.cosyvoice.tiny import write_model_dir

    texts = segments_spec(args.items)
    up_texts = texts[: args.upstream_items]

    def audio_s(t):
        return sum(20 * len(x) * 2 * 480 for x in t) / 24000

    result: dict = {"device": device, "size": size, "items": args.items, "audio_s": round(audio_s(texts), 1),
                    "runs": [], "skipped": []}
    if device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
        result["torch"] = torch.__version__
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model_dir(Path(tmp) / "model", size=size)
        try:
            proc = subprocess.run([sys.executable, __file__, "--graph-check", str(model), device], capture_output=True,
                                  text=True, timeout=max(1.0, min(180.0, deadline - time.monotonic())), check=False)
            result["graphs"] = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                                else {"error": proc.stderr[-2000:]})
        except subprocess.TimeoutExpired:
            result["graphs"] = {"error": "timed out"}
        print("graphs", json.dumps(result["graphs"]), flush=True)
        up = run_worker("upstream", model, device, up_texts, "fp32", None, True, deadline - time.monotonic())
        if "wall" in up:
            up["rtf"] = round(up["wall"] / audio_s(up_texts), 4)
        result["upstream"] = up
        print("upstream", json.dumps(up), flush=True)
        for precision, slots, graphs, *flow in plan:
            config = {"precision": precision, "slots": slots, "cuda_graphs": graphs} | (
                {"flow_backend": flow[0]} if flow else {})
            left = deadline - time.monotonic()
            if left < 45:
                result["skipped"].append(config)
                continue
            row = run_worker("ours", model, device, texts, precision, slots, graphs, left - 5, *flow)
            row.update(config)
            if "wall" in row:
                row["rtf"] = round(row["wall"] / result["audio_s"], 4)
                row["lm_tokens_per_s"] = round(row["lm_tokens"] / row["lm_seconds"], 1) if row["lm_seconds"] else None
                if "rtf" in up:
                    row["speedup_vs_upstream"] = round(up["rtf"] / row["rtf"], 2)
            result["runs"].append(row)
            print("ours", json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
