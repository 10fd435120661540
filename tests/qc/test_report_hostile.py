"""The audit page, OUT/report.html, against a hostile or careless folder and hostile rows (issue 31,
holes 11 and 14): what it reads back from the folder is a regular file, never a link or a FIFO
followed or waited on; a bidi control in an id cannot reorder the page; long ids wrap; the
throughput note is the run's rate; the page's Content-Security-Policy allows its one script by
hash, not every inline script."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import threading
from html.parser import HTMLParser

import pytest
from helpers import write_jsonl
from report_page import Page, make_rows

from cosybatch.qc import report
from cosybatch.qc.audit import write_job_report
from cosybatch.qc.report import BIDI_CONTROLS, write_report
from cosybatch.run.local import run
from cosybatch.store.readback import NotReadable


def finished(tmp_path, tone, rows=3, name="out"):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"r{i}", "text": f"Row number {i}."} for i in range(rows)])
    out = tmp_path / name
    assert run(tone(corpus, out)).status == "complete"
    assert (out / "report.html").exists()
    return corpus, out


def in_thread(target, timeout=20.0):
    """target() in a daemon thread: (finished within timeout, its result or the exception it raised)."""
    result = {}

    def call():
        try:
            result["value"] = target()
        except Exception as exc:
            result["value"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), result.get("value")


def release(fifo):
    """Let a reader blocked on FIFO go on (it reads end of file): open it for writing, close it."""
    with contextlib.suppress(OSError):  # ENXIO: no reader is waiting
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def fifo_at(path):
    path.unlink()
    os.mkfifo(path)


def test_a_fifo_journal_or_stats_costs_the_plot_not_the_page(tmp_path, tone):
    _, out = finished(tmp_path, tone)
    for name in (".cosybatch/journal.jsonl", "stats.json"):
        fifo_at(out / name)
    try:
        done, result = in_thread(lambda: write_job_report(out))
        assert done, "the audit page hung on a FIFO"
    finally:
        for name in (".cosybatch/journal.jsonl", "stats.json"):
            release(out / name)
    assert result == out / "report.html"
    page = Page((out / "report.html").read_text())
    assert page.by_id("throughput-none") is not None and len(page.find("audio")) == 3


def test_a_fifo_manifest_is_refused_not_waited_on(tmp_path, tone):
    _, out = finished(tmp_path, tone)
    fifo_at(out / "manifest.parquet")
    try:
        done, result = in_thread(lambda: write_job_report(out))
        assert done, "the audit page hung on manifest.parquet, a FIFO"
    finally:
        release(out / "manifest.parquet")
    assert isinstance(result, NotReadable) and "is a FIFO, not a regular file" in str(result)


def test_a_shard_behind_a_link_is_not_played_from(tmp_path, tone):
    """A shard replaced by a link (here to a copy of itself) is not read through: its clips are
    named as unreadable on the page, which is written all the same."""
    _, out = finished(tmp_path, tone)
    shard = out / "shard-000000.tar"
    shutil.copy(shard, tmp_path / "elsewhere.tar")
    shard.unlink()
    shard.symlink_to(tmp_path / "elsewhere.tar")
    assert write_job_report(out) == out / "report.html"
    page = Page((out / "report.html").read_text())
    assert not page.find("audio")
    errors = page.find("p", class_="clip-error")
    assert len(errors) == 3 and all("shard-000000.tar is a symbolic link" in e.text for e in errors)


@pytest.mark.parametrize("size", [100, 17 << 20])
def test_a_clip_over_the_cap_is_named_not_embedded(tmp_path, tone, size, monkeypatch):
    from cosybatch.qc import audit

    _, out = finished(tmp_path, tone)
    monkeypatch.setattr(audit, "CLIP_CAP", size)
    write_job_report(out)
    page = Page((out / "report.html").read_text())
    if size < 1000:
        assert not page.find("audio") and all("the page embeds" in e.text for e in page.find("p", class_="clip-error"))
    else:
        assert len(page.find("audio")) == 3


# -- hole 14 -----------------------------------------------------------------------------------------
RLO = "\u202e"


class _BidiReader(HTMLParser):
    """Where the page's text holds a bidi control: (the open elements, the text) of each such run."""

    VOID = frozenset({"meta", "link", "br", "img", "input", "hr", "source", "wbr", "circle", "line", "polyline"})

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.found: list[tuple[list[str], str]] = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        pass

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop() != tag:
            pass

    def handle_data(self, data):
        if BIDI_CONTROLS.intersection(data):
            self.found.append((list(self.stack), data))


def test_a_bidi_control_in_a_row_cannot_reorder_the_page(tmp_path):
    """An id ending in U+202E (RIGHT-TO-LEFT OVERRIDE) reversed the rest of its line. Every user
    string in the page's flow is isolated in <bdi>; in ids, voices, flags, summary values and the
    title the controls are shown as [U+202E] (tooltips and <title> cannot isolate)."""
    rows, wavs = make_rows(30)
    evil = "row-0000" + RLO
    wavs[evil] = wavs.pop(rows[0]["id"])
    rows[0].update(id=evil, qc_score=99.0, voice="voice" + RLO, qc_flags=["slow" + RLO],
                   text="text " + RLO + " reversed", qc_asr_text="heard " + RLO, qc_support=5.0,
                   words=json.dumps([["text", 0.0, 0.2, 0.9], [RLO, 0.2, 0.3, 0.05], ["reversed", 0.3, 0.6, 0.4]]))
    path = tmp_path / "report.html"
    write_report(path, rows, {"engine" + RLO: "tone" + RLO}, wavs.__getitem__, title="out" + RLO)
    text = path.read_text(encoding="utf-8")
    reader = _BidiReader()
    reader.feed(text)
    assert reader.found  # the text and what was heard keep theirs (the user's own text), isolated
    for stack, data in reader.found:
        assert "bdi" in stack, (stack, data)
        assert "title" not in stack, (stack, data)
    page = Page(text)
    card = page.find("article", data_id=evil)[0]  # the attribute keeps the id as it is
    ident = [e for e in page.elements if e.tag == "bdi" and "id" in e.attrs.get("class", "").split()
             and card in e.ancestors]
    assert ident[0].text == "row-0000[U+202E]"
    assert "voice voice[U+202E]" in card.text and "slow[U+202E]" in card.text
    assert page.find("title")[0].text == "out[U+202E]"
    assert "row-0000[U+202E]:" in page.find("circle", data_id=evil)[0].text


def test_long_ids_and_texts_wrap_inside_their_cards():
    css = re.sub(r"\s+", "", report._CSS)
    rules = dict(re.findall(r"([^{}]+)\{([^{}]*)\}", css))
    assert "overflow-wrap:anywhere" in rules[".clipp"].split(";")
    assert "word-break:break-all" in rules[".clip.id"].split(";")
    assert "overflow-wrap:anywhere" in rules["#summaryth,#summarytd"].split(";")


def test_the_pages_one_script_is_allowed_by_its_hash_not_by_unsafe_inline(tmp_path):
    rows, wavs = make_rows(5)
    path = tmp_path / "report.html"
    write_report(path, rows, {}, wavs.__getitem__)
    text = path.read_text(encoding="utf-8")
    policy = [m for m in Page(text).find("meta") if m.attrs.get("http-equiv") == "Content-Security-Policy"]
    directives = dict(d.strip().split(" ", 1) for d in policy[0].attrs["content"].split(";"))
    scripts = re.findall(r"<script>(.*?)</script>", text, re.S)
    assert len(scripts) == 1
    digest = base64.b64encode(hashlib.sha256(scripts[0].encode("utf-8")).digest()).decode()
    assert directives["script-src"] == f"'sha256-{digest}'"
    assert "unsafe-inline" not in directives["script-src"] and directives["default-src"] == "'none'"


def rate_note(out) -> str:
    """The throughput figure's note, the one that gives a rate."""
    return Page((out / "report.html").read_text()).find("p", within="plot-throughput", class_="note")[-1].text


def test_the_throughput_note_is_the_runs_rate_not_the_first_commits(tmp_path, tone):
    """Commits 0.01 s apart at the end of a 7.7 s run of 10 audio-seconds: 1.30 audio-s/s (the
    first commit as the start made it 1000). The line starts at the run's start."""
    _, out = finished(tmp_path, tone)
    stats = json.loads((out / "stats.json").read_text())
    expected = stats["audio_seconds"] / stats["wall_seconds"]  # the run's figure (stats rounds the seconds)
    assert abs(expected - stats["audio_seconds_per_wall_second"]) < 0.05 * expected + 0.01
    assert f"{expected:.2f} audio-seconds per second" in rate_note(out)

    journal = out / ".cosybatch" / "journal.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    commits = [r for r in records if r["t"] == "items"]
    assert len(commits) == 1
    start = 1_700_000_000.0
    first, second = json.loads(json.dumps(commits[0])), json.loads(json.dumps(commits[0]))
    first["ts"], second["ts"] = start + 7.69, start + 7.70
    for rec, audio in ((first, 5.0), (second, 5.0)):
        for item in rec["items"]:
            item["duration_s"] = audio / len(rec["items"])
    journal.write_text("".join(json.dumps(r) + "\n" for r in (first, second)))
    run_file = out / ".cosybatch" / "run.json"
    run_file.write_text(json.dumps({**json.loads(run_file.read_text()), "started": start}))
    (out / "stats.json").write_text(json.dumps({**stats, "wall_seconds": 7.7, "audio_seconds": 10.0}))
    write_job_report(out)
    note = rate_note(out)
    assert "1.30 audio-seconds per second" in note and "1000" not in note, note
    line = Page((out / "report.html").read_text()).find("polyline", within="throughput")[0]
    assert line.attrs["data-points"] == "3"  # (0, 0), then the two commits at 7.69 and 7.7 s

    # Without stats.json's figures, the rate is over the time since the job started.
    (out / "stats.json").write_text(json.dumps({"status": "complete"}))
    write_job_report(out)
    assert "10 s of audio in 7.7 s since the job started: 1.30 audio-seconds per second" in rate_note(out)


# -- the hearing's words, read from each shown clip's KEY.json ---------------------------------------------
def shard_with(path, members: dict):
    """A tar at path; members: name -> bytes, or name -> a link target (str) for a symbolic-link member."""
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            if isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_a_clips_record_is_read_only_as_a_regular_member_of_a_regular_shard(tmp_path, monkeypatch):
    """Each case costs its clip's words (said on its card), never the page, and nothing is read
    through a link, outside the folder, past the cap, or waited on."""
    out = tmp_path / "out"
    out.mkdir()
    good = json.dumps({"qc": {"asr": {"support": 5.0, "words": [["fine", 0.0, 0.5, 0.9]]}}}).encode()
    shard_with(tmp_path / "outside.tar", {"k.json": good})
    cases = {
        "good": ("good.tar", {"k.json": good}, None),
        "link": ("link.tar", None, "is a symbolic link"),
        "outside": ("../outside.tar", None, "is not inside the folder"),
        "member-link": ("member-link.tar", {"k.json": "/etc/passwd"}, "k.json in member-link.tar is not a file"),
        "big": ("big.tar", {"k.json": good + b" " * 200_000}, "more than the 150,000 read back"),
        "deep": ("deep.tar", {"k.json": b"[" * 100_000}, "RecursionError"),
        "fifo": ("fifo.tar", None, "is a FIFO"),
    }
    for shard, members, _ in cases.values():
        if members is not None:
            shard_with(out / shard, members)
    (out / "link.tar").symlink_to(tmp_path / "outside.tar")
    os.mkfifo(out / "fifo.tar")
    monkeypatch.setattr(report, "RECORD_CAP", 150_000)
    rows = [{"id": name, "text": "fine", "duration_s": 0.5, "qc_support": 5.0, "shard": shard, "key": "k"}
            for name, (shard, _, _) in cases.items()]
    try:
        done, result = in_thread(lambda: write_report(out / "report.html", rows, {}, lambda _id: b"RIFF"))
        assert done, "the page hung on a FIFO shard"
    finally:
        release(out / "fifo.tar")
    assert result is None, result
    page = Page((out / "report.html").read_text())
    for name, (_, _, error) in cases.items():
        card = page.find("article", data_id=name)[0]
        words = [e.text for e in page.find("bdi", class_="w") if card in e.ancestors]
        said = [e.text for e in page.find("p", class_="words-error") if card in e.ancestors]
        if error is None:
            assert words == ["fine"] and not said
        else:
            assert not words and len(said) == 1 and error in said[0], (name, said)
