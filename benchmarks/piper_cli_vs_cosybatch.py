"""cosybatch vs piper's own CLI on the same sentences and voice, run alternately.

Both are timed end to end as a user runs them (process start, voice load, synthesis, writing
WAVs), on the same 100 sentences with the bundled en_US-joe-medium voice. Prints each tool's
audio-seconds per wall-second (median over rounds) and their ratio.

    python benchmarks/piper_cli_vs_cosybatch.py [--sentences 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import soundfile
from common import median, sentences, write_corpus

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
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentences", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    texts = sentences(args.sentences)
    model, _ = bundled_voice()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines = tmp / "lines.txt"
        lines.write_text("\n".join(texts) + "\n", encoding="utf-8")
        corpus = write_corpus(texts, tmp / "corpus.parquet")
        rates: dict[str, list[float]] = {"piper CLI": [], "cosybatch": []}
        for r in range(args.rounds):
            audio, wall = run_piper(model, lines, tmp / f"piper-{r}")
            rates["piper CLI"].append(audio / wall)
            print(f"round {r}: piper CLI  {audio:7.1f} audio-s in {wall:6.1f} s", flush=True)
            audio, wall = run_cosybatch(corpus, tmp / f"cosybatch-{r}")
            rates["cosybatch"].append(audio / wall)
            print(f"round {r}: cosybatch  {audio:7.1f} audio-s in {wall:6.1f} s", flush=True)
    print(f"\n{args.sentences} sentences, {args.rounds} rounds, audio-seconds per wall-second (median):")
    for name, values in rates.items():
        print(f"  {name:10s} {median(values):6.1f}")
    print(f"  ratio cosybatch / piper CLI: {median(rates['cosybatch']) / median(rates['piper CLI']):.2f}x")


if __name__ == "__main__":
    main()
