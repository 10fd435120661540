"""Exactly once, for real: keys never collide, a rerun repairs a damaged folder instead of calling
it complete, and `verify` reads everything back. (A changed corpus: tests/run/test_job_corpus.py.)"""

from __future__ import annotations

import json
import signal
import tarfile
import time
from pathlib import Path

import pytest
from helpers import assert_exactly_once, cli, journal, start_run, write_jsonl, write_parquet
from hypothesis import given
from hypothesis import strategies as st

from cosybatch.config import RunConfig
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
    return RunConfig.from_options(corpus=corpus, out=out, progress="none",
                     **{"engine": "tone", "batch_size": 1, "shard_max_items": 3, **kw})


def verify(out: Path, command: bool = False) -> dict:
    """verify's report: in process, or from `cosybatch verify --json` (exit 0 when ok, else 3)."""
    if not command:
        return verify_output(out)
    proc = cli("verify", out, "--json")
    result = json.loads(proc.stdout.splitlines()[-1])
    assert proc.returncode == (0 if result["ok"] else 3), proc.stderr
    return result


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
