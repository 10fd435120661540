"""Newcomer defect 4: `merge` names the number of parts `parts`, and the merged root gets a
stats.json with the job's totals."""

from __future__ import annotations

import json

from helpers import write_jsonl

from cosybatch.config import RunConfig
from cosybatch.run.local import run
from cosybatch.store.distributed import merge


def test_merge_reports_parts_and_writes_the_totals(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"r{i}", "text": f"Row {i}."} for i in range(9)]
                         + [{"id": "bad", "text": "..."}])
    for index in range(2):
        cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "out", engine="tone", progress="none",
                        shard_index=index, shard_count=2)
        assert run(cfg).status == "complete"
    result = merge(tmp_path / "out")
    assert "count" not in result
    assert (result["parts"], result["parts_found"], result["parts_merged"]) == (2, 2, 2)
    assert (result["items"], result["failed"]) == (9, 1)
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["status"] == "complete" and stats["items"] == 9 and stats["failed"] == 1
    parts_audio = sum(json.loads((p / "stats.json").read_text())["audio_seconds"]
                      for p in (tmp_path / "out").glob("part-*"))
    assert abs(stats["audio_seconds"] - parts_audio) < 0.01
