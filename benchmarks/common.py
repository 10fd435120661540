"""The benchmark harness: every script under benchmarks/ takes its command line, its alternating
loop, its figures (medians with min and max, ratios to a named baseline variant), its printed table
and its JSON from here; plus the corpus helpers (examples/sentences.txt, a Parquet corpus).

Standard library only at module level (pyarrow is imported inside write_corpus): gpu_throughput.py
and its workers import this on the GPU image, which has no project install and no soundfile,
faster-whisper or ctranslate2 (tests/ops/test_gpu_benchmark.py). Not imported by the package or the
tests' fixtures.

A timing script, in short:

    ap = cli(__doc__, rounds=3, threads=1)            # --help, --rounds, --threads, --json [PATH]
    ap.add_argument("--corpus", type=Path, help="...")
    args = parse(ap)                                  # refuses an option without help
    runs = alternate({"off": lambda rnd: {"wall_s": ...}, "on": ...}, args.rounds, baseline="off")
    Report(args.json, "qc_cost").emit(runs.as_dict(), lambda: runs.table([("wall s", "wall_s", ".1f")]))

Variants take turns within every round, the order rotating from round to round (AB BA AB ... for
two), so a noisy machine slows them alike and their ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = ROOT / "examples" / "sentences.txt"


# -- corpus helpers ------------------------------------------------------------------------------
def sentences(n: int) -> list[str]:
    lines = [line.strip() for line in SENTENCES.read_text(encoding="utf-8").splitlines() if line.strip()]
    if n > len(lines):
        raise SystemExit(f"{SENTENCES} has {len(lines)} lines, fewer than {n}")
    return lines[:n]


def write_corpus(texts: list[str], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [f"s{i:05d}" for i in range(len(texts))], "text": texts}), path)
    return path


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


# -- the command line ----------------------------------------------------------------------------
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written; each option's default appended to its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and "%(default)" not in text and action.default not in (None, False,
                                                                                          argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


SHARED_HELP = {
    "rounds": "rounds; every variant runs once per round, the order rotating from round to round",
    "rows": "rows (sentences) of the corpus to use",
    "seed": "random seed",
    "threads": "intra-op threads (torch and onnxruntime)",
    "device": "device to run on (cpu, cuda)",
}
JSON_HELP = ("with PATH: also write the results as JSON there (a .json file, or a folder to write {name}.json "
             "in); alone: print them as one JSON object instead of the table")


def cli(doc: str | None, *, rounds: int | None = None, rows: int | None = None, seed: int | None = None,
        threads: int | None = None, device: str | None = None, aliases: dict[str, Sequence[str]] | None = None,
        helps: dict[str, str] | None = None, name: str | None = None) -> argparse.ArgumentParser:
    """A parser whose description is ``doc`` and which has the shared options asked for (a default
    of None leaves one out) and always --json [PATH]. ``aliases`` gives an option more names
    (``{"rounds": ["--repeat"]}``), ``helps`` its own help text."""
    aliases, helps = aliases or {}, helps or {}
    name = name or Path(sys.argv[0]).stem
    ap = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)
    shared = {"rounds": (rounds, int), "rows": (rows, int), "seed": (seed, int), "threads": (threads, int),
              "device": (device, str)}
    for option, (default, kind) in shared.items():
        if default is not None:
            ap.add_argument(f"--{option}", *aliases.get(option, ()), type=kind, default=default,
                            help=helps.get(option, SHARED_HELP[option]))
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help=helps.get("json", JSON_HELP.format(name=name)))
    return ap


def parse(ap: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """parse_args, after checking that --help documents every option (a script's own included)."""
    bare = [a.option_strings[0] for a in ap._actions if a.option_strings and not a.help]
    if bare:
        raise SystemExit(f"{ap.prog}: options without help: {bare}")
    return ap.parse_args(argv)


# -- the alternating loop ------------------------------------------------------------------------
def order(names: Sequence[str], turn: int) -> list[str]:
    """The variants in the order of turn ``turn``: rotated by one each turn (AB, BA, AB, ...)."""
    k = turn % len(names) if names else 0
    return [*names[k:], *names[:k]]


def turns(names: Sequence[str], rounds: int, steps: int = 1) -> Iterator[tuple[int, int, str]]:
    """(round, step, variant) for ``steps`` steps per round (batches, sentences), every variant at
    every step, the order rotating from step to step and round to round."""
    for rnd in range(rounds):
        for step in range(steps):
            for name in order(names, rnd * steps + step):
                yield rnd, step, name


class Runs:
    """Per-variant figures, one value per round for each figure key."""

    def __init__(self, names: Iterable[str], baseline: str | None = None):
        self.names = list(names)
        self.baseline = baseline if baseline is not None else self.names[0]
        if self.baseline not in self.names:
            raise ValueError(f"baseline {self.baseline!r} is not a variant: {self.names}")
        self.figures: dict[str, dict[str, list[float]]] = {n: {} for n in self.names}

    def add(self, name: str, rnd: int | None = None, **figures: float) -> None:
        """Append each figure as the next round's value; with ``rnd``, add it to that round's value
        (a round made of steps: batches, sentences)."""
        for key, value in figures.items():
            values = self.figures[name].setdefault(key, [])
            if rnd is None:
                values.append(value)
            else:
                values.extend([0] * (rnd + 1 - len(values)))
                values[rnd] += value

    def derive(self, key: str, fn: Callable[[dict[str, float]], float]) -> None:
        """A figure per round from that round's other figures (e.g. audio-s / wall-s)."""
        for name in self.names:
            figs = self.figures[name]
            n = min((len(v) for v in figs.values()), default=0)
            figs[key] = [fn({k: v[r] for k, v in figs.items()}) for r in range(n)]

    def values(self, name: str, key: str) -> list[float]:
        return self.figures[name].get(key, [])

    def median(self, name: str, key: str) -> float:
        return median(self.values(name, key))

    def ratio(self, name: str, key: str) -> float:
        """This variant's median over the baseline's (nan where the baseline's is 0)."""
        base = self.median(self.baseline, key)
        return self.median(name, key) / base if base else float("nan")

    def round_ratios(self, name: str, key: str) -> list[float]:
        """Per round, this variant's value over the baseline's in the same round."""
        return [a / b if b else float("nan") for a, b in zip(self.values(name, key), self.values(self.baseline, key),
                                                             strict=False)]

    def stats(self, name: str, key: str, digits: int = 4) -> dict:
        values = self.values(name, key)
        return {"median": _round(median(values), digits), "min": _round(min(values), digits),
                "max": _round(max(values), digits), "values": [_round(v, digits) for v in values]}

    def as_dict(self, keys: Sequence[str] | None = None, digits: int = 4) -> dict:
        """{"baseline", "rounds", "variants": {name: {key: {median, min, max, values}, "vs_baseline":
        {key: ratio of medians}, "round_ratios": {key: median of the per-round ratios}}}}."""
        out: dict = {"baseline": self.baseline, "rounds": max((len(v) for f in self.figures.values()
                                                               for v in f.values()), default=0), "variants": {}}
        for name in self.names:
            row: dict = {}
            for key in keys or list(self.figures[name]):
                if self.values(name, key):
                    row[key] = self.stats(name, key, digits)
            if name != self.baseline:
                keys_here = list(row)
                row["vs_baseline"] = {k: _round(self.ratio(name, k), digits) for k in keys_here}
                row["round_ratios"] = {k: _round(median(self.round_ratios(name, k)), digits) for k in keys_here}
            out["variants"][name] = row
        return out

    def cell(self, name: str, key: str, fmt: str, kind: str = "median") -> str:
        """One table cell: the median, "min..max", the ratio to the baseline ("1.23x") or the median
        of the per-round ratios."""
        if kind == "median":
            return format(self.median(name, key), fmt)
        if kind == "range":
            values = self.values(name, key)
            return f"{min(values):{fmt}}..{max(values):{fmt}}"
        if kind == "ratio":
            return f"{self.ratio(name, key):{fmt}}x"
        if kind == "round_ratio":
            return f"{median(self.round_ratios(name, key)):{fmt}}x"
        raise ValueError(kind)

    def table(self, columns: Sequence[tuple], first: str = "variant", extra: dict[str, Sequence[str]] | None = None,
              extra_header: Sequence[str] = ()) -> None:
        """Print one row per variant: columns are (header, key, format[, kind]) as for cell();
        ``extra`` adds the script's own cells (under ``extra_header``) at the end of each row."""
        header = [first, *(c[0] for c in columns), *extra_header]
        rows = [[name, *(self.cell(name, *c[1:]) for c in columns), *((extra or {}).get(name, ()))]
                for name in self.names]
        table(header, rows)


def alternate(variants: dict[str, Callable[[int], dict | None]], rounds: int, baseline: str | None = None,
              say: Callable[[int, str, dict], None] | None = None) -> Runs:
    """Run every variant once per round, the order rotating from round to round. Each variant is a
    function of the round number returning its figures ({"wall_s": 1.2, ...}); ``say`` is told
    each (round, variant, figures) as they come."""
    runs = Runs(variants, baseline)
    for rnd, _step, name in turns(list(variants), rounds):
        figures = variants[name](rnd) or {}
        runs.add(name, **figures)
        if say is not None:
            say(rnd, name, figures)
    return runs


# -- printing and JSON ---------------------------------------------------------------------------
def table(header: Sequence[str], rows: Iterable[Sequence[object]], left: Sequence[int] = (0,)) -> None:
    """Print aligned columns: those in ``left`` (the first) left-aligned, the others right-aligned."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows if i < len(r))) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return " ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths,
                                                                                          strict=False)))
    print(line([str(h) for h in header]).rstrip())
    for row in rows:
        print(line(row).rstrip())


def _round(value, digits: int):
    """Rounded; nan (a ratio to 0) as None, which JSON can hold."""
    if isinstance(value, float):
        return None if value != value else round(value, digits)
    return value


class Report:
    """Where --json sends the results: None (table only), "-" (one JSON object on stdout instead of
    the table), or a path: a .json file, or a folder to write ``<name>.json`` in. save() rewrites
    the file whole (atomically), so a script may call it after every row and a run cut short still
    leaves its figures."""

    def __init__(self, target: str | os.PathLike | None, name: str, indent: int | None = 1,
                 count_writes: bool = False):
        self.stdout = target is not None and str(target) == "-"
        self.path: Path | None = None
        if target is not None and not self.stdout:
            path = Path(target)
            self.path = path if path.suffix == ".json" else path / f"{name}.json"
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.indent, self.count_writes, self.writes = indent, count_writes, 0

    def save(self, result: dict) -> None:
        if self.path is None:
            return
        self.writes += 1
        if self.count_writes:
            result["json_writes"] = self.writes
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=self.indent, default=str) + "\n", encoding="utf-8")
        tmp.replace(self.path)

    def emit(self, result: dict, show: Callable[[], None]) -> None:
        """The table (``show``), or the JSON object on stdout for a bare --json; then the file."""
        if self.stdout:
            print(json.dumps(result, default=str))
        else:
            show()
        self.save(result)
