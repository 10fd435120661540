"""Dataset formats: the Hugging Face, NeMo and Lhotse exports load in their own libraries, and the
HF export decodes where torchcodec is installed."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile
from helpers import cli, corpus_rows, read_output, write_parquet

from cosybatch.config import RunConfig
from cosybatch.run.local import run


@pytest.mark.slow
def test_dataset_formats_load_in_their_libraries(tmp_path):
    rows = corpus_rows(5)
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    run(RunConfig(corpus=corpus, out=out, export=("hf", "nemo", "lhotse"), shard_max_items=2, progress="none"))
    truth = {i["meta"]["id"]: i for i in read_output(out).values()}

    import datasets

    hf = datasets.load_dataset("parquet", data_files=sorted(map(str, (out / "exports/hf/data").glob("*.parquet"))),
                               split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert isinstance(hf.features["audio"], datasets.Audio)
    assert hf.features["audio"].sampling_rate == 22050
    raw = hf.cast_column("audio", datasets.Audio(decode=False))
    assert sorted(raw["id"]) == sorted(truth)
    for row in raw:
        audio, sr = soundfile.read(io.BytesIO(row["audio"]["bytes"]), dtype="float32")
        assert sr == 22050 and len(audio) == len(truth[row["id"]]["audio"])
        assert row["text"] == truth[row["id"]]["meta"]["text"]
        assert row["duration"] == pytest.approx(len(audio) / sr)
        qc = truth[row["id"]]["meta"]["qc"]  # the quality signals ride along, filterable
        assert row["qc_speech_share"] == qc["signals"]["speech_share"] and row["qc_flags"] == ",".join(qc["flags"])

    manifest = out / "exports/nemo/manifest.jsonl"
    entries = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert sorted(e["id"] for e in entries) == sorted(truth)
    for e in entries:
        assert set(e) >= {"audio_filepath", "duration", "text"}
        info = soundfile.info(str(manifest.parent / e["audio_filepath"]))
        assert info.duration == pytest.approx(e["duration"], abs=1e-3)
        assert e["text"] == truth[e["id"]]["meta"]["text"]
        assert e["qc_s_per_unit"] == truth[e["id"]]["meta"]["qc"]["signals"]["s_per_unit"]

    import lhotse

    cuts = lhotse.CutSet.from_manifests(
        recordings=lhotse.load_manifest(out / "exports/lhotse/recordings.jsonl.gz"),
        supervisions=lhotse.load_manifest(out / "exports/lhotse/supervisions.jsonl.gz"))
    assert len(cuts) == 5
    for cut in cuts:
        item_id = cut.supervisions[0].custom["id"]
        assert cut.duration == pytest.approx(truth[item_id]["meta"]["duration"])
        assert cut.supervisions[0].text == truth[item_id]["meta"]["text"]
        assert cut.load_audio().shape == (1, len(truth[item_id]["audio"]))
        assert cut.supervisions[0].custom["qc"]["qc_score"] == truth[item_id]["meta"]["qc"]["score"]
    with gzip.open(out / "exports/lhotse/recordings.jsonl.gz", "rt") as f:
        assert all(Path(json.loads(line)["sources"][0]["source"]).is_absolute() for line in f)

    # `cosybatch export` does the same on demand, also for a sharded job's root.
    proc = cli("export", str(out), "--to", "nemo")
    assert proc.returncode == 0 and json.loads(proc.stdout)["nemo"].endswith("manifest.jsonl")


# -- reading the HF export (docs/production.md's snippet runs in tests/docs) ---------------------------


def hf_export_in(tmp_path: Path) -> dict:
    """out/corpus/exports/hf under tmp_path, as the README's paths expect; the env to run in."""
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(3))
    result = run(RunConfig(corpus=corpus, out=tmp_path / "out" / "corpus", export=("hf",), progress="none"))
    assert result.exit_code == 0
    return {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.slow
def test_decoding_the_hf_audio_with_torchcodec(tmp_path):
    """The README's decode path, where torchcodec and FFmpeg are installed (not on the CI machines)."""
    probe = subprocess.run([sys.executable, "-c", "import torchcodec.decoders"], capture_output=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip("torchcodec (with FFmpeg) is not installed")
    env = hf_export_in(tmp_path)
    code = ('import datasets\nds = datasets.load_dataset("parquet", data_files="out/corpus/exports/hf/data/*.parquet", '
            'split="train")\na = ds[0]["audio"]\nprint(a["sampling_rate"], len(a["array"]))\n')
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    sr, samples = proc.stdout.split()
    assert sr == "22050" and int(samples) > 0


def test_exports_carry_the_rows_language_and_pool_speaker(tmp_path):
    """The language column reaches every export (HF `language`, NeMo `lang`, Lhotse supervisions'
    `language`), each loaded by its own library; rows without one have none."""
    rows = corpus_rows(3)
    rows[0]["language"], rows[1]["language"] = "en", "en-GB"
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    run(RunConfig(corpus=corpus, out=out, export=("hf", "nemo", "lhotse"), progress="none", qc="off"))
    want = {"utt/0": "en", "utt/1": "en-GB", "utt/2": None}

    import datasets

    hf = datasets.load_dataset("parquet", data_files=sorted(map(str, (out / "exports/hf/data").glob("*.parquet"))),
                               split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert hf.features["language"] == datasets.Value("string")
    assert dict(zip(hf["id"], hf["language"], strict=True)) == want

    entries = [json.loads(line) for line in (out / "exports/nemo/manifest.jsonl").read_text().splitlines()]
    assert {e["id"]: e.get("lang") for e in entries} == want

    import lhotse

    supervisions = lhotse.load_manifest(out / "exports/lhotse/supervisions.jsonl.gz")
    assert {s.custom["id"]: s.language for s in supervisions} == want
