"""cosybatch/store/repair.py in process: `repair(out, journal, admit)` on the folder of a real
finished job (the tone engine, 12 rows, 4 shards of 3 items, one item per batch), damaged each way
its docstring lists. After every repair the files and the journal agree: each id the journal keeps
is in the shard it names, once, and its WAV decodes; every shard is as long as the journal says; a
second repair finds nothing to do; what was lost is named; bytes that are not this job's are set
aside under .cosybatch/quarantine/ and reported. A rerun then makes only what was lost, and the job
holds every id exactly once. (The same damage reached through `cosybatch run`: test_integrity.py
and test_tampering.py.)"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import assert_exactly_once, journal, read_output, write_parquet

from cosybatch.config import RunConfig
from cosybatch.run.local import run
from cosybatch.store.checkpoint import EOA_BYTES, Journal, OutputDir
from cosybatch.store.repair import RepairReport, check_sizes, repair
from cosybatch.store.shards import shard_name

SHORT = ["Yes.", "Good morning.", "No.", "Why not?", "Fine.", "Hello there."]
IDS = [f"id{i}" for i in range(12)]


def config(corpus: Path, out: Path) -> RunConfig:
    """Batches of one, so that every item is a batch of its own and shards close at 3 items."""
    return RunConfig.from_options(corpus=corpus, out=out, progress="none", engine="tone", batch_size=1,
                                  shard_max_items=3)


def finished_job(folder: Path, ids: list[str]) -> tuple[Path, Path]:
    corpus = write_parquet(folder / "c.parquet", [{"id": i, "text": SHORT[n % len(SHORT)]} for n, i in enumerate(ids)])
    out = folder / "out"
    assert run(config(corpus, out)).status == "complete"
    return corpus, out


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, Path]:
    """The finished job, run once for the module; each test damages a copy of it."""
    return finished_job(tmp_path_factory.mktemp("repair"), IDS)


@pytest.fixture(scope="module")
def other_job(tmp_path_factory) -> Path:
    """Another job's finished folder (ids x0, x1, x2): the source of a foreign shard."""
    return finished_job(tmp_path_factory.mktemp("other"), ["x0", "x1", "x2"])[1]


@pytest.fixture
def job(made, tmp_path) -> tuple[Path, Path]:
    corpus, out = made
    shutil.copytree(out, tmp_path / "out")
    return corpus, tmp_path / "out"


def ours(meta: dict):
    """admit, as a job's own: an item whose id is in this corpus may be adopted."""
    return None if meta.get("id") in IDS else "its id is not in this corpus"


def repaired(out: Path, admit=ours) -> RepairReport:
    folder = OutputDir(out)
    log = Journal(folder.journal_path)
    try:
        return repair(folder, log, admit=admit)
    finally:
        log.close()


def batches(out: Path, index: int) -> list[tuple[int, list[str]]]:
    """Shard INDEX's committed batches as the journal lists them: (end offset, ids)."""
    return [(r["end"], [i["id"] for i in r["items"]])
            for r in journal(out) if r["t"] == "items" and r["shard"] == index]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_agrees(out: Path, report: RepairReport) -> dict:
    """The files and the journal agree: each id the ledger keeps is in the shard it names, once,
    its WAV decoding to its recorded length; no shard holds anything else; every shard is exactly
    as long as the journal says; nothing is left open; a second repair has nothing to do."""
    items = read_output(out)  # every member readable, no id twice
    assert sorted(items) == sorted(report.ledger.live)
    for item_id, item in items.items():
        assert item["shard"] == shard_name(report.ledger.live[item_id][1])
        assert len(item["audio"]) == item["meta"]["num_samples"] > 0
    assert not list(out.glob("*.partial"))
    folder = OutputDir(out)
    folder.write_manifest(report.ledger)  # as the job does after its repair
    assert check_sizes(folder, report.ledger) == []
    again = repaired(out)
    assert (again.notes, again.quarantined, sorted(again.ledger.live)) == ([], [], sorted(report.ledger.live))
    return items


def assert_rerun_makes(corpus: Path, out: Path, remade: int) -> None:
    """A rerun finds nothing to repair, synthesises only the `remade` lost items, and the job then
    holds every id exactly once."""
    result = run(config(corpus, out))
    assert (result.status, result.stats["repairs"], result.stats["items_done"]) == ("complete", [], remade)
    assert_exactly_once(out, IDS)


def test_an_intact_folder_is_left_alone(job):
    corpus, out = job
    before = {p.name: sha(p) for p in out.glob("shard-*.tar")}
    report = repaired(out)
    assert (report.notes, report.quarantined) == ([], [])
    assert sorted(report.ledger.live) == sorted(IDS)
    assert {p.name: sha(p) for p in out.glob("shard-*.tar")} == before
    assert_agrees(out, report)
    assert_rerun_makes(corpus, out, 0)


@pytest.mark.parametrize("into", ["audio", "header"])
def test_a_truncated_shard_keeps_its_whole_items_and_loses_the_torn_one(job, into):
    corpus, out = job
    (_, kept_1), (end_2, kept_2), (_, torn) = batches(out, 1)
    shard = out / shard_name(1)
    size = shard.stat().st_size
    cut = end_2 + (1000 if into == "audio" else 100)  # inside the torn item's WAV, or its first header
    with open(shard, "r+b") as f:
        f.truncate(cut)
    report = repaired(out)
    assert report.notes == [f"shard-000001.tar was {cut} B where the journal expects {size} B: 1 items no longer in "
                            f"it will be synthesised again ({torn[0]!r}); it now ends after its last whole item "
                            f"({end_2 + EOA_BYTES} B)"]
    assert report.quarantined == []
    assert sorted(report.ledger.live) == sorted(set(IDS) - set(torn))
    assert shard.stat().st_size == end_2 + EOA_BYTES
    items = assert_agrees(out, report)
    assert sorted(i for i, item in items.items() if item["shard"] == shard.name) == sorted(kept_1 + kept_2)
    lost, closed = journal(out)[-2:]  # one record of the loss, written before the file was cut
    assert (lost["t"], lost["shard"], lost["end"], lost["ids"]) == ("lost", 1, end_2, torn)
    assert closed == {"t": "closed", "shard": 1, "items": 2}
    assert_rerun_makes(corpus, out, 1)


def test_a_shard_missing_only_its_end_blocks_is_mended_in_place(job):
    corpus, out = job
    shard = out / shard_name(0)
    end = batches(out, 0)[-1][0]
    with open(shard, "r+b") as f:
        f.truncate(end)
    report = repaired(out)
    assert report.notes == [f"shard-000000.tar was {end} B where the journal expects {end + EOA_BYTES} B: "
                            f"it now ends after its last whole item ({end + EOA_BYTES} B)"]
    assert sorted(report.ledger.live) == sorted(IDS)  # nothing lost
    assert shard.stat().st_size == end + EOA_BYTES
    assert_agrees(out, report)
    assert_rerun_makes(corpus, out, 0)


def test_a_missing_finished_shard_is_recorded_lost(job):
    corpus, out = job
    gone = [i for _, ids in batches(out, 2) for i in ids]
    (out / shard_name(2)).unlink()
    report = repaired(out)
    assert report.notes == [f"shard-000002.tar is missing: 3 items will be synthesised again "
                            f"({', '.join(map(repr, gone))})"]
    assert sorted(report.ledger.live) == sorted(set(IDS) - set(gone))
    assert_agrees(out, report)
    assert_rerun_makes(corpus, out, 3)


def torn_journal_tail(out: Path) -> list[str]:
    """Cut the journal inside the line that committed the last shard's last item, as a kill in the
    middle of that write leaves it (the shard's `closed` line after it never written). Returns the
    ids of that item."""
    path = OutputDir(out).journal_path
    lines = path.read_bytes().splitlines(keepends=True)
    assert b'"t":"closed","shard":3' in lines[-1] and b'"shard":3' in lines[-2]
    path.write_bytes(b"".join(lines[:-2]) + lines[-2][: len(lines[-2]) // 2])
    return [i["id"] for i in json.loads(lines[-2])["items"]]


def test_a_torn_journal_tail_recovers_the_item_from_the_shard(job):
    """The shard was finished (fsynced, renamed) before the journal line was torn: its last item
    is recorded again from its own KEY.json, never synthesised a second time."""
    corpus, out = job
    unlisted = torn_journal_tail(out)
    before = sha(out / shard_name(3))
    report = repaired(out)
    # A torn last line is a killed write, cut without a word; the one note is the shard's.
    assert len(report.notes) == 1 and report.notes[0].startswith("shard-000003.tar was ")
    assert report.notes[0].endswith(": 1 whole items in it that the journal did not list were recorded from "
                                    "their KEY.json")
    assert sorted(report.ledger.live) == sorted(IDS) and report.quarantined == []
    assert sha(out / shard_name(3)) == before  # its bytes untouched
    recovered = [r for r in journal(out) if r.get("recovered")]
    assert [[i["id"] for i in r["items"]] for r in recovered] == [unlisted]
    assert journal(out)[-1] == {"t": "closed", "shard": 3, "items": 3}
    assert_agrees(out, report)
    assert_rerun_makes(corpus, out, 0)


def test_audio_changed_after_it_was_written_is_not_recovered(job):
    """As above, but the unlisted item's WAV changed: its wav_sha256 no longer matches, so it is
    not adopted; the shard is cut before it and a copy of the shard as it was is quarantined."""
    corpus, out = job
    unlisted = torn_journal_tail(out)
    shard = out / shard_name(3)
    end = batches(out, 3)[-1][0]  # what the journal still lists
    data = bytearray(shard.read_bytes())
    data[end + 512 + 100] ^= 0x55  # a byte of the unlisted item's audio, after its WAV header
    shard.write_bytes(bytes(data))
    report = repaired(out)
    assert len(report.quarantined) == 1
    q = report.quarantined[0]
    assert q["shard"] == shard.name and q["file"].startswith(".cosybatch/quarantine/shard-000003.tar.")
    assert q["reason"] == f"{unlisted[0]}.wav does not match its wav_sha256: the audio changed after it was written"
    assert (out / q["file"]).read_bytes() == bytes(data)  # the shard as it was, kept for whoever looks
    assert f"a copy of it as it was is in {q['file']}" in report.notes[0]
    assert sorted(report.ledger.live) == sorted(set(IDS) - set(unlisted))
    assert shard.stat().st_size == end + EOA_BYTES
    assert_agrees(out, report)
    assert_rerun_makes(corpus, out, 1)


def test_a_journal_damaged_in_the_middle_recovers_every_finished_shard(job):
    corpus, out = job
    path = OutputDir(out).journal_path
    lines = path.read_bytes().splitlines(keepends=True)
    assert b'"shard":1' in lines[4]  # shard 1's first batch: it and everything after are dropped
    path.write_bytes(b"".join(lines[:4]) + b"not json\n" + b"".join(lines[5:]))
    report = repaired(out)
    assert re.fullmatch(r"journal\.jsonl line 5 was damaged; it and the 11 lines after it \(\d+ B\) were dropped; "
                        r"what finished shards still hold is recovered below", report.notes[0])
    assert [n.split(" was ")[0] for n in report.notes[1:]] == [shard_name(i) for i in (1, 2, 3)]
    assert sorted(report.ledger.live) == sorted(IDS) and report.quarantined == []
    assert_agrees(out, report)
    assert_rerun_makes(corpus, out, 0)


def test_a_shortened_open_shard_keeps_its_whole_items_and_is_finished(job):
    """Shard 3 as a run killed before it closed the shard leaves it (shard-000003.tar.partial, no
    end blocks, no `closed` line), then shortened inside its second item."""
    corpus, out = job
    path = OutputDir(out).journal_path
    lines = path.read_bytes().splitlines(keepends=True)
    assert lines[-1].startswith(b'{"t":"closed","shard":3')
    path.write_bytes(b"".join(lines[:-1]))
    (first_end, kept), (_, second), (committed, third) = batches(out, 3)
    partial = out / (shard_name(3) + ".partial")
    (out / shard_name(3)).rename(partial)
    cut = first_end + 700
    with open(partial, "r+b") as f:
        f.truncate(cut)
    report = repaired(out)
    lost = second + third
    assert report.notes == [f"{partial.name} is {cut} B, shorter than its committed {committed} B: 2 items will be "
                            f"synthesised again ({', '.join(map(repr, lost))})"]
    assert not partial.exists() and (out / shard_name(3)).stat().st_size == first_end + EOA_BYTES
    assert journal(out)[-1] == {"t": "closed", "shard": 3, "items": 1}  # nothing is appended after a loss
    items = assert_agrees(out, report)
    assert [i for i, item in items.items() if item["shard"] == shard_name(3)] == kept
    assert_rerun_makes(corpus, out, 2)


@pytest.mark.parametrize("source", ["another job's", "this job's own, again"])
def test_a_shard_the_journal_never_wrote_is_quarantined(job, other_job, source):
    """A shard file at an index the journal does not know: another job's (its ids are not in this
    corpus, so `admit` refuses them), or a copy of one of this job's shards (its ids are committed
    already: refused even with no `admit`). It is moved aside whole and named."""
    corpus, out = job
    dropped_in = out / shard_name(7)
    if source == "another job's":
        shutil.copyfile(other_job / shard_name(0), dropped_in)
        first = batches(other_job, 0)[0][1][0]
        admit, why = ours, f"{first} (id {first!r}) is not this job's: its id is not in this corpus"
    else:
        shutil.copyfile(out / shard_name(0), dropped_in)
        first = batches(out, 0)[0][1][0]
        admit, why = None, f"{first} holds id {first!r}, which is committed already"
    data = dropped_in.read_bytes()
    report = repaired(out, admit=admit)
    assert len(report.quarantined) == 1
    q = report.quarantined[0]
    assert (q["shard"], q["reason"]) == (dropped_in.name, why)
    assert q["file"].startswith(".cosybatch/quarantine/shard-000007.tar.")
    assert (out / q["file"]).read_bytes() == data and not dropped_in.exists()
    assert report.notes == [f"shard-000007.tar was {len(data)} B where the journal expects {EOA_BYTES} B: {why}; "
                            f"nothing in it was usable: it was moved to {q['file']}"]
    assert sorted(report.ledger.live) == sorted(IDS)
    assert_agrees(out, report)
    assert_rerun_makes(corpus, out, 0)


def test_foreign_bytes_after_the_journals_items_are_cut_and_a_copy_quarantined(job):
    """Shard 1 keeps its first item, but the bytes after it are shard 0's: the journal's second
    member is not there, so the shard is cut after the first, its other ids are lost, and a copy
    of the file as it was goes to quarantine."""
    corpus, out = job
    (end_1, kept), (_, second), (_, third) = batches(out, 1)
    shard = out / shard_name(1)
    mixed = shard.read_bytes()[:end_1] + (out / shard_name(0)).read_bytes()[batches(out, 0)[0][0]:]
    shard.write_bytes(mixed)
    report = repaired(out)
    assert len(report.quarantined) == 1
    q = report.quarantined[0]
    assert q["shard"] == shard.name and (out / q["file"]).read_bytes() == mixed
    assert q["reason"].startswith(f"byte {end_1} holds ") and q["reason"].endswith(
        f"where the journal wrote '{second[0]}.wav': not this shard's bytes")
    assert f"a copy of it as it was is in {q['file']}" in report.notes[0]
    assert sorted(report.ledger.live) == sorted(set(IDS) - set(second + third))
    assert shard.stat().st_size == end_1 + EOA_BYTES
    items = assert_agrees(out, report)
    assert [i for i, item in items.items() if item["shard"] == shard.name] == kept
    assert_rerun_makes(corpus, out, 2)
