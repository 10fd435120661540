"""A corpus in parts (cosybatch.sources): a folder of Parquet parts, a glob of .jsonl.gz parts and
a prefix in a real S3-API server (moto's, started here) read as one stream in sorted-part order,
with stable PART:ROW ids; a part changed, added or removed is the "corpus changed" refusal naming
it; --shard splits the parts' rows by id; mixed formats, no parts, ids in some parts only and
credentials in a URI are refused with the fix."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import S3_ENV, assert_exactly_once, cli, read_output, write_jsonl

from cosybatch.config import RunConfig
from cosybatch.corpus import BadRow, Row
from cosybatch.errors import CorpusError, ResumeMismatchError, UsageError
from cosybatch.run.local import run
from cosybatch.sources import PartedCorpus, open_corpus

TEXTS = ["Yes.", "Good morning.", "No.", "Why not?", "Fine.", "Hello there.", "Thanks.", "Go on."]


def parquet_parts(folder: Path, count: int = 3, rows: int = 2) -> list[str]:
    """COUNT Parquet parts of ROWS rows without an id column, written last part first (so that
    the listing's order is not the creation order); returns the ids cosybatch gives them."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in reversed(range(count)):
        texts = [f"{TEXTS[(p * rows + r) % len(TEXTS)]} Part {p} row {r}." for r in range(rows)]
        pq.write_table(pa.table({"text": texts}), folder / f"part-{p:05d}.parquet")
    return [f"part-{p:05d}.parquet:{r}" for p in range(count) for r in range(rows)]


def read_all(corpus) -> list:
    return list(corpus)


def config(corpus, out: Path, **kw) -> RunConfig:
    return RunConfig.from_options(corpus=corpus, out=out, progress="none",
                                  **{"engine": "tone", "batch_size": 2, **kw})


# -- reading -----------------------------------------------------------------------------------------


def test_a_folder_of_parquet_parts_is_one_stream_in_sorted_order(tmp_path):
    ids = parquet_parts(tmp_path / "corpus")
    (tmp_path / "corpus" / "_SUCCESS").write_bytes(b"")  # Spark's marker and a checksum: never parts
    (tmp_path / "corpus" / ".part-00000.parquet.crc").write_bytes(b"\x00crc")
    corpus = open_corpus(tmp_path / "corpus")
    assert isinstance(corpus, PartedCorpus) and corpus.format == "parquet" and corpus.num_rows == 6
    rows = read_all(corpus)
    assert all(isinstance(r, Row) for r in rows)
    assert [r.id for r in rows] == ids
    assert [r.index for r in rows] == list(range(6))  # one running row number over the parts
    assert [r.text for r in rows][2:4] == ["No. Part 1 row 0.", "Why not? Part 1 row 1."]
    again = read_all(open_corpus(str(tmp_path / "corpus") + "/"))
    assert [(r.id, r.index, r.text) for r in again] == [(r.id, r.index, r.text) for r in rows]
    assert set(corpus.fingerprint()["parts"]) == {f"part-{p:05d}.parquet" for p in range(3)}
    from cosybatch.run.ray import read_rows

    assert [r.id for r in read_rows(corpus)] == ids  # ray-run's driver streams the parts itself


def test_a_glob_of_jsonl_gz_parts_keeps_the_id_column(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for p in (2, 0, 1):
        write_jsonl(folder / f"train-{p}.jsonl.gz", [{"id": f"u{p}{r}", "text": TEXTS[r]} for r in range(2)], gz=True)
    write_jsonl(folder / "valid-0.jsonl.gz", [{"id": "v", "text": "Not this one."}], gz=True)
    corpus = open_corpus(str(folder / "train-*.jsonl.gz"))
    assert corpus.format == "jsonl" and [p.name for p in corpus.parts] == [f"train-{p}.jsonl.gz" for p in range(3)]
    rows = read_all(corpus)
    assert [r.id for r in rows] == ["u00", "u01", "u10", "u11", "u20", "u21"]
    assert [r.index for r in rows] == list(range(6))
    assert [r.id for r in read_all(open_corpus(str(folder / "train-*.jsonl.gz")))] == [r.id for r in rows]


def test_a_damaged_part_costs_its_own_rows_and_is_named(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    n = 300
    for p in range(3):
        write_jsonl(folder / f"p{p}.jsonl.gz", [{"text": f"Row {r} of part {p}: {r * 7919 % 10007}."}
                                                for r in range(n)], gz=True)
    whole = [(r.id, r.index) for r in open_corpus(folder)]
    damaged = folder / "p1.jsonl.gz"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # cut short
    seen = []
    with pytest.raises(CorpusError, match=r"p1\.jsonl\.gz.*truncated or corrupt"):
        for row in open_corpus(folder):
            seen.append((row.id, row.index))
    assert seen[:n] == whole[:n]
    assert [i for i, _ in seen[-n:]] == [i for i, _ in whole[-n:]]  # the part after it, with its own ids
    assert 0 < len(seen) - 2 * n < n and all(i.startswith("p1.jsonl.gz:") for i, _ in seen[n:-n])


def test_bad_rows_name_their_part_and_text_parts_keep_line_numbers(tmp_path):
    folder = tmp_path / "lines"
    folder.mkdir()
    (folder / "a.txt").write_text("First line.\n\nThird line.\n")
    (folder / "b.txt").write_text("\x00\n")
    rows = read_all(open_corpus(folder))
    assert [(r.id, r.index) for r in rows] == [("a.txt:1", 0), ("a.txt:3", 2), ("b.txt:1", 3)]
    assert isinstance(rows[-1], BadRow) and rows[-1].reason.startswith("b.txt: ")


def test_mixed_formats_no_parts_and_ids_in_some_parts_only_are_refused(tmp_path):
    mixed = tmp_path / "mixed"
    parquet_parts(mixed, count=1)
    write_jsonl(mixed / "extra.jsonl", [{"text": "Hi."}])
    with pytest.raises(CorpusError, match=r"more than one format.*extra\.jsonl.*glob"):
        open_corpus(mixed)
    (mixed / "extra.jsonl").unlink()
    (mixed / "notes.md").write_text("about the data")
    with pytest.raises(CorpusError, match=r"'notes\.md' is not named as a corpus file.*--format"):
        open_corpus(mixed)
    empty = tmp_path / "empty"
    (empty / "_temporary").mkdir(parents=True)
    (empty / "_temporary" / "part-0.parquet").write_bytes(b"")
    with pytest.raises(CorpusError, match="no corpus parts found"):
        open_corpus(empty)
    with pytest.raises(CorpusError, match="no corpus parts found"):
        open_corpus(str(tmp_path / "mixed" / "nothing-*.parquet"))
    ids = tmp_path / "ids"
    ids.mkdir()
    write_jsonl(ids / "a.jsonl", [{"id": "x", "text": "Hi."}])
    write_jsonl(ids / "b.jsonl", [{"text": "Hi."}])
    with pytest.raises(CorpusError, match=r"'a\.jsonl' has an id column 'id' and the part 'b\.jsonl' has none"):
        open_corpus(ids)


def test_uris_stay_strings_and_credentials_in_them_are_refused(tmp_path):
    cfg = RunConfig.from_options(corpus="s3://bucket/corpus/", engine="tone")
    assert cfg.input.corpus == "s3://bucket/corpus/" and cfg.output.folder == Path("out/corpus")
    assert RunConfig.from_options(corpus="data/train-*.parquet").output.folder == Path("out/train")
    assert RunConfig.from_options(corpus="data/c.jsonl").output.folder == Path("out/c")
    for uri in ("s3://AKIAEXAMPLE:s3cr3t@bucket/corpus/", "s3://bucket/corpus/?secret_key=s3cr3t"):
        with pytest.raises(UsageError, match="holds credentials") as refused:
            open_corpus(uri)
        assert "s3cr3t" not in str(refused.value)
    ids = parquet_parts(tmp_path / "local")
    assert [r.id for r in open_corpus(f"file://{tmp_path}/local/")] == ids


# -- a job over parts ----------------------------------------------------------------------------------


def test_a_part_changed_added_or_removed_is_refused_naming_it(tmp_path):
    folder = tmp_path / "corpus"
    ids = parquet_parts(folder)
    out = tmp_path / "out"
    assert run(config(folder, out)).status == "complete"
    assert_exactly_once(out, ids)
    job = json.loads((out / ".cosybatch" / "job.json").read_text())
    assert sorted(job["fingerprint"]["corpus"]["parts"]) == sorted({i.split(":")[0] for i in ids})

    middle = folder / "part-00001.parquet"
    original = middle.read_bytes()
    pq.write_table(pa.table({"text": ["Changed.", "Also changed."]}), middle)
    with pytest.raises(ResumeMismatchError, match=r"corpus corpus \(part part-00001\.parquet changed\)"):
        run(config(folder, out))
    middle.write_bytes(original)  # the same bytes again: the same corpus
    assert run(config(folder, out)).stats["items_done"] == 0

    first = folder / "part-00000.parquet"
    first.rename(tmp_path / "aside.parquet")
    with pytest.raises(ResumeMismatchError, match=r"part part-00000\.parquet removed"):
        run(config(folder, out))
    (tmp_path / "aside.parquet").rename(first)

    pq.write_table(pa.table({"text": ["Added later.", "Added too."]}), folder / "part-00003.parquet")
    with pytest.raises(ResumeMismatchError, match=r"(?s)part part-00003\.parquet added.*--allow-corpus-change"):
        run(config(folder, out))
    result = run(config(folder, out, allow_corpus_change=True))
    assert result.status == "complete" and result.stats["items_done"] == 2
    assert_exactly_once(out, [*ids, "part-00003.parquet:0", "part-00003.parquet:1"])


def test_shards_split_the_parts_rows_by_id(tmp_path):
    folder = tmp_path / "corpus"
    ids = parquet_parts(folder, count=3, rows=4)
    out = tmp_path / "out"
    made = {}
    for index in range(2):
        assert run(config(str(folder / "part-*.parquet"), out, shard=f"{index}/2")).status == "complete"
        made[index] = set(read_output(out / f"part-{index:05d}-of-00002"))
    assert made[0] and made[1] and not made[0] & made[1]
    assert sorted(made[0] | made[1]) == sorted(ids)


# -- a real S3 API -------------------------------------------------------------------------------------




@pytest.mark.slow
def test_a_corpus_of_parquet_parts_in_s3(s3, tmp_path):
    from pyarrow import fs as pafs

    store = pafs.S3FileSystem(endpoint_override=s3.endpoint.split("://")[1], scheme="http", access_key="testing",
                              secret_key="testing", region="us-east-1", allow_bucket_creation=True)
    local = tmp_path / "parts"
    ids = parquet_parts(local)
    for part in sorted(local.iterdir()):
        with store.open_output_stream(f"{s3.bucket}/corpus/{part.name}") as f:
            f.write(part.read_bytes())
    with store.open_output_stream(f"{s3.bucket}/corpus/_SUCCESS") as f:
        f.write(b"")
    env = {**S3_ENV, "AWS_ENDPOINT_URL": s3.endpoint}

    out = tmp_path / "out"
    proc = cli("run", f"s3://{s3.bucket}/corpus/", "--out", out, "--engine", "tone", "--progress", "none", env=env)
    assert proc.returncode == 0, proc.stderr
    assert_exactly_once(out, ids)
    job = json.loads((out / ".cosybatch" / "job.json").read_text())
    parts = job["fingerprint"]["corpus"]["parts"]
    assert sorted(parts) == [f"part-{p:05d}.parquet" for p in range(3)]
    assert all(p["etag"] and p["size"] == (local / name).stat().st_size for name, p in parts.items())
    recorded = [out / ".cosybatch" / "job.json", out / ".cosybatch" / "run.json", out / "stats.json",
                out / "README.md"]
    for path in recorded:
        assert "testing" not in path.read_text(), f"a credential in {path.name}"
    assert json.loads((out / ".cosybatch" / "run.json").read_text())["corpus"] == f"s3://{s3.bucket}/corpus/"
    again = cli("run", f"s3://{s3.bucket}/corpus/", "--out", out, "--engine", "tone", "--progress", "none", env=env)
    assert again.returncode == 0 and json.loads(again.stdout.splitlines()[-1])["items_done"] == 0

    missing = tmp_path / "missing"
    proc = cli("run", "s3://no-such-bucket/corpus/", "--out", missing, "--engine", "tone", env=env)
    assert proc.returncode == 2, proc.stderr
    assert "'no-such-bucket' does not exist" in proc.stderr and "AWS_ENDPOINT_URL" in proc.stderr
    assert "testing" not in proc.stderr
    assert not missing.exists()  # refused before any work: no folder left behind

    gz = tmp_path / "gz"
    gz.mkdir()
    for p in range(2):
        data = "".join(json.dumps({"text": f"Row {r} of part {p}."}) + "\n" for r in range(3)).encode()
        # compression=None: gzipped here, as a writer would; pyarrow would gzip it again by its suffix
        with store.open_output_stream(f"{s3.bucket}/lines/part-{p}.jsonl.gz", compression=None) as f:
            f.write(gzip.compress(data))
    proc = cli("run", f"s3://{s3.bucket}/lines/part-*.jsonl.gz", "--out", gz / "out", "--engine", "tone", "--progress",
               "none", env=env)
    assert proc.returncode == 0, proc.stderr
    assert_exactly_once(gz / "out", [f"part-{p}.jsonl.gz:{r}" for p in range(2) for r in range(3)])
