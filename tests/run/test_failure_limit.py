"""Newcomer defect 3: exit 5 says the share and the limit: "2 of 45 rows failed (4.4%), more than 2%"."""

from __future__ import annotations

import json

from helpers import write_jsonl

from cosybatch.config import RunConfig
from cosybatch.run.local import run


def corpus(tmp_path):
    rows = [{"id": f"r{i}", "text": "..." if i in (10, 30) else f"Row {i}."} for i in range(45)]
    return write_jsonl(tmp_path / "c.jsonl", rows)


def test_a_share_limit_states_the_share_and_the_limit(tmp_path, caplog):
    cfg = RunConfig.from_options(corpus=corpus(tmp_path), out=tmp_path / "out", engine="tone", progress="none",
                    max_failures="2%")
    result = run(cfg)
    assert (result.status, result.exit_code) == ("too_many_failures", 5)
    assert "2 of 45 rows failed (4.4%), more than 2%" in caplog.text
    assert json.loads(result.summary_line())["error"].startswith("2 of 45 rows failed (4.4%), more than 2%")


def test_a_count_limit_states_it_too(tmp_path, caplog):
    cfg = RunConfig.from_options(corpus=corpus(tmp_path), out=tmp_path / "out", engine="tone", progress="none",
                    max_failures="1")
    result = run(cfg)
    assert result.exit_code == 5
    assert "rows failed (" in caplog.text and "more than 1" in caplog.text
    assert "error" not in json.loads(run(RunConfig.from_options(**{**cfg.options(),
                                                                   "max_failures": None})).summary_line())
