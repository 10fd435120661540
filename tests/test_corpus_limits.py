"""A row is bounded while it is read, and malformed input refuses instead of changing shape (issue
31, holes 9 and 13): an over-long JSONL/text line, CSV/TSV record or Parquet cell is a bad row
skipped unread, the rows after it still read; duplicate column names and an unterminated CSV quote
refuse the file; a lone CR ends a line of a .txt corpus."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ROOT

from cosybatch.corpus import BadRow, Corpus, Row
from cosybatch.errors import EXIT_BAD_INPUT, CorpusError

BIG = 2 << 20  # twice the 1 MiB a row may take with the default --max-chars (row_bytes)


def read(path, **kw) -> list:
    return list(Corpus(path, **kw))


def shape(rows: list) -> list:
    return [(type(r).__name__, r.index, r.id, r.text if isinstance(r, Row) else None) for r in rows]


def assert_skipped(rows: list, index: int, *needles: str) -> None:
    bad = rows[index]
    assert isinstance(bad, BadRow), bad
    for needle in needles:
        assert needle in bad.reason, bad.reason


@pytest.mark.parametrize("gz", [False, True])
def test_an_over_long_jsonl_line_is_a_bad_row_and_the_next_rows_are_read(tmp_path, gz):
    data = (b'{"id": "a", "text": "One."}\n{"id": "b", "text": "' + b"x" * BIG + b'"}\n'
            b'{"id": "c", "text": "Three."}\n')
    path = tmp_path / ("c.jsonl.gz" if gz else "c.jsonl")
    path.write_bytes(gzip.compress(data) if gz else data)
    rows = read(path)
    assert shape(rows)[0] == ("Row", 0, "a", "One.") and shape(rows)[2] == ("Row", 2, "c", "Three.")
    assert_skipped(rows, 1, "line 2", f"{BIG + 23} bytes", "--max-chars 20000", "skipped unread", "raise --max-chars")


def test_the_cap_follows_max_chars(tmp_path):
    path = tmp_path / "c.jsonl"
    text = "y" * (3 << 20)
    path.write_text(json.dumps({"id": "a", "text": text}) + "\n")
    assert isinstance(read(path)[0], BadRow)
    assert read(path, max_chars=1_000_000)[0].text == text  # 16 MB a row: the long line is read


def test_an_over_long_text_line_is_a_bad_row(tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes(b"One.\n" + b"x" * BIG + b"\nThree.\n")
    rows = read(path)
    assert shape(rows)[0] == ("Row", 0, "1", "One.") and shape(rows)[2] == ("Row", 2, "3", "Three.")
    assert_skipped(rows, 1, "line 2", f"{BIG} characters")


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_an_over_long_csv_record_is_a_bad_row_and_the_next_rows_are_read(tmp_path, fmt):
    sep = b"," if fmt == "csv" else b"\t"
    field = b'"' + b"x, " * (BIG // 3) + b'"' if fmt == "csv" else b"x" * BIG
    path = tmp_path / f"c.{fmt}"
    path.write_bytes(b"id" + sep + b"text\na" + sep + b"One.\nb" + sep + field + b"\nc" + sep + b"Three.\n")
    rows = read(path)
    assert shape(rows) == [("Row", 0, "a", "One."), ("BadRow", 1, None, None), ("Row", 2, "c", "Three.")]
    assert_skipped(rows, 1, "the record on line 3", "skipped unread")


def test_an_over_long_parquet_cell_is_a_bad_row_keeping_its_id(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["One.", "x" * BIG, "Three."]}), path)
    rows = read(path)
    assert shape(rows) == [("Row", 0, "a", "One."), ("BadRow", 1, "b", None), ("Row", 2, "c", "Three.")]
    assert_skipped(rows, 1, "'text' column", f"{BIG} bytes")


def test_one_huge_row_costs_about_its_cap_in_memory(tmp_path):
    """A 64 MB line (about 20x that in memory before) read in a fresh process: its peak stays within
    a few MB of reading a small file."""
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.write(b'{"id": "a", "text": "')
        for _ in range(64):
            f.write(b"word " * ((1 << 20) // 5))
        f.write(b'"}\n{"id": "b", "text": "After."}\n')
    small = tmp_path / "small.jsonl"
    small.write_text('{"id": "b", "text": "After."}\n')
    probe = textwrap.dedent("""
        import resource, sys
        from cosybatch.corpus import Corpus
        rows = list(Corpus(sys.argv[1]))
        assert rows[-1].text == "After.", rows
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    """)

    def peak_mb(path) -> int:
        proc = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True,
                              cwd=ROOT, timeout=120, check=True)
        return int(proc.stdout.split()[-1])

    assert peak_mb(big) - peak_mb(small) < 24  # before: over 1 GB


# -- malformed input refuses, never changes shape -----------------------------------------------------
@pytest.mark.parametrize("header", ["id,text,text", "id,id,text"])
def test_duplicate_csv_columns_refuse_the_file(tmp_path, header):
    path = tmp_path / "c.csv"
    path.write_text(f"{header}\na,b,c\n")
    with pytest.raises(CorpusError) as err:
        Corpus(path)
    twice = header.split(",")[1]
    assert f"the column {twice!r} appears 2 times in the CSV header" in str(err.value)
    assert "Rename or drop the extra columns" in str(err.value) and err.value.exit_code == EXIT_BAD_INPUT


def test_duplicate_parquet_columns_refuse_the_file(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table([pa.array(["a"]), pa.array(["x"]), pa.array(["y"])], names=["id", "text", "text"]), path)
    with pytest.raises(CorpusError, match="the column 'text' appears 2 times"):
        Corpus(path)


def test_a_duplicate_jsonl_key_is_a_bad_row(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "text": "One.", "text": "Two."}\n{"id": "b", "text": "Fine."}\n')
    rows = read(path)
    assert_skipped(rows, 0, "line 1 has the key 'text' twice")
    assert shape(rows)[1] == ("Row", 1, "b", "Fine.")


@pytest.mark.parametrize("data, line", [
    (b'id,text\na,"Hello\nb,world\n', 2),
    (b'id,text\na,One.\nb,"Two\n', 3),
    (b'id,text\r\na,"He said ""hi"".\r\nb,x\r\n', 2),
])
def test_an_unterminated_quote_refuses_the_file_naming_its_line(tmp_path, data, line):
    path = tmp_path / "c.csv"
    path.write_bytes(data)
    with pytest.raises(CorpusError) as err:
        Corpus(path)
    assert f"line {line} opens a quoted field that is never closed" in str(err.value)
    assert "Close the quote" in str(err.value)


def test_quotes_that_pyarrow_reads_as_text_are_not_refused(tmp_path):
    path = tmp_path / "c.csv"
    path.write_bytes(b'id,text\na,"Say ""hi"", then go."\nb,a 5" screen\nc,"two\nlines"\n')
    assert [r.text for r in read(path)] == ['Say "hi", then go.', 'a 5" screen', "two lines"]


def test_a_tsv_quote_is_text(tmp_path):
    path = tmp_path / "c.tsv"
    path.write_bytes(b'id\ttext\na\t"Hello\nb\tworld\n')
    assert [r.text for r in read(path)] == ['"Hello', "world"]


@pytest.mark.parametrize("ending", [b"\r", b"\r\n", b"\n"])
def test_a_lone_cr_ends_a_text_line(tmp_path, ending):
    path = tmp_path / "c.txt"
    path.write_bytes(ending.join([b"One.", b"Two.", b"", b"Four."]) + ending)
    corpus = Corpus(path)
    assert shape(list(corpus)) == [("Row", 0, "1", "One."), ("Row", 1, "2", "Two."), ("Row", 3, "4", "Four.")]
    assert corpus.num_rows == 4


def test_bad_utf8_in_a_text_line_fails_that_line_only(tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes(b"One.\rT\xffwo.\rThree.")
    rows = read(path)
    assert_skipped(rows, 1, "line 2 is not valid UTF-8")
    assert [r.text for r in rows if isinstance(r, Row)] == ["One.", "Three."]
