"""Readers: streamed rows, per-row failures with reasons, and whole-file errors that name the fix."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import write_jsonl, write_parquet
from hypothesis import given, settings
from hypothesis import strategies as st

from cosybatch.corpus import BadRow, Columns, Corpus, Row
from cosybatch.errors import CorpusError
from cosybatch.store.shards import item_key


def test_jsonl_bad_lines_are_recorded_and_good_rows_kept(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(
        b'{"id": "a", "text": "Hello."}\n'
        b'{not json\n'
        b'\n'
        b'{"id": "b", "text": "caf\xe9"}\n'  # latin-1 byte: not UTF-8
        b'[1, 2]\n'
        b'{"id": "c"}\n'
        b'{"id": "d", "text": null}\n'
        b'{"id": "e", "text": " \\u0000\\t "}\n'
        b'{"id": "f", "text": "Fine\\u0000 again."}\n'
    )
    rows = list(Corpus(path))
    good = [r for r in rows if isinstance(r, Row)]
    bad = [r for r in rows if isinstance(r, BadRow)]
    assert [(r.id, r.text) for r in good] == [("a", "Hello."), ("f", "Fine again.")]
    reasons = [r.reason for r in bad]
    assert "line 2 is not valid JSON" in reasons[0]
    assert "line 4 is not valid UTF-8" in reasons[1]
    assert "line 5 is a JSON list" in reasons[2]
    assert "line 6 has no 'text' field" in reasons[3]
    assert reasons[4] == "text is null"
    assert reasons[5].startswith("text is empty")
    assert Corpus(path).num_rows == 9


def test_missing_text_column_names_file_columns_and_fix(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", [{"id": "1", "sentence": "hi"}])
    with pytest.raises(CorpusError) as err:
        Corpus(path)
    msg = str(err.value)
    assert "c.parquet" in msg and "'sentence'" in msg and "--text-col" in msg
    assert [r.text for r in Corpus(path, Columns(text="sentence"))] == ["hi"]


def test_jsonl_wrong_text_field_is_a_file_error(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": i, "utterance": "x"} for i in range(3)])
    with pytest.raises(CorpusError, match=r"fields found: \['id', 'utterance'\].*--text-col"):
        Corpus(path)


def test_wrong_types_and_formats(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": [3]}), path)
    with pytest.raises(CorpusError, match="text column 'text' has type int64"):
        Corpus(path)
    with pytest.raises(CorpusError, match="cannot tell the corpus format"):
        Corpus(write_jsonl(tmp_path / "c.xml", [{"text": "x"}]))  # .txt is a plain-text corpus now
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(CorpusError, match="not a readable Parquet file"):
        Corpus(tmp_path / "broken.parquet")
    with pytest.raises(CorpusError, match="no id column 'key'"):
        Corpus(write_parquet(tmp_path / "d.parquet", [{"text": "x"}]), Columns(id="key", id_required=True))


def test_parquet_streams_in_order_with_integer_ids_and_voice(tmp_path):
    n = 10_000
    table = pa.table({"id": list(range(n)), "text": [f"row {i}" for i in range(n)],
                      "voice": [None if i % 2 else "v" for i in range(n)]})
    path = tmp_path / "big.parquet"
    pq.write_table(table, path, row_group_size=1000)
    rows = list(Corpus(path))
    assert [r.id for r in rows] == [str(i) for i in range(n)]
    assert rows[0].voice == "v" and rows[1].voice is None


def test_gzip_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl.gz", [{"id": "x", "text": "Hi."}], gz=True)
    assert [(r.id, r.text) for r in Corpus(path)] == [("x", "Hi.")]
    assert Corpus(path).num_rows is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=30), st.none(), st.integers()), max_size=40))
def test_jsonl_reader_accounts_for_every_line(tmp_path_factory, texts):
    path = tmp_path_factory.mktemp("h") / "c.jsonl"
    lines = [json.dumps({"id": f"r{i}", "text": t}) for i, t in enumerate(texts)]
    path.write_text("\n".join(lines) + "\n" if lines else "")
    if not texts:
        return
    rows = list(Corpus(path))
    assert [r.id for r in rows] == [f"r{i}" for i in range(len(texts))]  # nothing lost, nothing extra
    for r, t in zip(rows, texts, strict=True):
        if isinstance(r, Row):
            assert isinstance(t, str) and r.text and r.text == r.text.strip()
        else:
            assert r.reason


@given(st.text(min_size=1, max_size=200))
def test_keys_are_safe_and_distinct(item_id):
    key = item_key(item_id)
    assert key and len(key) <= 100
    assert all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
    if key == item_id:
        return
    assert item_key(item_id + "x") != key


def test_keys_do_not_collide_on_sanitised_ids():
    ids = ["a/b", "a.b", "a_b", "a b", "../../etc/passwd", "ü", "ü" * 200]
    keys = [item_key(i) for i in ids]
    assert len(set(keys)) == len(ids)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.text(max_size=12), st.integers(-5, 10**9)),
                          st.one_of(st.none(), st.text(max_size=40))), max_size=60))
def test_parquet_reader_accounts_for_every_row(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("p") / "c.parquet"
    ids = [None if i is None else str(i) for i, _ in rows]
    texts = pa.array([t for _, t in rows], pa.string())
    pq.write_table(pa.table({"id": pa.array(ids, pa.string()), "text": texts}), path)
    out = list(Corpus(path))
    assert [r.index for r in out] == list(range(len(rows)))  # one result per row, in order
    for r, (raw_id, text) in zip(out, rows, strict=True):
        if isinstance(r, Row):
            assert r.id == str(raw_id) and r.text and text is not None
        else:
            assert r.reason
            bad_id = raw_id is None or not str(raw_id).strip()
            assert bad_id or text is None or not text.strip() or not text.isprintable()


def test_prompt_columns_and_the_speaker_fallback(tmp_path):
    rows = [{"id": "a", "text": "Hi.", "speaker": 3, "prompt_wav": "p.wav", "prompt_text": "Hello."},
            {"id": "b", "text": "Yo.", "speaker": 4, "prompt_wav": None, "prompt_text": "orphan"}]
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    # Piper: a 'speaker' column is not a voice (an integer one used to be ignored and still is).
    read = list(Corpus(corpus, Columns()))
    assert read[0] == Row(0, "a", "Hi.", None, "p.wav", "Hello.")
    assert isinstance(read[1], BadRow) and "prompt_text without prompt_wav" in read[1].reason
    # CosyVoice: 'speaker' is the voice column when there is no 'voice'; its values must be strings.
    read = list(Corpus(corpus, Columns(voice_fallback="speaker")))
    assert isinstance(read[0], BadRow) and "voice is a int" in read[0].reason
    named = write_parquet(tmp_path / "n.parquet", [{"id": "a", "text": "Hi.", "speaker": "alice"}])
    assert next(iter(Corpus(named, Columns(voice_fallback="speaker")))).voice == "alice"
    jsonl = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "Hi.", "speaker": "bob", "prompt_wav": "x.wav"}])
    assert next(iter(Corpus(jsonl, Columns(voice_fallback="speaker")))) == Row(0, "a", "Hi.", "bob", "x.wav", None)


def test_long_ids_with_a_common_prefix_get_distinct_short_keys():
    from cosybatch.store.shards import item_key

    ids = [f"https://example.com/{'a' * 150}/{i}" for i in range(1000)]
    keys = {item_key(i) for i in ids}
    assert len(keys) == 1000
    assert all(len(k) + len(".json") <= 100 for k in keys)
