"""A job and its corpus over time: a changed corpus (an edit deep inside a large file, a truncated
file fixed, rows changed or removed) is continued only with --allow-corpus-change, with what changed
listed, even after an interrupted run; a damaged Parquet row group costs only its rows; a job
fingerprinted the old way resumes without the flag."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import assert_exactly_once, cli, write_jsonl

from cosybatch.config import RunConfig
from cosybatch.errors import CorpusError, ResumeMismatchError
from cosybatch.run.local import run

SHORT = ["Yes.", "Good morning.", "No.", "Why not?", "Fine.", "Hello there.", "Thanks.", "Go on."]


def rows(n: int, prefix: str = "id") -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": SHORT[i % len(SHORT)]} for i in range(n)]


def config(corpus: Path, out: Path, **kw) -> RunConfig:
    """The job in process on the tone engine (tests/plugin): these tests are about the folder, not the
    voice. Batches of one, so that shards close at exactly 3 items (a batch commits whole)."""
    return RunConfig.from_options(corpus=corpus, out=out, progress="none",
                     **{"engine": "tone", "batch_size": 1, "shard_max_items": 3, **kw})


def test_an_edit_in_the_middle_of_a_large_corpus_is_a_change(tmp_path):
    filler = "word " * 180
    data = [{"id": f"r{i}", "text": "Short." if i < 2 else filler} for i in range(3000)]  # ~2.7 MB
    corpus = write_jsonl(tmp_path / "c.jsonl", data)
    assert corpus.stat().st_size > 2 << 20
    out = tmp_path / "out"
    run(config(corpus, out, limit=2))
    raw = bytearray(corpus.read_bytes())
    middle = raw.index(b"word", len(raw) // 2)
    raw[middle] = ord("W")  # same size, same first and last MiB
    corpus.write_bytes(bytes(raw))
    with pytest.raises(ResumeMismatchError, match=r"(?s)another version of the corpus.*corpus\.sha256 was .*"
                                                  r"--allow-corpus-change"):
        run(config(corpus, out, limit=2))
    assert run(config(corpus, out, limit=2, allow_corpus_change=True)).status == "complete"


@pytest.mark.slow
def test_a_fixed_truncated_corpus_is_continued_with_allow_corpus_change(tmp_path):
    data = [{"id": f"t{i}", "text": f"{SHORT[i % len(SHORT)]} Number {i}."} for i in range(60)]
    whole = "".join(json.dumps(r) + "\n" for r in data).encode()
    gz = gzip.compress(whole)
    corpus = tmp_path / "c.jsonl.gz"
    corpus.write_bytes(gz[: len(gz) * 3 // 4])
    out = tmp_path / "out"
    proc = cli("run", corpus, "--out", out, "--progress", "none", "--engine", "tone")
    assert proc.returncode == 3, proc.stderr
    assert "truncated or corrupt" in proc.stderr and "--allow-corpus-change" in proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["status"] == "error" and summary["exit_code"] == 3
    before = {r["id"] for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    assert 0 < len(before) < len(data)  # every readable row was synthesised, not just dropped
    corpus.write_bytes(gz)  # the fixed file
    refused = cli("run", corpus, "--out", out, "--progress", "none", "--engine", "tone")
    assert refused.returncode == 2 and "--allow-corpus-change" in refused.stderr
    result = run(RunConfig.from_options(corpus=corpus, out=out, progress="none", engine="tone",
                                        allow_corpus_change=True))
    assert result.status == "complete"
    assert result.stats["items_done"] == len(data) - len(before)
    assert result.stats["corpus_changes"] == {"changed": 0, "removed": 0}
    assert_exactly_once(out, [r["id"] for r in data])
    assert not (out / "failures.jsonl").exists() or not (out / "failures.jsonl").read_text().strip()


def test_changed_and_removed_rows_are_listed_not_mixed(tmp_path):
    v1 = rows(4)
    corpus = write_jsonl(tmp_path / "c.jsonl", v1)
    out = tmp_path / "out"
    run(config(corpus, out))
    v2 = [v1[0], {"id": "id1", "text": "A different sentence."}, v1[2], {"id": "new", "text": "Added later."}]
    write_jsonl(corpus, v2)
    with pytest.raises(ResumeMismatchError, match="--allow-corpus-change"):
        run(config(corpus, out))
    result = run(config(corpus, out, allow_corpus_change=True))
    assert result.status == "complete" and result.stats["items_done"] == 1
    assert result.stats["corpus_changes"] == {"changed": 1, "removed": 1}
    changes = [json.loads(line) for line in (out / "corpus_changes.jsonl").read_text().splitlines()]
    assert [(c["id"], c["change"]) for c in changes] == [("id1", "changed"), ("id3", "removed")]
    items = assert_exactly_once(out, ["id0", "id1", "id2", "id3", "new"])
    assert items["id1"]["meta"]["text"] == v1[1]["text"]  # the committed audio, not a silent mix
    # The job now follows the new corpus: a plain rerun resumes without the flag.
    assert run(config(corpus, out)).stats["items_done"] == 0


def test_an_interrupted_corpus_change_is_still_reported(tmp_path):
    v1 = rows(3)
    corpus = write_jsonl(tmp_path / "c.jsonl", v1)
    out = tmp_path / "out"
    run(config(corpus, out))
    write_jsonl(corpus, [v1[0], {"id": "id1", "text": "Changed."}, {"id": "new", "text": "Added."}])
    stopped = run(config(corpus, out, allow_corpus_change=True, max_runtime=0.001))  # stops while loading
    assert stopped.status == "interrupted" and not (out / "corpus_changes.jsonl").exists()
    result = run(config(corpus, out))  # the job already follows the new corpus: no flag needed
    assert result.status == "complete" and result.stats["corpus_changes"] == {"changed": 1, "removed": 1}
    changes = [json.loads(line) for line in (out / "corpus_changes.jsonl").read_text().splitlines()]
    assert [(c["id"], c["change"]) for c in changes] == [("id1", "changed"), ("id2", "removed")]
    assert "corpus_changes" not in run(config(corpus, out)).stats  # reported once


def test_corrupt_parquet_row_group_costs_only_its_rows(tmp_path):
    import pyarrow as pa

    data = [{"id": f"p{i}", "text": SHORT[i % len(SHORT)]} for i in range(30)]
    corpus = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(data), corpus, row_group_size=2, compression="none")
    meta = pq.ParquetFile(corpus).metadata
    assert meta.num_row_groups == 15
    group = meta.row_group(11)  # rows 22-23
    raw = bytearray(corpus.read_bytes())
    for c in range(group.num_columns):
        column = group.column(c)
        start = column.dictionary_page_offset or column.data_page_offset
        raw[start:start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    corpus.write_bytes(bytes(raw))
    out = tmp_path / "out"
    with pytest.raises(CorpusError, match=r"rows 22-23 \(row group 12 of 15"):
        run(config(corpus, out))
    done = {r["id"] for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    assert done == {r["id"] for r in data} - {"p22", "p23"}
    assert json.loads((out / "stats.json").read_text())["status"] == "corpus_error"


def test_a_job_fingerprinted_the_old_way_resumes_without_the_flag(tmp_path):
    from cosybatch.store.checkpoint import file_fingerprint

    corpus = write_jsonl(tmp_path / "c.jsonl", rows(3))
    out = tmp_path / "out"
    run(config(corpus, out, limit=2))
    job_file = out / ".cosybatch" / "job.json"
    record = json.loads(job_file.read_text())
    whole = record["fingerprint"]["corpus"]
    engine = dict(record["fingerprint"]["engine"])
    record["fingerprint"]["corpus"] = {"name": "c.jsonl", **file_fingerprint(corpus)}  # head and tail only
    del record["fingerprint"]["engine"]["device"]  # not recorded before
    job_file.write_text(json.dumps(record))
    assert run(config(corpus, out)).stats["items_done"] == 1
    assert json.loads(job_file.read_text())["fingerprint"]["corpus"] == whole
    assert json.loads(job_file.read_text())["fingerprint"]["engine"] == engine
