"""`run --plan-only`'s memory over a long corpus: the resident set (RSS, which counts native memory
that tracemalloc does not see) every --every rows of a generated JSONL of --rows rows, read and
planned with the default engine and voice, in a fresh interpreter (tracemalloc off).

    python benchmarks/plan_memory.py                    # 200,000 rows, RSS every 10,000
    python benchmarks/plan_memory.py --rows 20000 --every 2000 --engine tone

The texts are examples/sentences.txt's lines in turn, each with a made-up word, so no two rows
are alike (a cache keyed by text or word would show). The docs promise one window's memory: the
figure to read is `growth_mb`, the RSS after the last checkpoint minus that at the first.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, SENTENCES, Report, cli, parse, table

# Runs in the fresh interpreter: plans the corpus, printing {"rows": N, "rss_mb": M} every N rows.
PLANNER = r"""
import json, sys
from pathlib import Path
from cosybatch.config import RunConfig
from cosybatch.run import line
from cosybatch.run.forecast import plan_only

corpus, out, engine, every = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmRSS"))

admit, seen = line.Admission.admit, [0]
def counting(self, row):
    seen[0] += 1
    if seen[0] % every == 0:
        print(json.dumps({"rows": seen[0], "rss_mb": round(rss_mb(), 1)}), flush=True)
    return admit(self, row)
line.Admission.admit = counting
plan = plan_only(RunConfig.from_options(corpus=corpus, out=out, engine=engine, progress="none"))["plan"]
print(json.dumps({"rows": plan["rows"], "rss_mb": round(rss_mb(), 1), "done": True}), flush=True)
"""


def write_corpus(path: Path, rows: int, seed: int) -> Path:
    rnd = random.Random(seed)
    lines = [x.strip() for x in SENTENCES.read_text(encoding="utf-8").splitlines() if x.strip()]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            word = "".join(rnd.choice("bcdfghklmnprstvz") + rnd.choice("aeiou") for _ in range(3))
            f.write(json.dumps({"id": f"r{i}", "text": f"{lines[i % len(lines)]} The {word} said so."}) + "\n")
    return path


def main() -> None:
    ap = cli(__doc__, rows=200_000, seed=0)
    ap.add_argument("--every", type=int, default=10_000, help="rows between two RSS checkpoints")
    ap.add_argument("--engine", default="piper", help="the engine whose preparation is planned")
    args = parse(ap)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp) / "c.jsonl", args.rows, args.seed)
        proc = subprocess.run([sys.executable, "-c", PLANNER, str(corpus), str(Path(tmp) / "out"), args.engine,
                               str(args.every)], capture_output=True, text=True, cwd=ROOT,
                              env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    points = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    marks = [p for p in points if not p.get("done")]
    result = {"rows": args.rows, "engine": args.engine, "checkpoints": points,
              "growth_mb": round(marks[-1]["rss_mb"] - marks[0]["rss_mb"], 1) if len(marks) > 1 else None,
              "growth_kb_per_row": (round(1024 * (marks[-1]["rss_mb"] - marks[0]["rss_mb"])
                                          / (marks[-1]["rows"] - marks[0]["rows"]), 3) if len(marks) > 1 else None)}
    Report(args.json, "plan_memory").emit(result, lambda: (
        table(["rows", "RSS MB"], [(p["rows"], p["rss_mb"]) for p in points]),
        print(f"growth {result['growth_mb']} MB between the first and last checkpoint "
              f"({result['growth_kb_per_row']} KB a row)")))


if __name__ == "__main__":
    main()
