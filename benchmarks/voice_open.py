"""What opening a Piper voice costs a process: a two-row `cosybatch run` of the embedded voice in a
fresh process, with the edited graph (and, on the CPU, onnxruntime's optimization of it) read
from the cache, against the same run editing the graph in memory, as every process did before the
cache (its cache folder made unusable: a file where the folder would be), and against the cached
graph with every file hashed again (its `digests` folder made unusable the same way), as every
process did before file hashes were remembered across processes. Wall and CPU seconds of the whole
process, the variants taking turns round by round, medians.

    python benchmarks/voice_open.py [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Report, alternate, cli, parse, write_corpus

from cosybatch.cache import SETTLED_S

ROOT = Path(__file__).resolve().parent.parent


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    args = parse(cli(__doc__, rounds=5))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = write_corpus(["The quick brown fox jumps over the lazy dog.",
                               "A second row, to make a batch of two."], tmp / "c.parquet")
        blocked = tmp / "blocked"
        blocked.write_text("a file where the cache folder would be")
        rehashed = tmp / "rehashed"
        (rehashed / "cosybatch").mkdir(parents=True)
        (rehashed / "cosybatch" / "digests").write_text("a file where the digests folder would be")
        caches = {"edited in memory": str(blocked), "cached, hashed again": str(rehashed), "cached": str(tmp / "cache")}
        # Warm the caches once, untimed: the first run of a voice builds its cached files; the
        # second remembers the hashes of files the first had only just written.
        for i, name in enumerate(("cached, hashed again", "cached", "cached")):
            subprocess.run([sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(tmp / f"warm-{i}")],
                           env={**os.environ, "XDG_CACHE_HOME": caches[name]}, check=True, capture_output=True)
            time.sleep(SETTLED_S)  # files older than this are remembered

        def variant(name: str):
            def one(rnd: int) -> dict:
                before, start = cpu_of_children(), time.perf_counter()
                subprocess.run([sys.executable, "-m", "cosybatch", "run", str(corpus), "--out",
                                str(tmp / f"{name}-{rnd}".replace(" ", "-")), "--progress", "none"],
                               env={**os.environ, "XDG_CACHE_HOME": caches[name]}, check=True,
                               capture_output=True, cwd=ROOT)
                return {"wall_s": time.perf_counter() - start, "cpu_s": cpu_of_children() - before}
            return one

        runs = alternate({name: variant(name) for name in caches}, args.rounds, baseline="edited in memory")
    result = {"rounds": args.rounds, **runs.as_dict(["wall_s", "cpu_s"])}
    Report(args.json, "voice_open").emit(result, lambda: runs.table(
        [("wall s", "wall_s", ".2f"), ("cpu s", "cpu_s", ".2f"), ("wall x", "wall_s", ".3f", "ratio"),
         ("cpu x", "cpu_s", ".3f", "ratio")]))


if __name__ == "__main__":
    main()
