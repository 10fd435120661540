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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import Report, alternate, cli, parse, table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from token2wav import make_items, sync  # noqa: E402  (the same items and sync as token2wav.py)

from cosybatch.cosyvoice.flow.cfm import FlowInput  # noqa: E402
from cosybatch.cosyvoice.pipeline import Token2Wav  # noqa: E402
from cosybatch.cosyvoice.tiny import write_model_dir  # noqa: E402


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
    ap = cli(__doc__, rounds=3, threads=1, device="cpu",
             helps={"threads": "torch and onnxruntime intra-op threads (CPU)"})
    ap.add_argument("--size", choices=("tiny", "real"), default="real", help="random weights of this size")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="the flow's precision")
    ap.add_argument("--backends", default="torch,onnx", help="comma-separated flow backends (torch first)")
    ap.add_argument("--items", type=int, default=6, help="utterances per round")
    ap.add_argument("--batch", type=int, default=1, help="items per flow call (the engine's CPU default is 1)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="cache folder for the export (default: a fresh one, so the export is timed)")
    ap.add_argument("--export-only", type=Path, metavar="MODEL", help=argparse.SUPPRESS)
    args = parse(ap)
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
        mels_of: dict[tuple[str, int], list] = {}  # (backend, round) -> mels, compared with torch's below

        def backend_run(backend: str):
            def once(rnd: int) -> dict:
                seconds, mels_of[backend, rnd] = run(engines[backend], items, args.batch)
                return {"seconds": seconds}
            return once

        runs = alternate({b: backend_run(b) for b in backends}, args.rounds, baseline="torch")
        diffs = {b: max(float((x.float() - y.float()).abs().max()) for r in range(args.rounds)
                        for x, y in zip(mels_of[b, r], mels_of["torch", r], strict=True)) for b in backends[1:]}
    result = {
        "size": args.size, "device": str(device), "precision": args.precision, "threads": torch.get_num_threads(),
        "items": args.items, "batch": args.batch, "rounds": args.rounds, "audio_s": round(audio_s, 2),
        "torch": torch.__version__,
        "backends": {b: {"seconds": round(runs.median(b, "seconds"), 3),
                         "all_seconds": [round(x, 3) for x in runs.values(b, "seconds")],
                         "min_seconds": round(min(runs.values(b, "seconds")), 3),
                         "max_seconds": round(max(runs.values(b, "seconds")), 3),
                         "audio_s_per_s": round(audio_s / runs.median(b, "seconds"), 3),
                         "speed_vs_torch": round(1 / runs.ratio(b, "seconds"), 3),
                         "max_abs_mel_diff_vs_torch": diffs.get(b, 0.0),
                         "load_s": round(loads[b], 2),
                         "export_process_s": round(exports[b], 1) if b in exports else None}
                     for b in backends},
    }

    def show() -> None:
        print(f"{args.items} items, {audio_s:.1f} s of audio, {args.size} weights, {device}, {args.precision}, "
              f"threads={torch.get_num_threads()}, batch {args.batch}, median of {args.rounds} rounds")
        table(["flow backend", "s/round", "min..max", "audio-s/s", "vs torch", "max |dmel|", "load s", "export s"],
              [[b, f"{row['seconds']:.2f}", runs.cell(b, "seconds", ".2f", "range"), f"{row['audio_s_per_s']:.2f}",
                f"{row['speed_vs_torch']:.2f}x", f"{row['max_abs_mel_diff_vs_torch']:.2e}", f"{row['load_s']:.1f}",
                "-" if row["export_process_s"] is None else f"{row['export_process_s']:.1f}"]
               for b, row in result["backends"].items()])

    Report(args.json, "flow_onnx").emit(result, show)


if __name__ == "__main__":
    main()
