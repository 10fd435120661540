"""OUT/README.md, the dataset card: written at the end of a complete run and by `merge` and
`export`, parsed by huggingface_hub, and never written over a README.md that cosybatch did not write."""

from __future__ import annotations

import json
import logging
import os
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
from helpers import corpus_rows, write_jsonl, write_parquet
from huggingface_hub import DatasetCard
from typer.testing import CliRunner

from cosybatch.cli import app
from cosybatch.config import RunConfig
from cosybatch.run.local import run
from cosybatch.store.card import MARKER, card_text, size_category, write_card


def test_the_card_of_a_run_parses_and_says_what_made_it(tmp_path, caplog):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(3))
    out = tmp_path / "out"
    assert run(RunConfig.from_options(corpus=corpus, out=out, progress="none")).status == "complete"
    card = DatasetCard.load(out / "README.md")
    data = card.data
    assert data.license == "unknown" and data.language == ["en"]  # the Piper voice declares English
    assert data.size_categories == ["n<1K"]
    assert data.task_categories == ["text-to-speech", "automatic-speech-recognition"]
    assert "synthetic" in data.tags and data.pretty_name == "out"
    text = card.text
    assert MARKER in card.content and "**The audio in this dataset is synthetic.**" in text
    engine = json.loads((out / ".cosybatch/job.json").read_text())["fingerprint"]["engine"]
    assert engine["model_sha256"] in text and "en_US-joe-medium" in text and "| cosybatch | 0.1.0 |" in text
    hours = sum(pq.read_table(out / "manifest.parquet").column("duration_s").to_pylist()) / 3600
    assert f"| en_US-joe-medium | 3 | {hours:.3f} |" in text
    stats = json.loads((out / "stats.json").read_text())
    assert "## Quality checks" in text and f"{stats['qc']['measured']} clips measured" in text

    # The user sets the license in our card: a rewrite keeps it. An export rewrites the card too,
    # and the HF export becomes the Hub viewer's data files.
    (out / "README.md").write_text((out / "README.md").read_text().replace("license: unknown", "license: cc0-1.0"))
    result = CliRunner().invoke(app, ["export", str(out), "--to", "hf"])
    assert result.exit_code == 0, result.output
    data = DatasetCard.load(out / "README.md").data
    assert data.license == "cc0-1.0"
    assert data.configs == [{"config_name": "default",
                             "data_files": [{"split": "train", "path": "exports/hf/data/*.parquet"}]}]

    # A README.md of the user's own (no marker) is left alone, with a warning.
    (out / "README.md").write_text("# My dataset\n\nNotes of my own.\n")
    with caplog.at_level(logging.WARNING, logger="cosybatch"):
        assert write_card(out) is None
    assert (out / "README.md").read_text() == "# My dataset\n\nNotes of my own.\n"
    assert "not written by cosybatch" in caplog.text


def test_the_card_of_a_sharded_job_and_its_nemo_export(tmp_path):
    """merge writes the root's card (the whole job: every part's rows); a language column, when
    the manifest has one, splits the hours per voice and language. The NeMo export of the root
    numbers the parts' shards in order, each audio_N.tar a link to its shard."""
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"r{i}", "text": f"Row number {i}."} for i in range(8)])
    root = tmp_path / "out"
    for index in range(2):
        assert run(RunConfig.from_options(corpus=corpus, out=root, engine="tone", progress="none", shard_index=index,
                             shard_count=2, shard_max_items=2)).status == "complete"
        assert DatasetCard.load(root / f"part-{index:05d}-of-00002" / "README.md").data.tags[0] == "synthetic"
    result = CliRunner().invoke(app, ["merge", str(root)])
    assert result.exit_code == 0, result.output
    card = DatasetCard.load(root / "README.md")
    assert "8 clips" in card.text and "from 2 workers' folders" in card.text
    assert card.data.size_categories == ["n<1K"] and "language" not in card.data.to_dict()  # tone says none

    manifest = pq.read_table(root / "manifest.parquet")
    languages = ["en" if i % 2 else "de" for i in range(manifest.num_rows)]
    pq.write_table(manifest.append_column("language", pa.array(languages)), root / "manifest.parquet")
    text = card_text(root)
    assert "| voice | language | rows | hours |" in text and "- de\n- en\n" in text
    voices = set(manifest.column("voice").to_pylist())
    assert sum(int(line.split("|")[3]) for line in text.splitlines()
               if line.startswith("| ") and line.split("|")[1].strip() in voices) == 8

    result = CliRunner().invoke(app, ["export", str(root), "--to", "nemo"])
    assert result.exit_code == 0, result.output
    nemo = root / "exports/nemo"
    entries = [json.loads(line) for line in (nemo / "tarred_audio_manifest.json").read_text().splitlines()]
    shards = sorted(root.glob("part-*/shard-*.tar"))
    assert sorted({e["shard_id"] for e in entries}) == list(range(len(shards))) and len(entries) == 8
    for n, shard in enumerate(shards):
        link = nemo / f"audio_{n}.tar"
        assert not os.path.isabs(os.readlink(link)) and link.resolve() == shard.resolve()
        with tarfile.open(link) as tar:
            names = tar.getnames()
        assert {e["audio_filepath"] for e in entries if e["shard_id"] == n} == {x for x in names if x.endswith(".wav")}
    assert DatasetCard.load(root / "README.md").text.count("exports/nemo/") == 1

    # A partial merge says so on the card.
    (root / "part-00001-of-00002" / "stats.json").unlink()
    assert CliRunner().invoke(app, ["merge", str(root), "--partial"]).exit_code == 0
    assert "**This is a partial merge**: part-00001-of-00002 is not complete" in (root / "README.md").read_text()


def test_size_categories():
    assert [size_category(n) for n in (0, 999, 1000, 120_000, 5 * 10**9)] == [
        "n<1K", "n<1K", "1K<n<10K", "100K<n<1M", "n>1B"]
