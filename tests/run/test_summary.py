"""Newcomer defect 2: the stdout JSON line means one thing per key. items_done, items_failed and
audio_seconds count this run (as stats.json and the stderr line do); job_totals the whole job."""

from __future__ import annotations

import json

from helpers import write_jsonl

from cosybatch.config import RunConfig
from cosybatch.run.local import run


def test_a_resume_reports_this_runs_counts_and_the_job_totals(tmp_path):
    rows = [{"id": f"r{i}", "text": f"Row {i}."} for i in range(12)] + [{"id": "bad", "text": "..."}]
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "out", engine="tone", progress="none")
    first = run(RunConfig.from_options(**{**cfg.options(), "limit": 5}))
    assert json.loads(first.summary_line())["items_done"] == 5

    second = run(cfg)
    line = json.loads(second.summary_line())
    stats = json.loads((cfg.output.folder / "stats.json").read_text())
    assert (line["items_done"], line["items_failed"]) == (7, 1) == (stats["items_done"], stats["items_failed"])
    assert line["audio_seconds"] == stats["audio_seconds"]
    assert line["job_totals"] == stats["job_totals"]
    assert (line["job_totals"]["items_done"], line["job_totals"]["items_failed"]) == (12, 1)
    assert list(line) == ["status", "out", "items_done", "items_failed", "audio_seconds",
                          "audio_seconds_per_wall_second", "job_totals"]
