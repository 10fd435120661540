"""Shared helpers for the benchmark scripts (not imported by the package or the tests)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = ROOT / "examples" / "sentences.txt"


def sentences(n: int) -> list[str]:
    lines = [line.strip() for line in SENTENCES.read_text(encoding="utf-8").splitlines() if line.strip()]
    if n > len(lines):
        raise SystemExit(f"{SENTENCES} has {len(lines)} lines, fewer than {n}")
    return lines[:n]


def write_corpus(texts: list[str], path: Path) -> Path:
    pq.write_table(pa.table({"id": [f"s{i:05d}" for i in range(len(texts))], "text": texts}), path)
    return path


def median(values: list[float]) -> float:
    return statistics.median(values)
