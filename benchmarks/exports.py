"""What an export costs: time and disk of the NeMo and Lhotse exports that point into the tar
shards against the copying ones (`cosybatch export --copy`), and, for reference, Lhotse Shar as
lhotse's own writer makes it from the copying export's cuts (a copy of every clip, in Shar's own
tars; the time and disk of that step alone),
side by side; then what reading every clip back through Lhotse's `load_audio()` costs in each form
(in a fresh reader process with lhotse only, as a training job's would be).

    python benchmarks/exports.py                      # runs the main job (examples/corpus.parquet, ~15 s)
    python benchmarks/exports.py --folder out/corpus  # an output folder you already have

Each export is timed best of --repeat (--rounds), cold: its folder (and exports/wavs for a copying
one) removed first; the four exports take turns within every round. Disk is what the export added
(allocated blocks, as `du` counts them; NeMo's audio_N.tar links count as the links, not the shards
they point to).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Report, alternate, cli, parse, table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cosybatch.store.exports import export  # noqa: E402


def disk(*paths: Path) -> int:
    """Allocated bytes under paths, links counted as links."""
    total = 0
    for path in paths:
        for p in [path, *path.rglob("*")] if path.exists() else ():
            total += p.lstat().st_blocks * 512
    return total


def timed_export(folder: Path, fmt: str, copy: bool) -> dict:
    """One cold export: {"seconds", "disk_bytes"}."""
    shutil.rmtree(folder / "exports", ignore_errors=True)
    t = time.perf_counter()
    export(folder, fmt, copy=copy)
    seconds = time.perf_counter() - t
    added = [folder / "exports" / fmt] + ([folder / "exports" / "wavs"] if copy else [])
    return {"seconds": seconds, "disk_bytes": disk(*added)}


def cuts_of(folder: Path):
    import lhotse

    lhotse_dir = folder / "exports" / "lhotse"
    return lhotse.CutSet.from_manifests(recordings=lhotse.load_manifest(lhotse_dir / "recordings.jsonl.gz"),
                                        supervisions=lhotse.load_manifest(lhotse_dir / "supervisions.jsonl.gz"))


# A reader as a training job would be: a fresh interpreter with lhotse only; prints the seconds.
READER = r"""
import sys, time, lhotse
from pathlib import Path
d = Path(sys.argv[1])
cuts = lhotse.CutSet.from_manifests(recordings=lhotse.load_manifest(d / "recordings.jsonl.gz"),
                                    supervisions=lhotse.load_manifest(d / "supervisions.jsonl.gz"))
t = time.perf_counter()
for cut in cuts:
    cut.load_audio()
print(time.perf_counter() - t)
"""


def read_all(folder: Path) -> float:
    """Seconds to load_audio() every cut of the Lhotse export, in a fresh reader process."""
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", READER, str(folder / "exports" / "lhotse")],
                          check=True, capture_output=True, text=True)
    return float(proc.stdout.split()[-1])


def main() -> None:
    ap = cli(__doc__, rounds=3, aliases={"rounds": ["--repeat"]},
             helps={"rounds": "timings of each export, the four taking turns; the best counts"})
    ap.add_argument("--folder", type=Path, help="a finished output folder (default: run the main job)")
    args = parse(ap)
    tmp = Path(tempfile.mkdtemp(prefix="cosybatch-exports-"))
    try:
        if args.folder is None:
            folder = tmp / "corpus"
            subprocess.run([sys.executable, "-m", "cosybatch", "run", str(ROOT / "examples" / "corpus.parquet"),
                            "--out", str(folder), "--progress", "none"], check=True, stdout=subprocess.DEVNULL)
        else:
            folder = tmp / args.folder.name  # a copy: the benchmark removes and rewrites exports/
            shutil.copytree(args.folder, folder, symlinks=True, ignore=shutil.ignore_patterns("exports"))
        shards = sorted(folder.glob("shard-*.tar")) + sorted(folder.glob("part-*/shard-*.tar"))
        items = sum(1 for _ in cuts_of_manifest(folder))
        tar_mib = sum(s.stat().st_size for s in shards) / 2**20
        print(f"{folder.name}: {items} clips in {len(shards)} shards, {tar_mib:.1f} MiB of tar; best of {args.rounds}")

        def variant(fmt: str, copy: bool):
            def once(rnd: int) -> dict:
                figures = timed_export(folder, fmt, copy)
                if fmt == "lhotse" and rnd == 0:  # reading back: once, after the first export of each form
                    figures["read_s"] = read_all(folder)
                return figures
            return once

        runs = alternate({f"{fmt} {'--copy (loose WAVs)' if copy else '(points into the shards)'}": variant(fmt, copy)
                          for fmt in ("lhotse", "nemo") for copy in (False, True)}, args.rounds)
        rows = [(name, min(runs.values(name, "seconds")), runs.values(name, "disk_bytes")[-1],
                 (runs.values(name, "read_s") or [None])[0]) for name in runs.names]
        # Lhotse Shar, written by lhotse from the copying export's cuts (its Shar writer asks each
        # recording's source format, which a command source has none of): its own recording tars.
        shutil.rmtree(folder / "exports", ignore_errors=True)
        export(folder, "lhotse", copy=True)
        cuts = cuts_of(folder)
        shar = folder / "exports" / "shar"
        shar.mkdir()
        t = time.perf_counter()
        cuts.to_shar(shar, fields={"recording": "wav"}, shard_size=1000)
        shar_s = time.perf_counter() - t
        rows.append(("lhotse Shar (lhotse's writer, a copy)", shar_s, disk(shar), read_shar(shar)))
        result = {"benchmark": "exports", "folder": folder.name, "clips": items, "shards": len(shards),
                  "tar_mib": round(tar_mib, 2), "rounds": args.rounds,
                  "exports": {name: {"best_s": round(seconds, 4), "disk_mib": round(size / 2**20, 3),
                                     "read_all_s": None if read is None else round(read, 3)}
                              for name, seconds, size, read in rows},
                  "timings": runs.as_dict(["seconds"])}
        Report(args.json, "exports").emit(result, lambda: table(
            ["export", "time s", "disk MiB", "read all s"],
            [[name, f"{seconds:.3f}", f"{size / 2**20:.2f}", "" if read is None else f"{read:.3f}"]
             for name, seconds, size, read in rows]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_shar(shar: Path) -> float:
    code = ("import sys, time, lhotse\nt = time.perf_counter()\n"
            "for cut in lhotse.CutSet.from_shar(in_dir=sys.argv[1]):\n    cut.load_audio()\n"
            "print(time.perf_counter() - t)\n")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code, str(shar)], check=True, capture_output=True,
                          text=True)
    return float(proc.stdout.split()[-1])


def cuts_of_manifest(folder: Path):
    import pyarrow.parquet as pq

    manifests = [folder / "manifest.parquet"] if (folder / "manifest.parquet").exists() else sorted(
        folder.glob("part-*/manifest.parquet"))
    for m in manifests:
        yield from pq.read_table(m, columns=["id"]).column("id").to_pylist()


if __name__ == "__main__":
    main()
