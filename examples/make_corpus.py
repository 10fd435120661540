"""Build the example corpus (Parquet and JSONL) from examples/sentences.txt.

    python examples/make_corpus.py

The outputs are committed, so `cosybatch run examples/corpus.parquet` works right after install.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent


def main() -> None:
    lines = [line.strip() for line in (HERE / "sentences.txt").read_text(encoding="utf-8").splitlines()]
    rows = [{"id": f"ex-{i:04d}", "text": text} for i, text in enumerate(lines) if text]
    pq.write_table(pa.Table.from_pylist(rows), HERE / "corpus.parquet")
    with open(HERE / "corpus.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to corpus.parquet and corpus.jsonl")


if __name__ == "__main__":
    main()
