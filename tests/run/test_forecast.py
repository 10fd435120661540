"""`cosybatch run --plan-only`: the predicted hours, batches, wall time and disk size of a run, checked
against the run itself on the example corpus's first 20 rows."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from helpers import ROOT

from cosybatch.config import RunConfig
from cosybatch.run.forecast import plan_only
from cosybatch.run.local import run


def test_the_plan_predicts_the_run(tmp_path):
    corpus = tmp_path / "c.parquet"
    pq.write_table(pq.read_table(ROOT / "examples" / "corpus.parquet").slice(0, 20), corpus)
    cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "out" / "first", batch_size=4, window=8,
                                 sentence_silence=0.2,
                    progress="none")
    before = plan_only(cfg)["plan"]
    assert before["rows"] == before["rows_to_synthesise"] == 20 and before["rate"] is None
    assert isinstance(before["wall_seconds"], str)  # no rate known yet: said, not guessed

    result = run(cfg)
    assert result.exit_code == 0
    stats = json.loads((cfg.output.folder / "stats.json").read_text())
    assert before["audio_seconds"] == pytest.approx(stats["audio_seconds"], rel=0.2)
    assert before["batches"] == stats["batches"] > 20 // 4
    shards = sum(p.stat().st_size for p in cfg.output.folder.glob("shard-*.tar"))
    assert before["disk_bytes"] == pytest.approx(shards, rel=0.2)

    # Another job in the same output root: the earlier run's rate gives the wall time.
    after = plan_only(cfg.with_options(out=tmp_path / "out" / "second"))["plan"]
    rate = stats["audio_seconds_per_wall_second"]
    assert after["rate"]["audio_seconds_per_wall_second"] == rate and after["rate"]["from"] == str(cfg.output.folder)
    steady = stats["audio_seconds"] / (stats["wall_seconds"] - stats["cold_start_seconds"])  # the rate past the load
    assert after["rate"]["steady_audio_seconds_per_wall_second"] == pytest.approx(steady, abs=1e-3)
    wall = stats["cold_start_seconds"] + after["audio_seconds"] / steady
    assert after["wall_seconds"] == pytest.approx(wall, abs=0.2)
    given = plan_only(cfg.with_options(out=tmp_path / "elsewhere" / "x"), rate=50.0)["plan"]
    assert given["rate"] == {"audio_seconds_per_wall_second": 50.0, "from": "--rate"}
    # A later run of another voice (or device) in the root is another engine's figure: not used.
    other = tmp_path / "out" / "other"
    other.mkdir()
    (other / "stats.json").write_text(json.dumps({**stats, "voice": "de_DE-thorsten-medium",
                                                  "audio_seconds_per_wall_second": 999.0,
                                                  "last_success_timestamp_seconds": 4e9}))
    assert plan_only(cfg.with_options(out=tmp_path / "out" / "third"))["plan"]["rate"]["from"] == str(cfg.output.folder)

def test_an_engine_without_an_estimate_says_unknown(tmp_path):
    from helpers import write_jsonl

    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "One. Two."}, {"id": "b", "text": "..."}])
    plan = plan_only(RunConfig.from_options(corpus=corpus, out=tmp_path / "out", engine="tone",
                                            progress="none"))["plan"]
    assert plan["audio_hours"] == "unknown" and plan["rows"] == 2 and plan["rows_failing"] == 1
    assert plan["failing_examples"] == [{"id": "b", "row": 1, "reason": "nothing to sound"}]
    assert plan["pieces"] == 2 and plan["batches"] == 1  # the tone engine's default: 4 pieces a batch


@pytest.mark.slow
def test_the_command_line(tmp_path):
    from helpers import cli, write_jsonl

    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "One. Two."}])
    proc = cli("run", corpus, "--out", tmp_path / "out", "--plan-only", "--rate", "20", check=True)
    plan = json.loads(proc.stdout)["plan"]
    assert plan["rows"] == 1 and plan["pieces"] == 2 and plan["rate"]["from"] == "--rate"
    assert "cosybatch: plan: 1 rows" in proc.stderr and "at 20 audio-s/s" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written
    refused = cli("run", corpus, "--out", tmp_path / "out", "--rate", "20")
    assert refused.returncode == 2 and "--rate is for --plan-only" in refused.stderr
