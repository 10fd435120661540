"""Variety against batching: one voice at fixed scales vs a pool of 4 voices with a length-scale
range, side by side, and the hours per voice of the pool's two modes.

The pool's voices are 4 copies of the embedded en_US-joe-medium (symlinks under distinct names, so
the job opens 4 engines and batches each voice's rows apart, as it would 4 real voices; their audio
is the same voice). Both variants go through the job's own path: `EngineSet.prepare` (the pool's
assignment, each row's drawn length scale), the planner's batches (grouped by voice) and the
engine's batched synthesis (two stages at batch > 1, the CPU's and GPU's default). A third variant,
one voice with the range, tells the range's cost from the pool's. Each engine first runs a few
short pieces untimed (a session's first batches grow its memory arena); then the variants take
turns batch by batch, so a noisy machine slows them alike. Prints, per variant: rows, batches,
decoder padding efficiency (real / computed output frames: 1 - stats.json's padding_ratio),
audio-seconds per wall-second; then the audio hours per voice the pool made (balanced mode, what
was synthesised) and what hash mode would have given the same rows (predicted by the engine's cost).

    python benchmarks/variety.py [--rows 120] [--batch-size 32] [--length-scale 0.9:1.2] [--device cpu] \\
        [--rounds 1] [--json PATH]

With --rounds N the variants go over their batches N times; speeds are per round (medians in the
table), the audio per voice and the padding are the first round's.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import Report, Runs, cli, order, parse, sentences, table, turns

from cosybatch.config import RunConfig
from cosybatch.corpus import Row
from cosybatch.engines.piper.voice import bundled_voice
from cosybatch.plan import Unit, plan_batches
from cosybatch.run.executor import EngineSet

VOICES = ("voice1", "voice2", "voice3", "voice4")


def prepared(cfg: RunConfig, rows: list[Row], device: str):
    """(EngineSet, units grouped by voice, predicted cost per voice label) the job would make."""
    engines = EngineSet(cfg, device=device)
    units, cost = [], {}
    for row in rows:
        group, prep, _entry = engines.prepare(row)
        label = engines.by_voice[group].voice_name
        cost[label] = cost.get(label, 0) + sum(p.cost for p in prep.pieces)
        units += [Unit(row.index, part, piece.cost, group, piece.payload) for part, piece in enumerate(prep.pieces)]
    return engines, units, cost


def spread(values: dict) -> str:
    mean = sum(values.values()) / len(values)
    return f"(max - min) / mean = {(max(values.values()) - min(values.values())) / mean:.3f}"


def main() -> None:
    ap = cli(__doc__, rounds=1, rows=120, threads=1, device="cpu")
    ap.add_argument("--batch-size", type=int, default=32, help="the planner's pieces per batch")
    ap.add_argument("--budget-per-item", type=int, default=256, help="padded phoneme ids per item (the default)")
    ap.add_argument("--length-scale", default="0.9:1.2", help="the length-scale range drawn per row (LO:HI)")
    args = parse(ap)

    tmp = Path(tempfile.mkdtemp(prefix="cosybatch-variety-"))
    pool = tmp / "voices"
    pool.mkdir()
    model, config = bundled_voice()
    for name in VOICES:
        (pool / f"{name}.onnx").symlink_to(model)
        (pool / f"{name}.onnx.json").symlink_to(config)
    corpus = tmp / "corpus.txt"
    texts = sentences(args.rows)
    corpus.write_text("\n".join(texts) + "\n")
    rows = [Row(i, str(i + 1), text) for i, text in enumerate(texts)]
    common = {"corpus": corpus, "out": tmp / "out", "threads": args.threads, "seed": 7}
    length = {"length_scale": args.length_scale}
    configs = {
        "one voice, fixed scales": RunConfig.from_options(**common),
        f"one voice, length {args.length_scale}": RunConfig.from_options(**common, engine_options=length),
        f"pool of 4, length {args.length_scale}": RunConfig.from_options(**common, voice_pool=str(pool),
                                                                         voice_pool_mode="balanced",
                                                            engine_options=length),
    }
    variants = {}
    for name, cfg in configs.items():
        engines, units, cost = prepared(cfg, rows, args.device)
        batches = plan_batches(units, args.batch_size, args.batch_size * args.budget_per_item)
        variants[name] = {"engines": engines, "batches": batches, "cost": cost, "real": 0, "padded": 0, "audio": {}}
    hashed = prepared(RunConfig.from_options(**common, voice_pool=str(pool), engine_options=length), rows,
                      args.device)[2]
    for v in variants.values():  # each session's first batches grow its memory arena: not timed
        for batch in v["batches"]:
            warm = [u for u in batch.units if u.cost < 40][:4] or list(batch.units[:1])
            v["engines"].by_voice[batch.group].synthesize(warm)
    device = next(iter(variants["one voice, fixed scales"]["engines"].by_voice.values())).device
    print(f"{args.rows} rows of examples/sentences.txt, batch {args.batch_size}, device {device}, "
          f"{args.threads} thread(s); pool voices: 4 copies of the embedded en_US-joe-medium")

    names = list(variants)
    runs = Runs(names)
    longest = max(len(v["batches"]) for v in variants.values())
    for rnd, i, name in turns(names, args.rounds, longest):
        v = variants[name]
        if name == order(names, rnd * longest + i)[-1]:
            print(f"round {rnd} batch {i + 1} of {longest}", flush=True)
        if i >= len(v["batches"]):
            continue
        batch = v["batches"][i]
        engine = v["engines"].by_voice[batch.group]
        t = time.perf_counter()
        out = engine.synthesize(batch.units)
        seconds = sum(len(a) for a in out.audio) / engine.sample_rate
        runs.add(name, rnd, wall_s=time.perf_counter() - t, audio_s=seconds)
        if rnd == 0:
            v["real"] += out.real_frames
            v["padded"] += out.padded_frames
            v["audio"][engine.voice_name] = v["audio"].get(engine.voice_name, 0.0) + seconds
    runs.derive("audio_s_per_s", lambda f: f["audio_s"] / f["wall_s"])
    made = variants[names[-1]]["audio"]
    predicted = variants[names[-1]]["cost"]
    result = {"benchmark": "variety", "rows": args.rows, "batch_size": args.batch_size, "threads": args.threads,
              **runs.as_dict(),
              "batches": {n: len(variants[n]["batches"]) for n in names},
              "padding_efficiency": {n: variants[n]["real"] / variants[n]["padded"] for n in names},
              "balanced_audio_s_per_voice": made, "balanced_predicted_cost_per_voice": predicted,
              "hash_predicted_cost_per_voice": hashed}

    def show() -> None:
        print()
        table(["variant", "batches", "padding eff.", "audio-s/s", "min..max", "audio-s"],
              [[n, len(variants[n]["batches"]), f"{variants[n]['real'] / variants[n]['padded']:.3f}",
                runs.cell(n, "audio_s_per_s", ".2f"), runs.cell(n, "audio_s_per_s", ".2f", "range"),
                f"{sum(variants[n]['audio'].values()):.1f}"] for n in names])
        print("\nbalanced mode, audio made per voice (s): "
              + ", ".join(f"{k} {made[k]:.1f}" for k in sorted(made)) + f"; {spread(made)}")
        print("balanced mode, predicted cost per voice (phoneme ids): "
              + ", ".join(f"{k} {predicted[k]}" for k in sorted(predicted)) + f"; {spread(predicted)}")
        print("hash mode, predicted cost per voice (phoneme ids):     "
              + ", ".join(f"{k} {hashed.get(k, 0)}" for k in sorted(predicted)) + f"; {spread(hashed)}")

    Report(args.json, "variety").emit(result, show)


if __name__ == "__main__":
    main()
