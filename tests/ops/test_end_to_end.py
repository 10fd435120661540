"""The whole job through the CLI on the real bundled voice: every id once, audio decodes at the
voice's rate, durations follow the text, and the output loads with tarfile and webdataset. (The
README's main job on the 120-row example corpus runs once, as the README's block, in
tests/docs/test_docs.py: check_readme asserts what a new user gets from it.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from helpers import cli, read_output, write_jsonl, write_parquet

from cosybatch.config import RunConfig
from cosybatch.run.local import run


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "jsonl.gz"])
def test_run_writes_every_id_once(tmp_path, texts, fmt):
    rows = [{"id": f"row-{i}", "text": t} for i, t in enumerate(texts)]
    if fmt == "parquet":
        corpus = write_parquet(tmp_path / "c.parquet", rows)
    else:
        corpus = write_jsonl(tmp_path / f"c.{fmt}", rows, gz=fmt.endswith(".gz"))
    out = tmp_path / "out"
    proc = cli("run", str(corpus), "--out", str(out), "--shard-max-items", "3", check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["status"] == "complete"
    assert summary["items_done"] == len(texts)

    items = read_output(out)
    assert set(items) == {r["id"] for r in rows}
    assert len(list(out.glob("shard-*.tar"))) == 3  # 8 items, 3 per shard
    assert not list(out.glob("*.partial"))
    for r in rows:
        item = items[r["id"]]
        assert item["sample_rate"] == 22050
        assert item["meta"]["text"] == r["text"]
        assert item["meta"]["num_samples"] == len(item["audio"])
        assert item["meta"]["duration"] == pytest.approx(len(item["audio"]) / 22050)
        assert abs(item["audio"]).max() > 0.5  # real, normalised speech, not silence

    # Durations grow with text length: compare the shortest and longest texts, and the ranking.
    by_len = sorted(rows, key=lambda r: len(r["text"]))
    durations = [items[r["id"]]["meta"]["duration"] for r in by_len]
    assert durations[-1] > 5 * durations[0]
    assert durations[-1] > 8.0 and durations[0] < 1.5

    manifest = pq.read_table(out / "manifest.parquet").to_pylist()
    assert sorted(m["id"] for m in manifest) == sorted(items)
    for m in manifest:
        assert items[m["id"]]["shard"] == m["shard"]
        assert items[m["id"]]["key"] == m["key"]

    stats = json.loads((out / "stats.json").read_text())
    assert stats["items_done"] == len(texts) and stats["items_failed"] == 0
    assert stats["audio_seconds"] == pytest.approx(sum(i["meta"]["duration"] for i in items.values()), rel=1e-3)
    assert set(stats["stage_seconds"]) >= {"read", "prepare", "infer", "write"}
    assert stats["device"] == "cpu" and stats["voice"] == "en_US-joe-medium"


def test_webdataset_reads_the_shards(tmp_path, texts):
    wds = pytest.importorskip("webdataset")
    corpus = write_parquet(tmp_path / "c.parquet", [{"id": f"a.b/{i}", "text": t} for i, t in enumerate(texts[:3])])
    out = tmp_path / "out"
    run(RunConfig.from_options(corpus=corpus, out=out, progress="none"))
    samples = list(wds.WebDataset(str(out / "shard-000000.tar"), shardshuffle=False))
    assert len(samples) == 3
    ids = set()
    for sample in samples:
        assert set(sample) >= {"__key__", "wav", "json"}
        assert "." not in sample["__key__"] and "/" not in sample["__key__"]
        ids.add(json.loads(sample["json"])["id"])
    assert ids == {"a.b/0", "a.b/1", "a.b/2"}


def test_rows_without_id_column_use_row_numbers(tmp_path, texts):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts[:3]])
    out = tmp_path / "out"
    run(RunConfig.from_options(corpus=corpus, out=out, progress="none"))
    assert set(read_output(out)) == {"0", "1", "2"}


def test_voice_column_selects_the_voice_per_row(tmp_path, texts):
    from cosybatch.engines.piper.voice import bundled_voice

    model, config = bundled_voice()
    voices = tmp_path / "voices"
    voices.mkdir()
    (voices / "joe-copy.onnx").symlink_to(model)
    (voices / "joe-copy.onnx.json").symlink_to(config)
    rows = [
        {"id": "default", "text": texts[2]},
        {"id": "named", "text": texts[2], "voice": "joe-copy"},
        {"id": "missing", "text": texts[2], "voice": "nobody"},
        {"id": "path", "text": texts[2], "voice": "/etc/passwd.onnx"},
    ]
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "out"
    result = run(RunConfig.from_options(corpus=corpus, out=out, engine_options={"voice_dir": voices}, progress="none"))
    items = read_output(out)
    assert set(items) == {"default", "named"}
    assert items["named"]["meta"]["voice"] == "joe-copy"
    assert items["default"]["meta"]["voice"] == "en_US-joe-medium"
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    reasons = {f["id"]: f["reason"] for f in failures}
    assert "no model file" in reasons["missing"]
    assert "not a path" in reasons["path"]
    assert result.stats["items_failed"] == 2


@pytest.mark.slow
def test_help_is_fast_and_imports_no_engine():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from cosybatch.cli import app\n"
        "r = CliRunner().invoke(app, ['run', '--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "assert 'Exit codes' in r.output\n"
        "bad = [m for m in ('onnxruntime', 'torch', 'onnx', 'pyarrow') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.slow
def test_bad_rows_are_recorded_and_good_rows_still_written(tmp_path, texts):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(
        json.dumps({"id": "good-1", "text": texts[2]}).encode() + b"\n"
        + b'{"id": "broken", "text": \n'
        + json.dumps({"id": "empty", "text": "   "}).encode() + b"\n"
        + json.dumps({"id": "good-1", "text": texts[3]}).encode() + b"\n"  # duplicate id
        + json.dumps({"id": "silent", "text": "... - ."}).encode() + b"\n"
        + json.dumps({"id": "good-2", "text": texts[1]}).encode() + b"\n"
    )
    out = tmp_path / "out"
    proc = cli("run", str(corpus), "--out", str(out), check=True)
    items = read_output(out)
    assert set(items) == {"good-1", "good-2"}
    assert items["good-1"]["meta"]["text"] == texts[2]  # the first row with a duplicate id wins
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert [(f["id"], f["row"]) for f in failures] == [(None, 1), ("empty", 2), ("good-1", 3), ("silent", 4)]
    assert "line 2 is not valid JSON" in failures[0]["reason"]
    assert "duplicate id" in failures[2]["reason"]
    assert "nothing pronounceable" in failures[3]["reason"]
    assert json.loads(proc.stdout.splitlines()[-1])["items_failed"] == 4
    # A rerun redoes nothing and records no failure twice, id-less rows included.
    rerun = json.loads(cli("run", str(corpus), "--out", str(out), check=True).stdout.splitlines()[-1])
    assert rerun["job_totals"]["items_failed"] == 4 and rerun["job_totals"]["items_done"] == 2
    assert rerun["items_failed"] == rerun["items_done"] == 0  # this run's own counts: nothing was redone
    assert len((out / "failures.jsonl").read_text().splitlines()) == 4

    # A failure threshold turns this into a non-zero exit; the committed output stays valid.
    again = cli("run", str(corpus), "--out", str(tmp_path / "strict"), "--max-failures", "2", check=False)
    assert again.returncode == 5, again.stderr
    assert json.loads(again.stdout.splitlines()[-1])["status"] == "too_many_failures"
    rate = cli("run", str(corpus), "--out", str(tmp_path / "rate"), "--max-failures", "50%", check=False)
    assert rate.returncode == 5  # 4 of 6 rows failed
    usage = cli("run", str(corpus), "--out", str(tmp_path / "x"), "--max-failures", "lots", check=False)
    assert usage.returncode == 2 and "--max-failures" in usage.stderr
