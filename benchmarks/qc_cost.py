"""What the quality gate costs, side by side in one run: `cosybatch run` of the main job's corpus
with --qc off, --qc signals, --qc asr --qc-asr-rows flagged (Whisper hears the rows the signals
flag) and --qc asr (every row heard, the default rows), each into its own fresh --out, the
variants taking turns within every round (the order rotating from round to round), so a noisy
machine slows them alike.

Each run is a whole process, as a user runs it (start-up and model loading included). Prints per
variant the median wall time and audio-seconds per wall-second over the rounds, the ratio of its
median wall time to --qc off's and the median of the per-round ratios, and what the gate did
(rows flagged, transcribed, failed), and the run's own account of the gate's time (stats.json
stage_seconds.qc: measuring, transcribing and judging, on the writer thread) as a share of --qc
off's wall time: on a shared machine whole-process times vary by more than the few per cent asked
about, the in-process figure does not. Ends with one JSON line.

    python benchmarks/qc_cost.py [--corpus examples/corpus.parquet] [--rounds 3] [--threads 1] [--json PATH]
    python benchmarks/qc_cost.py --variants signals,asr-all    # off, signals and every clip heard
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, Report, alternate, cli, median, parse, table

VARIANTS = {
    "off": ["--qc", "off"],
    "signals": ["--qc", "signals"],
    "asr-flagged": ["--qc", "asr", "--qc-asr-rows", "flagged"],
    "asr-all": ["--qc", "asr", "--qc-asr-rows", "all"],
}
GOALS = {"signals": 1.03, "asr-flagged": 1.10, "asr-all": 1.25}


def run_once(corpus: Path, out: Path, threads: int, extra: list[str]) -> tuple[float, dict, dict]:
    cmd = [sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out), "--threads", str(threads),
           *extra]
    t = time.perf_counter()
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    stats = json.loads((out / "stats.json").read_text())
    qc = dict(stats.get("qc") or {})
    qc["qc_s"] = (stats.get("stage_seconds") or {}).get("qc", 0.0)
    return wall, summary, qc


def main() -> None:
    ap = cli(__doc__, rounds=3, threads=1, helps={"threads": "--threads of every `cosybatch run`"})
    ap.add_argument("--corpus", type=Path, default=ROOT / "examples" / "corpus.parquet", help="the corpus to run")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated variants to run (off, the baseline, is always among them)")
    args = parse(ap)

    names = ["off", *[n for n in args.variants.split(",") if n and n != "off"]]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    gate: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="qc-cost-") as tmp:

        def variant(name: str):
            def once(rnd: int) -> dict:
                out = Path(tmp) / f"{name}-{rnd}"
                wall, summary, qc = run_once(args.corpus, out, args.threads, VARIANTS[name])
                shutil.rmtree(out)
                if summary.get("status") != "complete":
                    raise SystemExit(f"{name}: {summary}")
                gate[name] = {k: qc.get(k) for k in ("flagged", "transcribed", "failed") if k in qc}
                gate[name]["items_done"] = summary["items_done"]
                print(f"round {rnd} {name:12s} {wall:6.1f} s  {summary['audio_seconds'] / wall:6.2f} audio-s/s  "
                      f"qc stage {qc['qc_s']:5.1f} s  {gate[name]}", flush=True)
                return {"wall_s": wall, "audio_s_per_s": summary["audio_seconds"] / wall, "qc_s": qc["qc_s"]}
            return once

        runs = alternate({name: variant(name) for name in names}, args.rounds, baseline="off")

    base = runs.median("off", "wall_s")
    result = {}
    for name in names:
        qc_s = runs.median(name, "qc_s")
        result[name] = {"median_wall_s": round(runs.median(name, "wall_s"), 2),
                        "audio_s_per_s": round(runs.median(name, "audio_s_per_s"), 2),
                        "ratio_to_off": round(runs.ratio(name, "wall_s"), 4),
                        "median_round_ratio": round(median(runs.round_ratios(name, "wall_s")), 4),
                        "qc_stage_s": round(qc_s, 3), "qc_share_of_off": round(qc_s / base, 4),
                        "walls": [round(w, 2) for w in runs.values(name, "wall_s")],
                        "wall_range_s": [round(min(runs.values(name, "wall_s")), 2),
                                         round(max(runs.values(name, "wall_s")), 2)], **gate[name]}
    goals = {name: result[name]["median_round_ratio"] <= limit for name, limit in GOALS.items() if name in result}
    goals.update({f"{name} (qc stage)": 1 + result[name]["qc_share_of_off"] <= limit for name, limit in GOALS.items()
                  if name in result})
    line = {"benchmark": "qc_cost", "rounds": args.rounds, "threads": args.threads, "variants": result,
            "goals": goals}

    def show() -> None:
        print(f"\n{args.rounds} rounds, {args.threads} thread(s); corpus {args.corpus}")
        table(["variant", "median wall s", "min..max", "audio-s/s", "wall / off", "per-round", "qc stage s",
               "qc / off", "gate"],
              [[n, f"{runs.median(n, 'wall_s'):.1f}", runs.cell(n, "wall_s", ".1f", "range"),
                f"{runs.median(n, 'audio_s_per_s'):.2f}", f"{runs.ratio(n, 'wall_s'):.3f}",
                f"{median(runs.round_ratios(n, 'wall_s')):.3f}", f"{runs.median(n, 'qc_s'):.2f}",
                f"{result[n]['qc_share_of_off']:.3f}", str(gate[n])] for n in names], left=(0, 8))
        print(f"goals (signals <= 1.03, asr-flagged <= 1.10, asr-all <= 1.25; by the per-round wall ratio, and by "
              f"the qc stage's share): {goals}")
        print(json.dumps(line))

    Report(args.json, "qc_cost").emit(line, show)


if __name__ == "__main__":
    main()
