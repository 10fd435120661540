"""store/tables.py: the manifest's Arrow tables, built and read without pandas."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from cosybatch.store.checkpoint import MANIFEST_COLUMNS, OPTIONAL_MANIFEST_COLUMNS
from cosybatch.store.tables import read_parquet, records_table

SCHEMA = pa.schema([(name, getattr(pa, kind)()) for name, kind in MANIFEST_COLUMNS + OPTIONAL_MANIFEST_COLUMNS])


def _same(a, b) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


def test_the_table_is_the_one_pa_table_builds():
    floats = [0.1 + 0.2, 1 / 3, 5e-324, 1.7976931348623157e308, -0.0, math.inf, -math.inf, math.nan, None]
    records = [{name: None for name in SCHEMA.names} | {
        "key": f"k{i}", "id": f"ïd \"{i}\"\n\u2028✓", "shard": "shard-000000.tar", "text": "Ünïcode — text\t\\",
        "voice": "v", "duration_s": f, "num_samples": np.int64(2**62 + i), "sample_rate": np.int32(22050),
        "row": i, "qc_pass": [True, False, None][i % 3], "qc_attempts": i, "qc_score": np.float32(0.25),
    } for i, f in enumerate(floats)]
    ours = records_table(SCHEMA, records)
    theirs = pa.table({name: [r[name] for r in records] for name in SCHEMA.names}, schema=SCHEMA)
    assert ours.schema == theirs.schema
    for name in SCHEMA.names:
        got, want = ours.column(name).to_pylist(), theirs.column(name).to_pylist()
        assert all(_same(a, b) for a, b in zip(got, want, strict=True)), name


def test_no_rows_is_an_empty_table_of_the_schema():
    table = records_table(SCHEMA, [])
    assert table.num_rows == 0 and table.schema == SCHEMA


def test_a_string_that_is_not_utf8_is_refused():
    with pytest.raises(UnicodeEncodeError):
        records_table(pa.schema([("id", pa.string())]), [{"id": "a\ud800"}])


def test_writing_and_reading_a_manifest_does_not_import_pandas(tmp_path):
    code = ("import sys\nfrom pathlib import Path\n"
            "from cosybatch.store.checkpoint import write_manifest_table\n"
            "from cosybatch.store.tables import read_parquet\n"
            "root = Path(sys.argv[1])\n"
            "write_manifest_table(root, [{'key': 'a', 'id': 'a', 'shard': 's', 'text': 't', 'voice': 'v',\n"
            "                             'duration_s': 1.5, 'num_samples': 3, 'sample_rate': 2, 'row': 0}])\n"
            "print(read_parquet(root / 'manifest.parquet').to_pylist()[0]['duration_s'], 'pandas' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1.5", "False"]
    assert read_parquet(tmp_path / "manifest.parquet", columns=["id"]).to_pylist() == [{"id": "a"}]
