"""Arrow tables in and out of Parquet without importing pandas.

pyarrow imports pandas (0.2 s) the first time it converts a Python object (pa.array, pa.table,
Table.from_pylist) or loads pyarrow.dataset (pq.read_table), to ask whether the object is one of
pandas'. Every run writes a manifest and reads it back for its report, so that was a tenth of a
short run's start-up, paid again by every process of a sharded or scheduled job. These two
functions do the same work through Arrow's JSON reader and pq.ParquetFile, which never ask.
"""

from __future__ import annotations

import io
import json


def read_parquet(source, columns=None):
    """The table of one Parquet file (a path or a binary file object), as pq.read_table reads it."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(source) as f:
        return f.read(columns=columns)


def records_table(schema, records):
    """An Arrow table of SCHEMA from dicts of its columns' values (None: null), as pa.table builds it.

    Exact for strings, integers, floats and booleans: Python writes the shortest repr of a float,
    which Arrow parses back to the same double (NaN and infinities included); a string that is not
    valid UTF-8 (a lone surrogate) raises UnicodeEncodeError here, as it raised in pa.table."""
    import pyarrow.json as pj

    lines = b"".join(json.dumps(r, ensure_ascii=False, default=_plain).encode() + b"\n" for r in records)
    if not lines:
        return schema.empty_table()
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error")
    return pj.read_json(io.BytesIO(lines), parse_options=options).select(schema.names)


def _plain(value):
    """json.dumps' fallback: a numpy scalar as the Python number it holds."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not a manifest value")
