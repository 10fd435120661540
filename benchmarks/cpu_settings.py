"""Which CPU settings make the Piper engine fastest here? Runs each setting alternately on the
same sentences and prints audio-seconds per wall-second (model load excluded), and each one's
ratio to cosybatch's CPU default (batch 1, one worker per core, one intra-op thread each, 1-D convs run as 2-D).
Batches of more than one piece run in two stages (the default for batches) unless a setting says otherwise.

    python benchmarks/cpu_settings.py [--sentences 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import median, sentences, write_corpus

from cosybatch.config import RunConfig, cpu_count
from cosybatch.run.local import run

SETTINGS = {
    "default (batch 1, workers=cores, threads 1)": dict(),
    "default without the conv 2-D rewrite": dict(engine_options={"conv2d": False}),
    "batch 1, 1 worker, threads=cores": dict(workers=1, threads=cpu_count()),
    "batch 1, 1 worker, 1 thread": dict(workers=1, threads=1),
    "sorted batch 4, workers=cores, threads 1": dict(batch_size=4, batch_budget=100000),
    "sorted batch 8, 1 worker, threads=cores": dict(batch_size=8, batch_budget=100000, workers=1, threads=cpu_count()),
    # Batches of several pieces run in two stages unless told otherwise (see the README).
    "batch 32, two stages, workers=cores, threads 1": dict(batch_size=32, batch_budget=32 * 256),
    "batch 32, one graph, workers=cores, threads 1": dict(batch_size=32, batch_budget=32 * 256,
                                                         engine_options={"two_stage": False}),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentences", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(sentences(args.sentences), Path(tmp) / "c.parquet")
        rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for r in range(args.rounds):
            for k, (name, overrides) in enumerate(SETTINGS.items()):
                cfg = RunConfig(corpus=corpus, out=Path(tmp) / f"out-{r}-{k}", device="cpu",
                                progress="none", **overrides)
                s = run(cfg).stats
                rates[name].append(s["audio_seconds"] / (s["wall_seconds"] - s["stage_seconds"]["load"]))
        base = median(rates[next(iter(SETTINGS))])
        print(f"{'setting':48s} {'audio-s/s':>10s} {'vs default':>10s}")
        for name, values in rates.items():
            print(f"{name:48s} {median(values):10.1f} {median(values) / base:10.2f}x")


if __name__ == "__main__":
    main()
