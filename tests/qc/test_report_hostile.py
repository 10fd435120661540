"""The audit page, OUT/report.html, against a hostile or careless folder and hostile rows (issue 31,
holes 11 and 14): what it reads back from the folder is a regular file, never a link or a FIFO
followed or waited on."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading

import pytest
from helpers import write_jsonl
from report_page import Page

from cosybatch.qc.audit import write_job_report
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
