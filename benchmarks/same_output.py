"""Do two checkouts write the same dataset? Runs the same five jobs with each and compares the bytes
of every member of every shard (WAV and KEY.json), which is what a refactor must leave unchanged.

    python benchmarks/same_output.py --before /path/to/old/checkout [--after .] [--audio-only] [--json PATH]

--audio-only compares the WAV members alone, for a change that adds fields to KEY.json on purpose.

The jobs: the main Piper job on examples/corpus.parquet, a Piper two-stage batch-32 job on 40 rows,
and a tiny random-weight CosyVoice-300M-SFT, CosyVoice2 and Fun-CosyVoice3 job on 6 rows each. The
tiny folders are written once, by the --after checkout, so both checkouts read the same weights.
Whole-tar hashes are not compared: tar headers carry the time the member was written.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from common import ROOT, Report, cli, parse, table


def member_digest(out: Path, audio_only: bool = False) -> tuple[str, int]:
    """sha256 over the sorted (member name, sha256 of its bytes) of every shard; the member count."""
    rows = []
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                if audio_only and not m.name.endswith(".wav"):
                    continue
                rows.append((m.name, hashlib.sha256(tar.extractfile(m).read()).hexdigest()))
    rows.sort()
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest(), len(rows)


def jobs(work: Path, models: Path) -> dict[str, list[str]]:
    examples = ROOT / "examples"
    rows = (examples / "corpus.jsonl").read_text().splitlines()
    (work / "forty.jsonl").write_text("\n".join(rows[:40]) + "\n")
    (work / "six.jsonl").write_text("\n".join(rows[:6]) + "\n")
    six = str(work / "six.jsonl")
    cosy = ["--engine", "cosyvoice"]
    return {
        "piper": [str(examples / "corpus.parquet")],
        "piper-batch32": [str(work / "forty.jsonl"), "--batch-size", "32"],
        "cosyvoice-300m-sft": [six, *cosy, "--model", str(models / "CosyVoice-300M-SFT-tiny"), "--speaker", "alice"],
        "cosyvoice2": [six, *cosy, "--model", str(models / "CosyVoice2-tiny"), "--speaker", "alice"],
        "cosyvoice3": [six, *cosy, "--model", str(models / "Fun-CosyVoice3-0.5B-tiny"),
                       "--prompt-wav", str(examples / "prompt-joe.wav"), "--prompt-text", "Hello there"],
    }


def run_all(checkout: Path, work: Path, models: Path, label: str, audio_only: bool) -> dict[str, tuple[str, int]]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    found = {}
    for name, args in jobs(work, models).items():
        out = work / label / name
        proc = subprocess.run([sys.executable, "-m", "cosybatch", "run", *args, "--out", str(out)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{label} {name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        found[name] = member_digest(out, audio_only)
    return found


def main() -> None:
    ap = cli(__doc__)
    ap.add_argument("--before", type=Path, required=True, help="the checkout to compare against")
    ap.add_argument("--after", type=Path, default=ROOT, help="the checkout under test (default: this one)")
    ap.add_argument("--audio-only", action="store_true", help="compare the WAV members only")
    args = parse(ap)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = work / "models"
        env = {**os.environ, "PYTHONPATH": str(args.after.resolve())}
        for family, folder, extra in [("v1", "CosyVoice-300M-SFT-tiny", ["--variant", "sft"]),
                                      ("v2", "CosyVoice2-tiny", []), ("v3", "Fun-CosyVoice3-0.5B-tiny", [])]:
            subprocess.run([sys.executable, "-m", "cosybatch.cosyvoice.tiny", "--family", family, *extra,
                            str(models / folder)], env=env, check=True, capture_output=True)
        before = run_all(args.before.resolve(), work, models, "before", args.audio_only)
        after = run_all(args.after.resolve(), work, models, "after", args.audio_only)
    same = all(before[name] == after[name] for name in before)
    result = {"benchmark": "same_output", "before": str(args.before.resolve()), "after": str(args.after.resolve()),
              "audio_only": args.audio_only, "same": same,
              "jobs": {name: {"same": before[name] == after[name], "members": after[name][1],
                              "before_sha256": before[name][0], "after_sha256": after[name][0]} for name in before}}
    Report(args.json, "same_output").emit(result, lambda: table(
        ["job", "", "members", "digest"],
        [[name, "same" if before[name] == after[name] else "DIFFERENT", after[name][1], after[name][0]]
         for name in before]))
    sys.exit(0 if same else 1)

if __name__ == "__main__":
    main()
