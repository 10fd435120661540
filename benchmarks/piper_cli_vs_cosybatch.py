"""cosybatch vs piper's own CLI on the same sentences and voice, run alternately.

Both are timed end to end as a user runs them (process start, voice load, synthesis, writing
WAVs), on the same 100 sentences with the bundled en_US-joe-medium voice. Prints each tool's
audio-seconds per wall-second (median over rounds) and their ratio.

    python benchmarks/piper_cli_vs_cosybatch.py [--sentences 100] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import soundfile
from common import Report, alternate, cli, parse, sentences, write_corpus

from cosybatch.engines.piper.voice import bundled_voice


def run_piper(model: Path, lines: Path, out: Path) -> tuple[float, float]:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "piper", "-m", str(model), "-i", str(lines), "-d", str(out)],
                   check=True, capture_output=True)
    wall = time.perf_counter() - t
    audio = sum(soundfile.info(str(p)).duration for p in out.glob("*.wav"))
    return audio, wall


def run_cosybatch(corpus: Path, out: Path) -> tuple[float, float]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out),
                           "--progress", "none"], check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t
    return json.loads(proc.stdout.strip().splitlines()[-1])["audio_seconds"], wall


def main() -> None:
    ap = cli(__doc__, rounds=3, rows=100, aliases={"rows": ["--sentences"]},
             helps={"rows": "lines of examples/sentences.txt to synthesise"})
    args = parse(ap)
    texts = sentences(args.rows)
    model, _ = bundled_voice()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines = tmp / "lines.txt"
        lines.write_text("\n".join(texts) + "\n", encoding="utf-8")
        corpus = write_corpus(texts, tmp / "corpus.parquet")
        tools = {"piper CLI": lambda rnd: run_piper(model, lines, tmp / f"piper-{rnd}"),
                 "cosybatch": lambda rnd: run_cosybatch(corpus, tmp / f"cosybatch-{rnd}")}

        def timed(tool):
            def once(rnd: int) -> dict:
                audio, wall = tools[tool](rnd)
                return {"audio_s": audio, "wall_s": wall, "audio_s_per_s": audio / wall}
            return once

        def say(rnd: int, name: str, f: dict) -> None:
            print(f"round {rnd}: {name:10s} {f['audio_s']:7.1f} audio-s in {f['wall_s']:6.1f} s", flush=True)

        runs = alternate({name: timed(name) for name in tools}, args.rounds, baseline="piper CLI", say=say)
    result = {"benchmark": "piper_cli_vs_cosybatch", "sentences": args.rows, **runs.as_dict()}

    def show() -> None:
        print(f"\n{args.rows} sentences, {args.rounds} rounds, audio-seconds per wall-second (median):")
        runs.table([("audio-s/s", "audio_s_per_s", ".1f"), ("min..max", "audio_s_per_s", ".1f", "range"),
                    ("vs piper CLI", "audio_s_per_s", ".2f", "ratio")], first="tool")
        print(f"  ratio cosybatch / piper CLI: {runs.ratio('cosybatch', 'audio_s_per_s'):.2f}x")

    Report(args.json, "piper_cli_vs_cosybatch").emit(result, show)


if __name__ == "__main__":
    main()
