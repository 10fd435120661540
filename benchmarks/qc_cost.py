"""What the quality gate costs, side by side in one run: `cosybatch run` of the main job's corpus
with --qc off, --qc signals, --qc asr (ASR on the rows the signals flag) and --qc asr
--qc-asr-rows all, each into its own fresh --out, the variants taking turns within every round
(the order rotating from round to round), so a noisy machine slows them alike.

Each run is a whole process, as a user runs it (start-up and model loading included). Prints per
variant the median wall time and audio-seconds per wall-second over the rounds, the ratio of its
median wall time to --qc off's and the median of the per-round ratios, and what the gate did
(rows flagged, transcribed, failed), and the run's own account of the gate's time (stats.json
stage_seconds.qc: measuring, transcribing and judging, on the writer thread) as a share of --qc
off's wall time: on a shared machine whole-process times vary by more than the few per cent asked
about, the in-process figure does not. Ends with one JSON line.

    python benchmarks/qc_cost.py [--corpus examples/corpus.parquet] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, median

VARIANTS = {
    "off": ["--qc", "off"],
    "signals": ["--qc", "signals"],
    "asr-flagged": ["--qc", "asr", "--qc-asr-rows", "flagged"],
    "asr-all": ["--qc", "asr", "--qc-asr-rows", "all"],
}
GOALS = {"signals": 1.03, "asr-flagged": 1.10}


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=ROOT / "examples" / "corpus.parquet")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    names = list(VARIANTS)
    walls: dict[str, list[float]] = {n: [] for n in names}
    rates: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    qc_s: dict[str, list[float]] = {n: [] for n in names}
    gate: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="qc-cost-") as tmp:
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            this: dict[str, float] = {}
            for name in order:
                out = Path(tmp) / f"{name}-{rnd}"
                wall, summary, qc = run_once(args.corpus, out, args.threads, VARIANTS[name])
                shutil.rmtree(out)
                if summary.get("status") != "complete":
                    raise SystemExit(f"{name}: {summary}")
                this[name] = wall
                walls[name].append(wall)
                rates[name].append(summary["audio_seconds"] / wall)
                qc_s[name].append(qc["qc_s"])
                gate[name] = {k: qc.get(k) for k in ("flagged", "transcribed", "failed") if k in qc}
                gate[name]["items_done"] = summary["items_done"]
                print(f"round {rnd} {name:12s} {wall:6.1f} s  {summary['audio_seconds'] / wall:6.2f} audio-s/s  "
                      f"qc stage {qc['qc_s']:5.1f} s  {gate[name]}", flush=True)
            for name in names:
                ratios[name].append(this[name] / this["off"])

    base = median(walls["off"])
    print(f"\n{args.rounds} rounds, {args.threads} thread(s); corpus {args.corpus}")
    print(f"{'variant':12s} {'median wall s':>13s} {'audio-s/s':>10s} {'wall / off':>10s} {'per-round':>10s} "
          f"{'qc stage s':>10s} {'qc / off':>9s}  gate")
    result = {}
    for name in names:
        ratio = median(walls[name]) / base
        result[name] = {"median_wall_s": round(median(walls[name]), 2), "audio_s_per_s": round(median(rates[name]), 2),
                        "ratio_to_off": round(ratio, 4), "median_round_ratio": round(median(ratios[name]), 4),
                        "qc_stage_s": round(median(qc_s[name]), 3),
                        "qc_share_of_off": round(median(qc_s[name]) / base, 4),
                        "walls": [round(w, 2) for w in walls[name]], **gate[name]}
        print(f"{name:12s} {median(walls[name]):13.1f} {median(rates[name]):10.2f} {ratio:10.3f} "
              f"{median(ratios[name]):10.3f} {median(qc_s[name]):10.2f} {median(qc_s[name]) / base:9.3f}  {gate[name]}")
    goals = {name: result[name]["median_round_ratio"] <= limit for name, limit in GOALS.items()}
    goals.update({f"{name} (qc stage)": 1 + result[name]["qc_share_of_off"] <= limit for name, limit in GOALS.items()})
    print(f"goals (signals <= 1.03, asr-flagged <= 1.10; by the per-round wall ratio, and by the qc stage's share): "
          f"{goals}")
    print(json.dumps({"benchmark": "qc_cost", "rounds": args.rounds, "threads": args.threads, "variants": result,
                      "goals": goals}))


if __name__ == "__main__":
    main()
