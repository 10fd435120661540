"""The audit page (cosybatch/qc/report.py) as a file: escaping, the plots' elements, the clips it
chooses, self-containment and the atomic write. tests/qc/test_report_browser.py renders it."""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import pytest
from report_page import HOSTILE_ID, HOSTILE_TEXT, Page, make_rows, sine_wav

from cosybatch.qc import report
from cosybatch.qc.report import write_report

SUMMARY = {"rows": 60, "hours": 0.05, "pass_rate": 0.857, "qc": {"mode": "asr", "thresholds": {"cer": 0.2}}}


def written(tmp_path: Path, rows, wavs=None, *, name="report.html", **kw) -> tuple[str, Page]:
    path = tmp_path / name
    clip = wavs.__getitem__ if wavs is not None else (lambda _id: sine_wav(0.1))
    write_report(path, rows, kw.pop("summary", SUMMARY), clip, **kw)
    text = path.read_text(encoding="utf-8")
    return text, Page(text)


def shown(page: Page, group: str) -> list[str]:
    return [a.attrs["data-id"] for a in page.find("audio", within=group)]


def test_hostile_ids_and_texts_are_escaped(tmp_path):
    rows, wavs = make_rows(60, hostile=True)
    rows[0]["qc_score"] = 99.0  # among the worst, so its card (id, text, audio) is on the page
    rows[0]["qc_flags"] = ["<b>flag</b>"]
    rows[0]["voice"] = '"voice" & <i>'
    summary = {"<key>": "<script>x</script>", "nested": {"a&b": '"q"'}}
    text, page = written(tmp_path, rows, wavs, summary=summary, title="<title> & co")
    # Only the page's own script element; no hostile markup survives as markup.
    assert text.count("<script") == 1
    for raw in (HOSTILE_ID, HOSTILE_TEXT, "<b>flag</b>", "<img", "<i>", "<key>", "<title> &"):
        assert raw not in text
    # ... and every value reads back exactly as given once a parser unescapes it.
    assert page.find("article", data_id=HOSTILE_ID)
    assert page.find("audio", data_id=HOSTILE_ID)
    assert page.find("circle", within="duration-vs-length", data_id=HOSTILE_ID)
    card = page.find("article", data_id=HOSTILE_ID)[0]
    assert HOSTILE_TEXT in card.text and "<b>flag</b>" in card.text and '"voice" & <i>' in card.text
    assert page.find("rect", within="pass-rate", data_voice='"voice" & <i>')
    cells = {tr.attrs["data-key"]: tr.text for tr in page.find("tr", within="summary")}
    assert cells["<key>"].endswith("<script>x</script>") and cells["nested.a&b"].endswith('"q"')
    assert page.find("title")[0].text == "<title> & co"


def test_summary_is_flattened_with_dotted_keys(tmp_path):
    _, page = written(tmp_path, make_rows(5)[0])
    keys = [tr.attrs["data-key"] for tr in page.find("tr", within="summary")]
    assert keys == ["rows", "hours", "pass_rate", "qc.mode", "qc.thresholds.cer"]


def test_one_circle_per_row_coloured_by_status(tmp_path):
    rows, wavs = make_rows(60)
    _, page = written(tmp_path, rows, wavs)
    circles = page.find("circle", within="duration-vs-length")
    assert len(circles) == 60
    assert sorted(c.attrs["data-id"] for c in circles) == sorted(r["id"] for r in rows)
    expected = {r["id"]: report.status(r) for r in rows}
    assert {c.attrs["data-id"]: c.attrs["class"] for c in circles} == expected
    assert set(expected.values()) == {"passed", "flagged", "failed"}
    assert [li.attrs["data-status"] for li in page.find("li", within="scatter-legend")] == [
        "passed",
        "flagged",
        "failed",
    ]
    assert page.find("text", within="duration-vs-length", class_="xtick")
    assert page.find("text", within="duration-vs-length", class_="label")
    assert page.by_id("scatter-cap") is None


def test_the_scatter_is_capped_by_a_seeded_sample_and_says_so(tmp_path):
    rows, _ = make_rows(report.SCATTER_CAP + 700, asr=False, audio=False)
    _, page = written(tmp_path, rows, seed=3)
    ids = [c.attrs["data-id"] for c in page.find("circle", within="duration-vs-length")]
    assert len(ids) == report.SCATTER_CAP == 5000
    assert "5,000 of the 5,700 clips" in page.by_id("scatter-cap").text
    _, again = written(tmp_path, rows, seed=3, name="again.html")
    _, other = written(tmp_path, rows, seed=4, name="other.html")
    assert ids == [c.attrs["data-id"] for c in again.find("circle", within="duration-vs-length")]
    assert set(ids) != {c.attrs["data-id"] for c in other.find("circle", within="duration-vs-length")}


def test_the_worst_are_the_twenty_highest_scores(tmp_path):
    rows, wavs = make_rows(60)
    _, page = written(tmp_path, rows, wavs)
    by_score = sorted(rows, key=lambda r: -r["qc_score"])
    assert shown(page, "worst") == [r["id"] for r in by_score[:20]]


def test_ties_in_score_go_by_id(tmp_path):
    rows, wavs = make_rows(30)
    for r in rows:
        r["qc_score"] = 0.0
    rows.reverse()
    _, page = written(tmp_path, rows, wavs)
    assert shown(page, "worst") == sorted(r["id"] for r in rows)[:20]


def test_the_random_twenty_are_seeded_and_exclude_the_worst(tmp_path):
    rows, wavs = make_rows(60)
    samples = {}
    for seed in (0, 1):
        _, page = written(tmp_path, rows, wavs, seed=seed, name=f"s{seed}.html")
        samples[seed] = shown(page, "sample")
        assert len(samples[seed]) == 20 and len(set(samples[seed])) == 20
        assert not set(samples[seed]) & set(shown(page, "worst"))
    _, page = written(tmp_path, list(reversed(rows)), wavs, seed=0, name="again.html")
    assert shown(page, "sample") == samples[0]  # the same seed, rows in another order
    assert samples[0] != samples[1]


def test_fewer_rows_fewer_clips_and_the_clip_function_is_called_for_those_shown_only(tmp_path):
    rows, wavs = make_rows(27)
    asked = []
    write_report(tmp_path / "r.html", rows, SUMMARY, lambda rid: asked.append(rid) or wavs[rid])
    page = Page((tmp_path / "r.html").read_text())
    assert len(shown(page, "worst")) == 20 and len(shown(page, "sample")) == 7
    assert sorted(asked) == sorted(r["id"] for r in rows)
    asked.clear()
    write_report(
        tmp_path / "r.html", make_rows(200, audio=False)[0], SUMMARY, lambda rid: asked.append(rid) or sine_wav(0.1)
    )
    assert len(asked) == len(set(asked)) == 40


def test_audio_is_embedded_as_wav_data(tmp_path):
    rows, wavs = make_rows(60)
    _, page = written(tmp_path, rows, wavs)
    players = page.find("audio")
    assert len(players) == 40
    for a in players:
        assert a.attrs["preload"] == "metadata" and "controls" in a.attrs
        assert a.attrs["src"].startswith("data:audio/wav;base64,")
    first = players[0]
    assert base64.b64decode(first.attrs["src"].split(",", 1)[1]) == wavs[first.attrs["data-id"]]


def test_an_unreadable_clip_is_shown_not_fatal(tmp_path):
    rows, wavs = make_rows(30)
    worst = max(rows, key=lambda r: r["qc_score"])["id"]
    del wavs[worst]
    _, page = written(tmp_path, rows, wavs)
    card = page.find("article", data_id=worst)[0]
    assert not page.find("audio", data_id=worst)
    assert "could not be read: KeyError" in card.text
    assert len(page.find("audio")) == 29


def test_the_cer_histogram_counts_every_transcribed_row(tmp_path):
    rows, wavs = make_rows(60)
    rows[1]["qc_cer"] = None  # one row not transcribed
    _, page = written(tmp_path, rows, wavs)
    bars = page.find("rect", within="cer-histogram", class_="bar")
    assert len(bars) == report.CER_BINS + 1
    assert sum(int(b.attrs["data-count"]) for b in bars) == 59
    overflow = page.find("rect", within="cer-histogram", class_="overflow")
    assert int(overflow[0].attrs["data-count"]) == sum(1 for r in rows if (r["qc_cer"] or 0) >= 1)
    assert page.by_id("cer-none") is None


def test_no_asr_no_histogram_but_a_note(tmp_path):
    _, page = written(tmp_path, make_rows(10, asr=False)[0])
    assert page.by_id("cer-histogram") is None
    assert "no ASR ran" in page.by_id("cer-none").text


def test_pass_rate_per_voice(tmp_path):
    rows, wavs = make_rows(60)
    rows[0]["qc_pass"], rows[0]["qc_flags"] = None, []  # no gate, no flag: counts as a pass
    rows[3]["qc_pass"], rows[3]["qc_flags"] = None, ["slow"]  # no gate, flagged: not a pass
    _, page = written(tmp_path, rows, wavs)
    bars = {b.attrs["data-voice"]: b for b in page.find("rect", within="pass-rate", class_="bar")}
    assert sorted(bars) == sorted({r["voice"] for r in rows})
    for voice, bar in bars.items():
        mine = [r for r in rows if r["voice"] == voice]
        assert int(bar.attrs["data-total"]) == len(mine)
        assert int(bar.attrs["data-passed"]) == sum(report.passes(r) for r in mine)
    assert report.passes(rows[0]) and not report.passes(rows[3])


def test_throughput_line_or_a_note(tmp_path):
    points = [(t * 1.5, t * 9.25) for t in range(40)]
    _, page = written(tmp_path, make_rows(5)[0], throughput=points)
    line = page.find("polyline", within="throughput")
    assert len(line) == 1 and len(line[0].attrs["points"].split()) == 40
    _, page = written(tmp_path, make_rows(5)[0], name="none.html")
    assert page.by_id("throughput") is None and page.by_id("throughput-none") is not None


def test_rows_with_only_the_required_keys(tmp_path):
    rows = [{"id": f"r{i}", "text": "a b c", "duration_s": 1.0 + i} for i in range(25)]
    _, page = written(tmp_path, rows)
    assert len(page.find("circle", within="duration-vs-length")) == 25
    assert len(page.find("audio")) == 25
    assert page.by_id("cer-none") is not None
    written(tmp_path, [], name="empty.html")  # and no rows at all


def test_self_contained_no_network_reference(tmp_path):
    rows, wavs = make_rows(60)
    text, page = written(tmp_path, rows, wavs, throughput=[(1, 2), (2, 5)])
    assert "http://" not in text and "https://" not in text
    assert not re.search(r"""\b(?:href|src)=["'](?!data:)""", text)  # every src is a data: URI
    assert not page.find("link") and not page.find("img") and not page.find("iframe")
    scripts = page.find("script")
    assert len(scripts) == 1 and "src" not in scripts[0].attrs
    csp = [m for m in page.find("meta") if m.attrs.get("http-equiv") == "Content-Security-Policy"]
    assert "default-src 'none'" in csp[0].attrs["content"]


def test_same_arguments_same_bytes(tmp_path):
    rows, wavs = make_rows(60)
    first, _ = written(tmp_path, rows, wavs, name="a.html")
    second, _ = written(tmp_path, rows, wavs, name="b.html")
    assert first == second


def test_the_write_is_atomic(tmp_path, monkeypatch):
    rows, wavs = make_rows(30)
    path = tmp_path / "report.html"
    write_report(path, rows, SUMMARY, wavs.__getitem__)
    assert os.listdir(tmp_path) == ["report.html"]
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_report(path, rows, {"changed": True}, wavs.__getitem__)
    assert os.listdir(tmp_path) == ["report.html"] and path.read_bytes() == before


# -- the hearing: support histogram, words, calibration ------------------------------------------------
HOSTILE_WORD = '<script>alert("w")</script>'


def hear(rows, every: int = 1) -> list[dict]:
    """Give every `every`-th row a hearing instead of a CER (its words as qc.parquet holds them: a JSON
    string): supports from -1 to 12, so both end bars fill; the others keep their CER (long clips)."""
    heard = []
    for i, r in enumerate(rows):
        if i % every:
            continue
        words = [["Say", 0.0, 0.3, 0.92], ["it", 0.3, 0.5, 0.3], ["twice", 0.5, 0.9, 0.04]]
        r.update(qc_cer=None, qc_wer=None, qc_asr_text=None, qc_support=round(-1 + 13 * i / len(rows), 3),
                 words=json.dumps(words), worst=-0.5, beyond_s=0.71, stretch_s=0.2)
        heard.append(r)
    return heard


def classes(card_words) -> list[tuple[str, str]]:
    return [(w.text, " ".join(c for c in w.attrs["class"].split() if c != "w")) for w in card_words]


def test_the_support_histogram_counts_every_heard_clip_and_marks_the_limit(tmp_path):
    rows, wavs = make_rows(60)
    heard = hear(rows, every=2)
    heard[1]["qc_support"], heard[2]["qc_support"] = float("nan"), float("inf")  # not counted, not fatal
    counted = [r["qc_support"] for r in heard[3:]] + [heard[0]["qc_support"]]
    summary = {"qc": {"mode": "asr", "limits": {"min_support": 2.5}}}
    _, page = written(tmp_path, rows, wavs, summary=summary)
    bars = page.find("rect", within="support-histogram", class_="bar")
    assert len(bars) == report.SUPPORT_BINS == 22
    assert sum(int(b.attrs["data-count"]) for b in bars) == len(counted) == 28
    assert int(page.find("rect", within="support-histogram", class_="under")[0].attrs["data-count"]) == sum(
        1 for s in counted if s < 0)
    assert int(page.find("rect", within="support-histogram", class_="over")[0].attrs["data-count"]) == sum(
        1 for s in counted if s >= 10)
    below = page.find("rect", within="support-histogram", class_="below")
    assert [b.attrs["data-lo"] for b in below] == ["-inf", "0", "0.5", "1", "1.5", "2"]  # wholly under 2.5
    assert page.find("line", within="support-histogram", class_="limit")[0].attrs["data-limit"] == "2.5"
    assert f"{sum(1 for s in counted if s < 2.5)} below the limit 2.5" in page.by_id("plot-support").text
    # The other 30 clips were transcribed (too long to be heard): their CER histogram stays.
    cer = page.find("rect", within="cer-histogram", class_="bar")
    assert sum(int(b.attrs["data-count"]) for b in cer) == 30
    assert "transcribed rather than heard" in page.by_id("plot-cer").text

    # Every clip heard: no CER histogram, no "no ASR" note; without limits in the summary, the default.
    hear(rows)
    _, page = written(tmp_path, rows, wavs, name="all.html")
    assert sum(int(b.attrs["data-count"]) for b in page.find("rect", within="support-histogram", class_="bar")) == 60
    assert page.by_id("plot-cer") is None and page.by_id("cer-none") is None
    assert page.find("line", within="support-histogram", class_="limit")[0].attrs["data-limit"] == "3"


def test_a_worst_clips_words_are_shown_coloured_by_probability_and_escaped(tmp_path):
    rows, wavs = make_rows(30, hostile=True)
    hear(rows)
    rows[0]["qc_score"] = 99.0  # the worst: the hostile row
    rows[0]["words"] = json.dumps([[HOSTILE_WORD, 0.0, 0.4, 0.6], ["&amp;", 0.4, 0.5, 0.2], ["<b>", 0.5, 0.6, 0.01],
                                   "not a word", ["x", "NaN", 1, 1]])
    rows[1]["words"] = [["listed", 0.0, 0.25, 0.099]]  # a list (not JSON) does too
    text, page = written(tmp_path, rows, wavs)
    assert text.count("<script") == 1 and HOSTILE_WORD not in text and "<b>" not in text
    card = page.find("article", data_id=rows[0]["id"])[0]
    assert card.attrs["data-group"] == "worst"
    words = [e for e in page.find("bdi", class_="w") if card in e.ancestors]
    assert classes(words) == [(HOSTILE_WORD, ""), ("&amp;", "weak"), ("<b>", "low")]
    assert [w.attrs["title"] for w in words] == ["0.00–0.40 s, p 0.600", "0.40–0.50 s, p 0.200",
                                                 "0.50–0.60 s, p 0.010"]
    assert "2 malformed entries left out" in card.text
    assert "support -1.000 · worst -0.500 · beyond 0.71 s · stretch 0.20 s" in card.text
    other = page.find("article", data_id=rows[1]["id"])[0]
    assert classes(e for e in page.find("bdi", class_="w") if other in e.ancestors) == [("listed", "low")]
    for r in rows[2:]:  # every shown clip: Say (plain) it (amber) twice (red)
        card = page.find("article", data_id=r["id"])[0]
        assert classes(e for e in page.find("bdi", class_="w") if card in e.ancestors) == [
            ("Say", ""), ("it", "weak"), ("twice", "low")]


def test_the_record_fills_in_the_hearing_only_when_its_support_is_the_rows(tmp_path):
    """What the row lacks comes from the clip's KEY.json, only for a shown clip that was heard, and
    only when that record's support is the row's (an audit's hearing is not the run's)."""
    rows, wavs = make_rows(30)
    for r in rows:
        r.update(qc_cer=None, qc_support=5.0 if int(r["id"][-2:]) % 2 else 6.0)
    rows[0]["qc_support"] = None  # not heard: no record asked
    asr = {"support": 5.0, "worst": 1.25, "beyond_s": 0.1, "stretch_s": 0.3, "words": [["Hi", 0.0, 0.5, 0.97]]}
    asked = []

    def record(row):
        asked.append(row["id"])
        return {"qc": {"asr": asr}}

    path = tmp_path / "r.html"
    write_report(path, rows, SUMMARY, wavs.__getitem__, record=record)
    page = Page(path.read_text())
    assert sorted(asked) == sorted(r["id"] for r in rows[1:])
    for r in rows:
        card = page.find("article", data_id=r["id"])[0]
        words = [e.text for e in page.find("bdi", class_="w") if card in e.ancestors]
        if r["qc_support"] == 5.0:
            assert words == ["Hi"] and "support 5.000 · worst 1.250 · beyond 0.10 s · stretch 0.30 s" in card.text
        else:
            assert words == [] and "worst" not in card.text


def test_the_calibration_table_shows_each_voices_limits(tmp_path):
    rows, wavs = make_rows(10)
    calibration = {"en_US-lessac-medium": {"min_support": 2.25, "min_word_support": -1.5, "clips": 40},
                   '<i>"v"</i>': {"min_support": 3.0, "min_word_support": 0.0, "clips": 3}, "broken": "x"}
    for summary in ({"qc": {"calibration": calibration}}, {"mode": "asr", "calibration": calibration}):
        text, page = written(tmp_path, rows, wavs, summary=summary)
        assert '<i>"v"</i>' not in text
        table = {tr.attrs["data-voice"]: {td.attrs["data-name"]: td.text for td in tr.children if td.tag == "td"}
                 for tr in page.find("tr", within="calibration") if "data-voice" in tr.attrs}
        assert table == {"en_US-lessac-medium": {"min_support": "2.25", "min_word_support": "-1.5", "clips": "40"},
                         '<i>"v"</i>': {"min_support": "3", "min_word_support": "0", "clips": "3"},
                         "broken": {"min_support": "–", "min_word_support": "–", "clips": "–"}}
    _, page = written(tmp_path, rows, wavs, name="none.html")
    assert page.by_id("calibration") is None


def test_a_runs_page_shows_each_clips_words_from_its_key_json(tmp_path):
    """A real run (`--qc asr`, 3 rows, one with markup in its text): the manifest has no words, so
    the page reads each shown clip's KEY.json from its shard."""
    from helpers import read_output, write_jsonl

    from cosybatch.config import RunConfig
    from cosybatch.run.local import run

    texts = ["The kettle is boiling.", "Please <script>alert(1)</script> close the window.", "Why not?"]
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"r{i}", "text": t} for i, t in enumerate(texts)])
    out = tmp_path / "out"
    assert run(RunConfig.from_options(corpus=corpus, out=out, progress="none", qc="asr",
                                      qc_on_fail="keep")).status == "complete"
    text = (out / "report.html").read_text()
    page = Page(text)
    assert text.count("<script") == 1 and "<script>alert(1)" not in text
    items = read_output(out)
    for rid, item in items.items():
        heard = item["meta"]["qc"]["asr"]
        card = page.find("article", data_id=rid)[0]
        assert card.attrs["data-group"] == "worst"
        words = [e for e in page.find("bdi", class_="w") if card in e.ancestors]
        expected = ["low" if p < 0.1 else "weak" if p < 0.5 else "" for _, _, _, p in heard["words"]]
        assert classes(words) == [(w[0], c) for w, c in zip(heard["words"], expected, strict=True)]
        assert f"support {heard['support']:.3f} · worst {heard['worst']:.3f}" in card.text
    bars = page.find("rect", within="support-histogram", class_="bar")
    assert sum(int(b.attrs["data-count"]) for b in bars) == 3
    stats = json.loads((out / "stats.json").read_text())["qc"]
    (voice, limits), = stats["calibration"].items()
    row = page.find("tr", within="calibration", data_voice=voice)[0]
    assert [td.text for td in row.children if td.tag == "td"] == [
        f"{limits['min_support']:g}", f"{limits['min_word_support']:g}", str(limits["clips"])]
