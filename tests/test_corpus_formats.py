"""Newcomer defect 5: CSV, TSV and plain-text corpora are read, with the same bad-row rules."""

from __future__ import annotations

import pytest
from helpers import read_output

from cosybatch.config import RunConfig
from cosybatch.corpus import BadRow, Corpus, Row
from cosybatch.errors import CorpusError
from cosybatch.run.local import run


def read(path, **kw):
    return list(Corpus(path, **kw))


def test_csv_rows_quoted_fields_and_bad_rows(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text('id,text,voice\na,"Hello, there.",\nb,"Two\nlines.",x\nc,too,many,fields\n,No id.,\nd,,\n')
    rows = read(path)
    assert rows[0] == Row(0, "a", "Hello, there.")
    assert rows[1] == Row(1, "b", "Two lines.", voice="x")
    bad = {r.index: r for r in rows if isinstance(r, BadRow)}
    assert "row 2 has an empty id" in bad[2].reason
    assert bad[3].id == "d" and "text is empty" in bad[3].reason
    assert "record 4 (the header is record 1) has 4 fields, expected 3" in bad[4].reason
    assert len({r.index for r in rows}) == 5


def test_tsv_is_tab_separated_without_quoting(tmp_path):
    path = tmp_path / "c.tsv"
    path.write_text('id\ttext\n1\tHe said "hi.\n2\tOk.\n')
    assert read(path) == [Row(0, "1", 'He said "hi.'), Row(1, "2", "Ok.")]


def test_text_one_row_a_line_numbered_from_one(tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes(b"\xef\xbb\xbfHello.\n\n   \nSecond line.\n\xff bad\n")
    rows = read(path)
    assert rows[:2] == [Row(0, "1", "Hello."), Row(3, "4", "Second line.")]  # blank lines counted, skipped
    assert isinstance(rows[2], BadRow) and rows[2].id == "5" and "not valid UTF-8" in rows[2].reason


def test_clear_errors(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("id,words\na,Hello.\n")
    with pytest.raises(CorpusError, match=r"no text column 'text' in the CSV header; columns found: \['id', 'words'\]"):
        read(path)
    txt = tmp_path / "c.txt"
    txt.write_text("Hello.\n")
    from cosybatch.corpus import Columns

    with pytest.raises(CorpusError, match="a plain-text corpus has no columns"):
        read(txt, columns=Columns(id="key", id_required=True))
    with pytest.raises(CorpusError, match="csv, tsv"):
        read(txt, fmt="xml")


def test_a_csv_run_end_to_end(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("id,text\nx,One.\ny,Two.\n")
    result = run(RunConfig.from_options(corpus=path, out=tmp_path / "out", engine="tone", progress="none"))
    assert result.status == "complete" and sorted(read_output(tmp_path / "out")) == ["x", "y"]
