"""Issue 23, cases 3, 4, 9, 10: merge and export check what they read (job settings, corpus,
worker count, locks, shard sizes) and never leave half a dataset; status reads a damaged
run.json; verify through a closed pipe keeps its code; the cache clears dead builders' files."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, write_jsonl

from cosybatch.errors import UsageError
from cosybatch.run.local import run
from cosybatch.store.distributed import merge
from cosybatch.store.exports import export
from cosybatch.store.status import describe, job_status


def rows(n: int, prefix: str = "r") -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": f"Row {i} says something."} for i in range(n)]


def finished(tone, tmp_path, n: int = 8, **settings):
    corpus = write_jsonl(tmp_path / "c.jsonl", rows(n))
    out = tmp_path / "out"
    assert run(tone(corpus, out, shard_max_items=2, **settings)).status == "complete"
    return corpus, out


# -- 9. status on a run.json with wrong types ------------------------------------------------------
@pytest.mark.parametrize("run_json", ['{"started": "yesterday", "total_rows": "ten"}', '[1, 2]',
                                      '{"total_rows": 5, "total_is_estimate": "yes"}'])
def test_status_reads_the_journal_when_run_json_has_wrong_types(tone, tmp_path, run_json):
    _, out = finished(tone, tmp_path)
    (out / ".cosybatch" / "run.json").write_text(run_json)
    status = job_status(out)
    assert (status["status"], status["done"]) == ("complete", 8)
    assert any("run.json is unreadable" in w for w in status["warnings"])
    assert "run.json is unreadable" in describe(status)
