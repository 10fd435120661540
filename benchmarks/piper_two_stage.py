"""Piper one graph vs two stages (decoder regrouped by real frame counts), side by side.

The same planner batches of a mixed corpus (examples/sentences.txt, sentences of 1 to 40 words) go
to one engine per variant, the variants taking turns on every batch (the order alternating), so a
noisy machine slows them alike. Prints, per variant: decoder padding efficiency (real / computed
output frames, what stats.json's padding_ratio is 1 minus), audio-seconds per wall-second, its
speed relative to the one graph, and the largest difference of its audio from the one graph's.

    python benchmarks/piper_two_stage.py [--batch-size 32] [--rows 120] [--threads 1] \\
        [--efficiency 0.95 --efficiency 0] [--rounds 2] [--device cpu] [--json PATH]

Speeds are per round (the round's audio over its wall time); the table gives their medians, their
range and the ratio of medians to the one graph.
"""

from __future__ import annotations

import time

import numpy as np
from common import Report, Runs, cli, parse, sentences, table, turns

from cosybatch.engines import EngineOptions, open_engine
from cosybatch.engines.piper import PiperOptions
from cosybatch.plan import Unit, plan_batches


def main() -> None:
    ap = cli(__doc__, rounds=2, rows=120, threads=1, device="cpu",
             helps={"rounds": "passes over the corpus, every batch run by every variant in turn; the first "
                              "also counts the padding"})
    ap.add_argument("--batch-size", type=int, default=32, help="the planner's pieces per batch")
    ap.add_argument("--budget-per-item", type=int, default=256, help="padded phoneme ids per item (the CPU default)")
    ap.add_argument("--efficiency", type=float, action="append",
                    help="two-stage variants by stage2_efficiency (repeatable; default 0.95 and 0)")
    args = parse(ap)
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
    runs = Runs(names, baseline="one-graph")
    real = dict.fromkeys(names, 0)
    padded = dict.fromkeys(names, 0)
    diff = dict.fromkeys(names, 0.0)
    outs: dict = {}
    for rnd, i, name in turns(names, args.rounds, len(batches)):
        batch = batches[i]
        t = time.perf_counter()
        out = variants[name].synthesize(batch.units)
        runs.add(name, rnd, wall_s=time.perf_counter() - t,
                 audio_s=sum(len(a) for a in out.audio) / first.sample_rate)
        outs[name] = out
        if rnd == 0:
            real[name] += out.real_frames
            padded[name] += out.padded_frames
        if len(outs) == len(names):  # every variant ran this batch: compare with the one graph
            for other in names:
                for a, b in zip(outs["one-graph"].audio, outs[other].audio, strict=True):
                    assert len(a) == len(b)
                    diff[other] = max(diff[other], float(np.abs(a - b).max()))
            outs = {}
            print(f"round {rnd} batch {i} ({len(batch.units)} pieces) done", flush=True)
    runs.derive("audio_s_per_s", lambda f: f["audio_s"] / f["wall_s"])
    result = {"benchmark": "piper_two_stage", "rows": args.rows, "pieces": len(units), "batches": len(batches),
              "threads": args.threads, **runs.as_dict(),
              "padding_efficiency": {n: real[n] / padded[n] for n in names}, "max_abs_diff": diff}

    def show() -> None:
        table(["variant", "padding eff.", "audio-s/s", "min..max", "speed vs one-graph", "max |diff|"],
              [[n, f"{real[n] / padded[n]:.3f}", runs.cell(n, "audio_s_per_s", ".2f"),
                runs.cell(n, "audio_s_per_s", ".2f", "range"), runs.cell(n, "audio_s_per_s", ".2f", "ratio"),
                f"{diff[n]:.1e}"] for n in names])

    Report(args.json, "piper_two_stage").emit(result, show)


if __name__ == "__main__":
    main()
