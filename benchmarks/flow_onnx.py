"""The CosyVoice2 flow (speech tokens -> mel) with its estimator on torch and on ONNX Runtime, side by side.

Both backends load the same random weights (real CosyVoice2-0.5B sizes by default) and run
``Token2Wav.mels`` on the same items of mixed lengths (1 to 6 s of speech, a third with a 3 s
prompt) one flow call at a time or in batches, alternating backends round by round so a busy
machine slows them alike. Prints seconds per round, audio-seconds per wall-second, the speed ratio
of each backend to torch, the largest mel difference to torch, and the one-off costs: the export
(made in a child process into a fresh cache folder unless ``--cache`` names one, so the timed
process never ran the exporter) and the load from the cache (hash check and session).

    python benchmarks/flow_onnx.py                          # CPU, real size, 1 thread, 6 items, 3 rounds
    python benchmarks/flow_onnx.py --size tiny --rounds 1   # quick smoke run
    python benchmarks/flow_onnx.py --device cuda --precision fp16 --backends torch,onnx,tensorrt --batch 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cosybatch.cosyvoice.flow.cfm import FlowInput  # noqa: E402
from cosybatch.cosyvoice.pipeline import Token2Wav  # noqa: E402
from cosybatch.cosyvoice.tiny import write_model_dir  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from token2wav import make_items, sync  # noqa: E402  (the same items and sync as token2wav.py)


def run(t2w: Token2Wav, items: list[FlowInput], batch: int) -> tuple[float, list[torch.Tensor]]:
    order = sorted(range(len(items)), key=lambda i: -len(items[i].tokens))  # longest first, as the engine
    mels: list = [None] * len(items)
    sync(t2w.device)
    start = time.perf_counter()
    for s in range(0, len(order), batch):
        chunk = order[s : s + batch]
        for i, mel in zip(chunk, t2w.mels([items[i] for i in chunk]), strict=True):
            mels[i] = mel
    sync(t2w.device)
    return time.perf_counter() - start, mels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("tiny", "real"), default="real")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    ap.add_argument("--backends", default="torch,onnx", help="comma-separated flow backends (torch first)")
    ap.add_argument("--items", type=int, default=6)
    ap.add_argument("--batch", type=int, default=1, help="items per flow call (the engine's CPU default is 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch and onnxruntime intra-op threads (CPU)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="cache folder for the export (default: a fresh one, so the export is timed)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--export-only", type=Path, metavar="MODEL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    backends = args.backends.split(",")
    if args.export_only:  # the child: fill the cache for each backend
        for backend in backends:
            Token2Wav(args.export_only, device=device, precision=args.precision, flow_backend=backend,
                      onnx_cache=args.cache)
        return
    if backends[0] != "torch":
        backends.insert(0, "torch")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", size=args.size, llm=False)
        cache = args.cache or Path(tmp) / "cache"
        exports = {}
        for backend in backends[1:]:
            start = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--export-only", str(model_dir), "--cache", str(cache),
                            "--device", args.device, "--precision", args.precision, "--backends", backend,
                            "--threads", str(args.threads)], check=True)
            exports[backend] = time.perf_counter() - start
        engines, loads = {}, {}
        for backend in backends:
            start = time.perf_counter()
            engines[backend] = Token2Wav(model_dir, device=device, precision=args.precision, flow_backend=backend,
                                         onnx_cache=cache)
            loads[backend] = time.perf_counter() - start
        items = make_items(args.items, seed=1)
        frames = sum(2 * len(it.tokens) for it in items)
        audio_s = frames * engines["torch"].samples_per_frame / engines["torch"].sample_rate
        for t2w in engines.values():  # warm-up: allocator, kernels, onnxruntime's first run
            run(t2w, items[:1], 1)
        times: dict[str, list[float]] = {b: [] for b in backends}
        diffs: dict[str, float] = {}
        for _ in range(args.rounds):
            ref = None
            for backend in backends:
                seconds, mels = run(engines[backend], items, args.batch)
                times[backend].append(seconds)
                if ref is None:
                    ref = mels
                else:
                    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(mels, ref, strict=True))
                    diffs[backend] = max(diffs.get(backend, 0.0), diff)
    base = statistics.median(times["torch"])
    result = {
        "size": args.size, "device": str(device), "precision": args.precision, "threads": torch.get_num_threads(),
        "items": args.items, "batch": args.batch, "rounds": args.rounds, "audio_s": round(audio_s, 2),
        "torch": torch.__version__,
        "backends": {b: {"seconds": round(statistics.median(v), 3), "all_seconds": [round(x, 3) for x in v],
                         "audio_s_per_s": round(audio_s / statistics.median(v), 3),
                         "speed_vs_torch": round(base / statistics.median(v), 3),
                         "max_abs_mel_diff_vs_torch": diffs.get(b, 0.0),
                         "load_s": round(loads[b], 2),
                         "export_process_s": round(exports[b], 1) if b in exports else None}
                     for b, v in times.items()},
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.items} items, {audio_s:.1f} s of audio, {args.size} weights, {device}, {args.precision}, "
          f"threads={torch.get_num_threads()}, batch {args.batch}, median of {args.rounds} rounds")
    print(f"{'flow backend':<14} {'s/round':>8} {'audio-s/s':>10} {'vs torch':>9} {'max |dmel|':>11} "
          f"{'load s':>7} {'export s':>9}")
    for b, row in result["backends"].items():
        export = "-" if row["export_process_s"] is None else f"{row['export_process_s']:.1f}"
        print(f"{b:<14} {row['seconds']:>8.2f} {row['audio_s_per_s']:>10.2f} {row['speed_vs_torch']:>8.2f}x "
              f"{row['max_abs_mel_diff_vs_torch']:>11.2e} {row['load_s']:>7.1f} {export:>9}")


if __name__ == "__main__":
    main()
