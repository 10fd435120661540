"""Which CPU settings make the Piper engine fastest here? Runs each setting alternately on the
same sentences and prints audio-seconds per wall-second (model load excluded), and each one's
ratio to cosybatch's CPU default (batch 1, one worker per core, one intra-op thread each, 1-D convs run as 2-D).
Batches of more than one piece run in two stages (the default for batches) unless a setting says otherwise.

    python benchmarks/cpu_settings.py [--sentences 64] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import Report, alternate, cli, parse, sentences, write_corpus

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
    ap = cli(__doc__, rounds=2, rows=64, aliases={"rows": ["--sentences"]},
             helps={"rows": "lines of examples/sentences.txt to synthesise"})
    args = parse(ap)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(sentences(args.rows), Path(tmp) / "c.parquet")

        def setting(k: int, overrides: dict):
            def once(rnd: int) -> dict:
                cfg = RunConfig.from_options(corpus=corpus, out=Path(tmp) / f"out-{rnd}-{k}", device="cpu",
                                             progress="none",
                                **overrides)
                s = run(cfg).stats
                return {"audio_s_per_s": s["audio_seconds"] / (s["wall_seconds"] - s["stage_seconds"]["load"])}
            return once

        runs = alternate({name: setting(k, o) for k, (name, o) in enumerate(SETTINGS.items())}, args.rounds)
    result = {"benchmark": "cpu_settings", "sentences": args.rows, **runs.as_dict()}
    Report(args.json, "cpu_settings").emit(result, lambda: runs.table(
        [("audio-s/s", "audio_s_per_s", ".1f"), ("min..max", "audio_s_per_s", ".1f", "range"),
         ("vs default", "audio_s_per_s", ".2f", "ratio")], first="setting"))


if __name__ == "__main__":
    main()
