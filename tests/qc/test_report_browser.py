"""The audit page in a real browser: headless Chromium from the system packages loads report.html
from disk, runs its script and plays (loads the metadata of) every embedded clip, WAV, FLAC and
Opus (data: URIs of their own types); the DOM it dumps
is read back. Skipped, saying how to install it, only where no chromium binary exists."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from report_page import HOSTILE_ID, Page, make_rows

from cosybatch.qc import report
from cosybatch.qc.report import write_report
from cosybatch.run.shaping import resample
from cosybatch.store.audio import coded_rate, decode, encode
from cosybatch.store.shards import as_committed, committed_pcm

# --headless is the new headless mode in Chromium >= 132 (the old one was split off); as root the
# sandbox cannot start, hence --no-sandbox. --virtual-time-budget lets the page's pending work (the
# 40 clips' metadata) finish before --dump-dom prints the DOM; --enable-logging=stderr --v=0 prints
# the page's console messages (uncaught errors, CSP refusals) to stderr as "INFO:CONSOLE" lines.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=20000",
    "--dump-dom",
]


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no chromium binary on PATH: install it with `apt-get install -y chromium` (.ci/run does when it can)")


@pytest.mark.slow
def test_the_page_renders_and_every_clip_loads_in_chromium(tmp_path):
    browser = chromium()
    rows, wavs = make_rows(60, hostile=True)
    rows[0]["qc_score"] = 99.0  # the hostile row is shown, as the worst
    # Half heard (their words a JSON string, as qc.parquet has them), half transcribed.
    for i, r in enumerate(rows[::2]):
        r.update(qc_cer=None, qc_support=i / 3, words=json.dumps([[HOSTILE_ID, 0.0, 0.2, 0.05], ["ok", 0.2, 0.4, 0.9]]))
    durations = {r["id"]: r["duration_s"] for r in rows}
    # A third of the clips FLAC and a third Opus (--audio-format): the page embeds each with its own type.
    formats = {}
    for i, r in enumerate(rows):
        formats[r["id"]] = ("wav", "flac", "opus")[i % 3]
        if formats[r["id"]] != "wav":
            audio, rate = decode(wavs[r["id"]])
            target = coded_rate(formats[r["id"]], rate)
            wavs[r["id"]] = encode(committed_pcm(as_committed(resample(audio, rate, target))), target, formats[r["id"]])
    summary = {"rows": 60, "hours": round(sum(durations.values()) / 3600, 4), "qc": {"mode": "asr"}}
    path = tmp_path / "report.html"
    write_report(path, rows, summary, wavs.__getitem__, throughput=[(t, 6.0 * t) for t in range(30)])

    done = subprocess.run(
        [browser, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", path.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    page = Page(done.stdout)

    # It rendered: the title, the summary, the plots and their points.
    assert page.find("title")[0].text == "cosybatch report"
    assert [tr.attrs["data-key"] for tr in page.find("tr", within="summary")] == ["rows", "hours", "qc.mode"]
    assert len(page.find("circle", within="duration-vs-length")) == 60
    assert len(page.find("rect", within="cer-histogram", class_="bar")) == report.CER_BINS + 1
    bars = page.find("rect", within="support-histogram", class_="bar")
    assert len(bars) == report.SUPPORT_BINS and sum(int(b.attrs["data-count"]) for b in bars) == 30
    assert len(page.find("line", within="support-histogram", class_="limit")) == 1
    assert len(page.find("rect", within="pass-rate", class_="bar")) == 3
    assert len(page.find("polyline", within="throughput")) == 1
    assert page.find("article", data_id=HOSTILE_ID)  # escaped, so it stayed text, not markup
    heard = [a for a in page.find("article") if a.attrs["data-id"] in {r["id"] for r in rows[::2]}]
    words = page.find("bdi", class_="w")
    assert len(words) == 2 * len(heard) and [w.text for w in words if "low" in w.attrs["class"]] == (
        [HOSTILE_ID] * len(heard))

    # The script ran and every clip loaded, with the duration the WAV has, FLAC and Opus clips too.
    players = page.find("audio")
    assert len(players) == 40
    assert {formats[a.attrs["data-id"]] for a in players} == {"wav", "flac", "opus"}
    for a in players:
        assert a.attrs.get("data-loaded") == "1" and "data-error" not in a.attrs, a.attrs.get("data-id")
        assert abs(float(a.attrs["data-duration"]) - durations[a.attrs["data-id"]]) < 0.05
    assert page.find("body")[0].attrs.get("data-audio-ready") == "40/40"
    assert page.by_id("audio-status").text == "40 of 40 clips playable"

    # No console message: no uncaught error, nothing refused by the page's Content-Security-Policy.
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console


@pytest.mark.slow
def test_a_runs_own_page_in_chromium(tmp_path):
    """The page a real run writes at its end: real clips of the default voice, transcribed."""
    import pyarrow.parquet as pq
    from helpers import corpus_rows, write_parquet

    from cosybatch.config import RunConfig
    from cosybatch.run.local import run

    browser = chromium()
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(6))
    out = tmp_path / "out"
    assert run(RunConfig.from_options(corpus=corpus, out=out, progress="none", qc="asr",
                                      qc_asr_rows="all")).status == "complete"
    manifest = {r["id"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    done = subprocess.run([browser, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", (out / "report.html").as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    page = Page(done.stdout)
    assert {c.attrs["data-id"] for c in page.find("circle", within="duration-vs-length")} == set(manifest)
    bars = page.find("rect", within="support-histogram", class_="bar")
    assert sum(int(b.attrs["data-count"]) for b in bars) == 6  # every clip was heard
    assert page.by_id("plot-cer") is None  # none too long to be heard: no clip was transcribed instead
    assert len(page.find("tr", within="calibration")) == 2  # the head, and the one voice
    players = page.find("audio")
    assert {a.attrs["data-id"] for a in players} == set(manifest)  # 6 rows: all among the worst 20
    for a in players:
        assert a.attrs.get("data-loaded") == "1"
        assert abs(float(a.attrs["data-duration"]) - manifest[a.attrs["data-id"]]["duration_s"]) < 0.05
        card = page.find("article", data_id=a.attrs["data-id"])[0]
        assert [w for w in page.find("bdi", class_="w") if card in w.ancestors]  # its words, from its KEY.json
    assert page.find("body")[0].attrs.get("data-audio-ready") == "6/6"
    assert len(page.find("polyline", within="throughput")) == 1
