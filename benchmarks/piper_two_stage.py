"""Piper one graph vs two stages (decoder regrouped by real frame counts), side by side.

The same planner batches of a mixed corpus (examples/sentences.txt, sentences of 1 to 40 words) go
to one engine per variant, the variants taking turns on every batch (the order alternating), so a
noisy machine slows them alike. Prints, per variant: decoder padding efficiency (real / computed
output frames, what stats.json's padding_ratio is 1 minus), audio-seconds per wall-second, its
speed relative to the one graph, and the largest difference of its audio from the one graph's.

    python benchmarks/piper_two_stage.py [--batch-size 32] [--rows 120] [--threads 1] \\
        [--efficiency 0.95 --efficiency 0] [--rounds 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import sentences

from cosybatch.engines import EngineOptions, open_engine
from cosybatch.engines.piper import PiperOptions
from cosybatch.plan import Unit, plan_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--budget-per-item", type=int, default=256, help="padded phoneme ids per item (the CPU default)")
    ap.add_argument("--rows", type=int, default=120)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the corpus; the first is also timed")
    ap.add_argument("--efficiency", type=float, action="append",
                    help="two-stage variants by stage2_efficiency (repeatable; default 0.95 and 0)")
    args = ap.parse_args()
    efficiencies = args.efficiency or [0.95, 0.0]

    def engine(**extra):
        return open_engine("piper", None, EngineOptions(device=args.device, threads=args.threads, seed=7,
                                                        engine=PiperOptions(**extra)))

    variants = {"one-graph": engine(two_stage=False)}
    for eff in efficiencies:
        variants[f"two-stage eff>={eff:g}"] = engine(two_stage=True, stage2_efficiency=eff)
    first = variants["one-graph"]
    units = []
    for row, text in enumerate(sentences(args.rows)):
        prepared = first.prepare(text, f"s{row:05d}")
        units += [Unit(row, part, piece.cost, "", piece.payload)
                  for part, piece in enumerate(prepared.pieces)]
    batches = plan_batches(units, args.batch_size, args.batch_size * args.budget_per_item)
    sizes = [len(b.units) for b in batches]
    print(f"{args.rows} rows -> {len(units)} pieces, {len(batches)} planner batches (sizes {sizes}), "
          f"device {first.device}, {args.threads} thread(s)")

    names = list(variants)
    wall = dict.fromkeys(names, 0.0)
    real = dict.fromkeys(names, 0)
    padded = dict.fromkeys(names, 0)
    audio_s = dict.fromkeys(names, 0.0)
    diff = dict.fromkeys(names, 0.0)
    for rnd in range(args.rounds):
        for i, batch in enumerate(batches):
            order = names if (i + rnd) % 2 == 0 else names[::-1]
            outs = {}
            for name in order:
                t = time.perf_counter()
                out = variants[name].synthesize(batch.units)
                wall[name] += time.perf_counter() - t
                outs[name] = out
                if rnd == 0:
                    real[name] += out.real_frames
                    padded[name] += out.padded_frames
                audio_s[name] += sum(len(a) for a in out.audio) / first.sample_rate
            for name in names:
                for a, b in zip(outs["one-graph"].audio, outs[name].audio, strict=True):
                    assert len(a) == len(b)
                    diff[name] = max(diff[name], float(np.abs(a - b).max()))
            print(f"round {rnd} batch {i} ({len(batch.units)} pieces) done", flush=True)
    base = audio_s["one-graph"] / wall["one-graph"]
    print(f"{'variant':24s} {'padding eff.':>12s} {'audio-s/s':>10s} {'speed vs one-graph':>19s} {'max |diff|':>11s}")
    for name in names:
        rate = audio_s[name] / wall[name]
        print(f"{name:24s} {real[name] / padded[name]:12.3f} {rate:10.2f} {rate / base:18.2f}x {diff[name]:11.1e}")


if __name__ == "__main__":
    main()
