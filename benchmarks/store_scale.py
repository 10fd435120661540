"""What reading what a repair keeps costs on a big folder: the end-of-run size check and a resume's
open (journal scan, repair, resume state) on a synthetic folder of N committed items, timed with
this tree's code and with an earlier commit's, side by side in one run.

    python benchmarks/store_scale.py                  # 100,000 items, against commit 7e76346
    python benchmarks/store_scale.py --items 20000 --before-commit HEAD~1

The folder is written the way a run writes it (ShardWriter shards of --shard-items items, one
journal line per batch of --batch items, a manifest), with tiny clips so that the figure is the
per-item cost, not the disk's read rate; every timing runs in a fresh interpreter with a cold
import, best of --repeat (--rounds), the two trees taking turns. The earlier code comes from `git
archive` of that commit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import ROOT, Report, alternate, cli, parse, table

# Runs in a fresh interpreter with PYTHONPATH set to one tree; prints {"open_s", "check_s"}.
TIMER = r"""
import json, sys, time
from pathlib import Path
from cosybatch.store.checkpoint import Journal, OutputDir
from cosybatch.store.repair import check_sizes, repair
out = OutputDir(Path(sys.argv[1]))
t = time.perf_counter()
journal = Journal(out.journal_path)
result = repair(out, journal)
ledger = result[1] if isinstance(result, tuple) else result.ledger
notes = result[0] if isinstance(result, tuple) else result.notes
state = out.resume_state(ledger)
journal.close()
open_s = time.perf_counter() - t
t = time.perf_counter()
problems = check_sizes(out)
check_s = time.perf_counter() - t
assert not notes and not problems and state.items == int(sys.argv[2]), (notes[:3], problems[:3], state.items)
import cosybatch
print(json.dumps({"open_s": open_s, "check_s": check_s, "package": cosybatch.__file__}))
"""


def build(root: Path, items: int, shard_items: int, batch: int) -> None:
    """A finished folder of `items` committed items, as a run leaves it."""
    import hashlib

    from cosybatch.store.audio import encode
    from cosybatch.store.checkpoint import OutputDir, jsonl_bytes
    from cosybatch.store.shards import ShardWriter, item_key, pcm16

    out = OutputDir(root)
    out.state.mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    for index in range(-(-items // shard_items)):
        writer = ShardWriter(root, index)
        first = index * shard_items
        ids = [f"s{i:07d}" for i in range(first, min(first + shard_items, items))]
        for at in range(0, len(ids), batch):
            records = []
            for item_id in ids[at:at + batch]:
                audio = rng.uniform(-0.5, 0.5, 160).astype(np.float32)  # 10 ms at 16 kHz
                wav = encode(pcm16(audio), 16000)
                digest = hashlib.sha256(wav).hexdigest()
                meta = {"id": item_id, "text": "Synthetic.", "duration": 0.01, "sample_rate": 16000,
                        "num_samples": 160, "voice": "tone", "engine": "tone", "seed": 0, "row": int(item_id[1:]),
                        "settings": {"engine": "tone"}, "wav_sha256": digest, "source": "0" * 16}
                key = item_key(item_id)
                writer.add(key, {"wav": wav, "json": json.dumps(meta).encode()}, mtime=0)
                records.append({"id": item_id, "key": key, "row": meta["row"], "text": meta["text"],
                                "voice": "tone", "duration_s": 0.01, "num_samples": 160, "sample_rate": 16000,
                                "source": meta["source"], "wav_sha256": digest})
            lines.append({"t": "items", "ts": 0.0, "shard": index, "end": writer.offset, "items": records})
        writer.close()
        lines.append({"t": "closed", "shard": index, "items": len(ids)})
    out.journal_path.write_bytes(jsonl_bytes(lines))
    out.write_manifest()


def before_tree(commit: str, into: Path) -> Path:
    """The package as it was at `commit` (git archive), for PYTHONPATH."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "cosybatch"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def timing(tree: Path, folder: Path, items: int) -> dict:
    """One cold timing with `tree`'s code: {"open_s", "check_s"}."""
    # cwd=tree: `python -c` puts the working directory first on sys.path.
    proc = subprocess.run([sys.executable, "-c", TIMER, str(folder), str(items)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, cwd=tree)
    if proc.returncode:
        raise SystemExit(f"timing with {tree} failed:\n{proc.stderr}")
    run = json.loads(proc.stdout.splitlines()[-1])
    if not Path(run.pop("package")).is_relative_to(tree):
        raise SystemExit(f"the timing imported cosybatch from outside {tree}")
    return run


def main() -> None:
    ap = cli(__doc__, rounds=3, aliases={"rounds": ["--repeat"]},
             helps={"rounds": "timings of each tree, the two taking turns; the best counts"})
    ap.add_argument("--items", type=int, default=100_000, help="committed items in the synthetic folder")
    ap.add_argument("--shard-items", type=int, default=1000, help="items per shard")
    ap.add_argument("--batch", type=int, default=16, help="items per journal line")
    ap.add_argument("--before-commit", default="7e76346", help="the earlier commit to compare with")
    args = parse(ap)
    with tempfile.TemporaryDirectory(prefix="store-scale-") as tmp:
        tmp_path = Path(tmp)
        folder = tmp_path / "out"
        t = time.perf_counter()
        build(folder, args.items, args.shard_items, args.batch)
        size_mb = sum(p.stat().st_size for p in folder.glob("shard-*.tar")) / 1e6
        print(f"built {args.items} items in {args.items // args.shard_items} shards ({size_mb:.0f} MB) "
              f"in {time.perf_counter() - t:.1f} s")
        (tmp_path / "before").mkdir()
        old = before_tree(args.before_commit, tmp_path / "before")
        runs = alternate({"before": lambda rnd: timing(old, folder, args.items),
                          "after": lambda rnd: timing(ROOT, folder, args.items)}, args.rounds, baseline="before")
    best = {name: {key: min(runs.values(name, key)) for key in ("open_s", "check_s")} for name in runs.names}
    result = {"benchmark": "store_scale", "items": args.items, "before_commit": args.before_commit, "best": best,
              "after_vs_before": {k: best["after"][k] / best["before"][k] for k in ("open_s", "check_s")},
              **runs.as_dict()}

    def show() -> None:
        table(["", f"before ({args.before_commit})", "after", "ratio"],
              [[label, f"{best['before'][key]:.3f}", f"{best['after'][key]:.3f}",
                f"{best['after'][key] / best['before'][key]:.2f}"]
               for key, label in (("open_s", "resume open (s)"), ("check_s", "end-of-run check (s)"))])

    Report(args.json, "store_scale").emit(result, show)


if __name__ == "__main__":
    main()
