"""Exactly once, for real: keys never collide, a rerun repairs a damaged folder instead of calling
it complete, `verify` reads everything back, and a changed corpus is continued only when asked,
with what changed listed."""

from __future__ import annotations

import gzip
import json
import signal
import tarfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import cli, journal, read_output, start_run, write_jsonl, write_parquet
from hypothesis import given
from hypothesis import strategies as st

from cosybatch.config import RunConfig
from cosybatch.errors import CorpusError, ResumeMismatchError
from cosybatch.run.local import run
from cosybatch.store.shards import MAX_KEY_CHARS, item_key
from cosybatch.store.status import job_status
from cosybatch.store.verify import verify as verify_output

SHORT = ["Yes.", "Good morning.", "No.", "Why not?", "Fine.", "Hello there.", "Thanks.", "Go on."]


def rows(n: int, prefix: str = "id") -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": SHORT[i % len(SHORT)]} for i in range(n)]


def config(corpus: Path, out: Path, **kw) -> RunConfig:
    """The job in process on the tone engine (tests/plugin): these tests are about the folder, not the
    voice. Batches of one, so that shards close at exactly 3 items (a batch commits whole)."""
    return RunConfig(corpus=corpus, out=out, progress="none",
                     **{"engine": "tone", "batch_size": 1, "shard_max_items": 3, **kw})


def verify(out: Path, command: bool = False) -> dict:
    """verify's report: in process, or from `cosybatch verify --json` (exit 0 when ok, else 3)."""
    if not command:
        return verify_output(out)
    proc = cli("verify", out, "--json")
    result = json.loads(proc.stdout.splitlines()[-1])
    assert proc.returncode == (0 if result["ok"] else 3), proc.stderr
    return result


def assert_exactly_once(out: Path, expected_ids) -> dict:
    items = read_output(out)  # every WAV decodes; fails on an id written twice
    assert sorted(items) == sorted(expected_ids)
    manifest = pq.read_table(out / "manifest.parquet").to_pylist()
    assert sorted(r["id"] for r in manifest) == sorted(expected_ids)
    assert len({(r["shard"], r["key"]) for r in manifest}) == len(manifest)
    assert verify(out)["ok"], verify(out)
    return items


# -- keys ------------------------------------------------------------------------------------

def _id_pairs():
    """Arbitrary ids, and ids built to look like another id's key (the collisions that matter)."""
    ids = st.text(min_size=1, max_size=90)

    @st.composite
    def pair(draw):
        a = draw(ids)
        kind = draw(st.sampled_from(["any", "key", "key-prefix", "hex-tail", "long"]))
        if kind == "any":
            b = draw(ids)
        elif kind == "key":
            b = item_key(a)
        elif kind == "key-prefix":
            b = item_key(a)[: draw(st.integers(1, MAX_KEY_CHARS + 21))]
        elif kind == "hex-tail":
            b = draw(st.from_regex(r"[A-Za-z0-9_-]{0,40}", fullmatch=True)) + "_" + draw(
                st.from_regex(r"[0-9a-f]{20}", fullmatch=True))
        else:
            b = a + draw(st.text(min_size=1, max_size=40))
        return a, b

    return pair()


@given(_id_pairs())
def test_keys_are_injective_and_safe(pair):
    a, b = pair
    if a == b:
        return
    ka, kb = item_key(a), item_key(b)
    assert ka != kb, (a, b)
    for key in (ka, kb):
        assert key and set(key) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
        assert len(key) + len(".json") <= 100


def test_an_id_shaped_like_another_ids_key_gets_its_own_key(tmp_path):
    import webdataset as wds

    other = item_key("a.b")  # 'a_b_' + 20 hex digits: a legal id in its own right
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a.b", "text": "First."}, {"id": other, "text": "Second."}])
    out = tmp_path / "out"
    assert run(config(corpus, out)).status == "complete"
    items = assert_exactly_once(out, ["a.b", other])
    assert items["a.b"]["key"] != items[other]["key"]
    samples = list(wds.WebDataset(str(out / "shard-000000.tar"), shardshuffle=False))
    assert sorted(json.loads(s["json"])["id"] for s in samples) == sorted(["a.b", other])


# -- a damaged folder ------------------------------------------------------------------------

@pytest.fixture
def finished(tmp_path):
    """A finished 7-row job: shards of 3, 3 and 1 items."""
    data = rows(7)
    corpus = write_parquet(tmp_path / "c.parquet", data)
    out = tmp_path / "out"
    assert run(config(corpus, out)).status == "complete"
    return corpus, out, [r["id"] for r in data]


def test_a_deleted_shard_is_synthesised_again(finished):
    corpus, out, ids = finished
    (out / "shard-000001.tar").unlink()
    status = job_status(out)  # what `cosybatch status --json` prints
    assert status["status"] == "damaged" and "shard-000001.tar is missing" in status["problems"][0]
    result = run(config(corpus, out))
    assert result.status == "complete" and result.exit_code == 0
    assert result.stats["items_done"] == 3  # exactly the lost ones
    assert "shard-000001.tar is missing: 3 items will be synthesised again" in result.stats["repairs"][0]
    assert_exactly_once(out, ids)
    assert job_status(out)["status"] == "complete"


def test_a_truncated_shard_keeps_its_whole_items(finished):
    corpus, out, ids = finished
    shard = out / "shard-000000.tar"
    with tarfile.open(shard) as tar:
        members = tar.getmembers()
    # Cut inside the second item's WAV: the first item is whole, the second and third are not.
    cut = members[2].offset_data + 100
    with open(shard, "r+b") as f:
        f.truncate(cut)
    result = run(config(corpus, out))
    assert result.status == "complete"
    assert result.stats["items_done"] == 2
    assert "2 items no longer in it will be synthesised again" in result.stats["repairs"][0]
    items = assert_exactly_once(out, ids)
    kept = members[0].name.split(".")[0]
    assert [i["shard"] for i in items.values() if i["key"] == kept] == ["shard-000000.tar"]


def test_a_shard_missing_only_its_end_blocks_is_mended_in_place(finished):
    corpus, out, ids = finished
    shard = out / "shard-000002.tar"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 700)
    result = run(config(corpus, out))
    assert result.stats["items_done"] == 0 and shard.stat().st_size == size
    assert "shard-000002.tar" in result.stats["repairs"][0]
    assert_exactly_once(out, ids)


def test_a_torn_journal_tail_never_writes_an_id_twice(finished):
    corpus, out, ids = finished
    path = out / ".cosybatch" / "journal.jsonl"
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    last_items = max(i for i, line in enumerate(lines) if b'"t":"items"' in line)
    torn = b"".join(lines[:last_items]) + lines[last_items][: len(lines[last_items]) // 2]
    path.write_bytes(torn)
    result = run(config(corpus, out))
    assert result.status == "complete"
    assert result.stats["items_done"] == 0  # the audio was still in a finished shard: recorded, not redone
    assert "recorded from their KEY.json" in " ".join(result.stats["repairs"])
    assert_exactly_once(out, ids)


@pytest.mark.parametrize("damage", ["not json", "a flipped key"])
def test_a_journal_damaged_in_the_middle_recovers_from_the_shards(finished, damage):
    corpus, out, ids = finished
    path = out / ".cosybatch" / "journal.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    assert b'"t":"items"' in lines[1]
    lines[1] = b"{garbage\n" if damage == "not json" else lines[1].replace(b'"t":"items"', b'"t":"itens"')
    path.write_bytes(b"".join(lines))
    result = run(config(corpus, out))
    assert result.status == "complete" and result.stats["items_done"] == 0
    assert "journal.jsonl line 2 was damaged" in result.stats["repairs"][0]
    assert_exactly_once(out, ids)


def _killed_after_commits(corpus: Path, out: Path, n: int) -> None:
    proc = start_run(corpus, out, shard_max_items=1000, progress="none")
    deadline = time.monotonic() + 180
    while sum(len(r["items"]) for r in journal(out) if r["t"] == "items") < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_a_missing_open_shard_is_synthesised_again(tmp_path):
    data = rows(40)
    corpus = write_parquet(tmp_path / "c.parquet", data)
    out = tmp_path / "out"
    _killed_after_commits(corpus, out, 2)
    partial = out / "shard-000000.tar.partial"  # shards of 1000 items: still open
    partial.unlink()
    result = run(config(corpus, out, engine="piper"))  # the killed run's engine: slow enough to be killed
    assert result.status == "complete"
    assert "shard-000000.tar.partial is missing" in result.stats["repairs"][0]
    assert result.stats["items_done"] == len(data)
    assert_exactly_once(out, [r["id"] for r in data])


@pytest.mark.slow
def test_a_shortened_open_shard_keeps_what_is_whole(tmp_path):
    data = rows(40)
    corpus = write_parquet(tmp_path / "c.parquet", data)
    out = tmp_path / "out"
    _killed_after_commits(corpus, out, 3)
    committed = sum(len(r["items"]) for r in journal(out) if r["t"] == "items")
    partial = out / "shard-000000.tar.partial"
    with open(partial, "r+b") as f:
        f.truncate(1000)  # inside the first item's WAV
    result = run(config(corpus, out, engine="piper"))
    assert result.status == "complete"
    assert f"{committed} items will be synthesised again" in result.stats["repairs"][0]
    assert result.stats["items_done"] == len(data)
    assert_exactly_once(out, [r["id"] for r in data])
    # A shard that lost items is finished where it ends; nothing is appended to it afterwards.
    records = journal(out)
    lost = next(i for i, r in enumerate(records) if r["t"] == "lost")
    assert records[lost + 1] == {"t": "closed", "shard": 0, "items": 0}
    assert not [r for r in records[lost:] if r["t"] == "items" and r["shard"] == 0]


def test_run_never_reports_complete_over_a_shard_lost_during_the_run(tmp_path, monkeypatch):
    from cosybatch.run.committer import Committer

    data = rows(7)
    corpus = write_parquet(tmp_path / "c.parquet", data)
    out = tmp_path / "out"
    real_close = Committer.close_shard

    def close_then_lose(self):
        index = self.shard.index
        real_close(self)
        if index == 0:
            (out / "shard-000000.tar").unlink()  # an operator's cleanup script, say

    monkeypatch.setattr(Committer, "close_shard", close_then_lose)
    result = run(config(corpus, out))
    assert result.status == "damaged" and result.exit_code == 4
    assert result.stats["problems"] == ["shard-000000.tar is missing; the journal has 3 items in it"]
    monkeypatch.setattr(Committer, "close_shard", real_close)
    assert run(config(corpus, out)).status == "complete"
    assert_exactly_once(out, [r["id"] for r in data])


@pytest.mark.slow
def test_verify_reads_every_shard_whole(finished):
    _corpus, out, ids = finished
    result = verify(out, command=True)
    assert result["ok"] and result["items"] == len(ids) and result["shards"] == 3
    # Damage that keeps every size: a header block overwritten in the middle of a shard.
    shard = out / "shard-000001.tar"
    with tarfile.open(shard) as tar:
        third = tar.getmembers()[2]
    with open(shard, "r+b") as f:
        f.seek(third.offset)
        f.write(b"\xff" * 512)
    (out / "shard-000002.tar").unlink()
    result = verify(out, command=True)
    assert not result["ok"]
    problems = "\n".join(result["problems"])
    assert "shard-000001.tar: unreadable past its last whole member" in problems
    assert "shard-000002.tar is missing (1 items of the manifest are in it)" in problems
    assert "is in the manifest but not in the shard" in problems
    text = cli("verify", out)
    assert text.returncode == 3 and "problems" in text.stdout


# -- a changed corpus ------------------------------------------------------------------------

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
    result = run(RunConfig(corpus=corpus, out=out, progress="none", engine="tone", allow_corpus_change=True))
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
