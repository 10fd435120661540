"""The whole job through the CLI on the real bundled voice: every id once, audio decodes at the
voice's rate, durations follow the text, and the output loads with tarfile and webdataset."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from conftest import write_jsonl, write_parquet
from helpers import read_output

from cosybatch.config import RunConfig
from cosybatch.job import run


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "cosybatch", *args], capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:{proc.stdout}\nstderr:{proc.stderr}")
    return proc


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "jsonl.gz"])
def test_run_writes_every_id_once(tmp_path, texts, fmt):
    rows = [{"id": f"row-{i}", "text": t} for i, t in enumerate(texts)]
    if fmt == "parquet":
        corpus = write_parquet(tmp_path / "c.parquet", rows)
    else:
        corpus = write_jsonl(tmp_path / f"c.{fmt}", rows, gz=fmt.endswith(".gz"))
    out = tmp_path / "out"
    proc = cli("run", str(corpus), "--out", str(out), "--shard-max-items", "3")
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
    run(RunConfig(corpus=corpus, out=out, progress="none"))
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
    run(RunConfig(corpus=corpus, out=out, progress="none"))
    assert set(read_output(out)) == {"0", "1", "2"}


def test_voice_column_selects_the_voice_per_row(tmp_path, texts):
    from cosybatch.engines.piper import bundled_voice

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
    result = run(RunConfig(corpus=corpus, out=out, voice_dir=voices, progress="none"))
    items = read_output(out)
    assert set(items) == {"default", "named"}
    assert items["named"]["meta"]["voice"] == "joe-copy"
    assert items["default"]["meta"]["voice"] == "en_US-joe-medium"
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    reasons = {f["id"]: f["reason"] for f in failures}
    assert "no model file" in reasons["missing"]
    assert "not a path" in reasons["path"]
    assert result.stats["items_failed"] == 2


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
