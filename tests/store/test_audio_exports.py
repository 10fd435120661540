"""Every audio format through every loader the exports target (issue 34, items 1 and 5): one small
job per format (WAV, FLAC, Opus, resampled from Piper's 22050 Hz to 16 kHz, two shards), read
back with webdataset, Hugging Face `datasets`, lhotse (the command sources into the shards, the
loose `--copy` files, and Lhotse Shar through `CutSet.from_shar`) and as NeMo reads its manifests.
Each loader's samples are compared with what the shard's own member decodes to, and every id must
come back exactly once.

What is not installed here, and what the tests do instead (each test says so too):
- webdataset's own audio decoder (`wds.torch_audio`) needs torchaudio: the shards are decoded
  through `wds.handle_extension` with soundfile.
- `datasets.Audio` decodes with torchcodec (and FFmpeg): the column is cast to
  `Audio(decode=False)` and its bytes decoded with soundfile (tests/store/test_exports.py decodes
  a WAV export with torchcodec where it is installed).
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile
from helpers import cli, last_json, write_parquet

from cosybatch.config import RunConfig
from cosybatch.run.local import run

FORMATS = ("wav", "flac", "opus")
RATE = 16000  # --sample-rate: Piper speaks at 22050 Hz, so a loader that reports 22050 read the engine's rate
ROWS = [  # the first spoken as two sentences (two segments, two supervisions); ids that need hashed keys
    {"id": "two/0", "text": "Where did I put my keys? Good morning, everyone!", "language": "en"},
    {"id": "one.1", "text": "That sounds wonderful."},
    {"id": "r2", "text": "Please remember to water the tomato plants before you leave for work."},
]
IDS = sorted(r["id"] for r in ROWS)


@dataclass
class Item:
    key: str
    meta: dict
    data: bytes  # the audio member's bytes, as the shard holds them
    samples: np.ndarray  # what they decode to (soundfile, float32)
    shard: int  # the shard's number in the job (its place in sorted order)


@dataclass
class Job:
    fmt: str
    out: Path
    items: dict[str, Item]  # by id

    def by_key(self) -> dict[str, Item]:
        return {item.key: item for item in self.items.values()}


def read_items(out: Path, fmt: str) -> dict[str, Item]:
    """id -> Item from the job's shards; each item has exactly one audio member, in `fmt`."""
    items: dict[str, Item] = {}
    for n, shard in enumerate(sorted(out.glob("shard-*.tar"))):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar}
        for key in sorted({name.partition(".")[0] for name in members}):
            names = sorted(name for name in members if name.partition(".")[0] == key)
            assert names == sorted([f"{key}.{fmt}", f"{key}.json"])
            meta = json.loads(members[f"{key}.json"])
            data = members[f"{key}.{fmt}"]
            samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
            assert rate == meta["sample_rate"] == RATE and len(samples) == meta["num_samples"]
            assert meta["format"] == fmt and meta["id"] not in items
            items[meta["id"]] = Item(key, meta, data, samples, n)
    assert sorted(items) == IDS
    return items


@pytest.fixture(scope="module", params=FORMATS)
def job(request, tmp_path_factory) -> Job:
    """One job per format, every export written by the run (`run --export hf,nemo,lhotse,shar`)."""
    fmt = request.param
    folder = tmp_path_factory.mktemp(f"job-{fmt}")
    out = folder / "out"
    result = run(RunConfig.from_options(corpus=write_parquet(folder / "c.parquet", ROWS), out=out, audio_format=fmt,
                                        sample_rate=RATE, export=("hf", "nemo", "lhotse", "shar"), shard_max_items=2,
                                        progress="none"))
    assert result.status == "complete"
    assert len(list(out.glob("shard-*.tar"))) == 2
    return Job(fmt, out, read_items(out, fmt))


def decoded(data: bytes) -> tuple[np.ndarray, int]:
    return soundfile.read(io.BytesIO(data), dtype="float32")


def assert_same_samples(loaded: np.ndarray, item: Item, fmt: str) -> None:
    """lhotse's samples are exactly the member's."""
    assert loaded.shape == (1, item.meta["num_samples"])
    np.testing.assert_array_equal(loaded[0], item.samples)


def test_webdataset_reads_every_format(job):
    """The shards as webdataset reads them, the audio decoded by extension. webdataset's own audio
    decoder (wds.torch_audio) needs torchaudio, which is not installed, so the decoder here is
    soundfile through wds.handle_extension."""
    import webdataset as wds

    urls = [str(p) for p in sorted(job.out.glob("shard-*.tar"))]
    dataset = wds.WebDataset(urls, shardshuffle=False).decode(wds.handle_extension("wav flac opus", decoded))
    seen = Counter()
    for sample in dataset:
        meta = sample["json"]
        seen[meta["id"]] += 1
        assert set(sample) - {"__key__", "__url__", "__local_path__", "json"} == {job.fmt}
        samples, rate = sample[job.fmt]
        assert rate == RATE and len(samples) == meta["num_samples"]
        np.testing.assert_array_equal(samples, job.items[meta["id"]].samples)
    assert seen == Counter(IDS)


def test_hugging_face_reads_every_format(job):
    """The HF export's Parquet: an Audio feature at the items' rate (16 kHz, not Piper's 22050),
    each row the shard member's own bytes. `datasets.Audio` decodes with torchcodec, which is not
    installed, so the column is cast to Audio(decode=False) and the bytes decoded with soundfile."""
    import datasets

    files = sorted(map(str, (job.out / "exports/hf/data").glob("*.parquet")))
    hf = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(job.out.parent / "hf-cache"))
    assert isinstance(hf.features["audio"], datasets.Audio)
    assert hf.features["audio"].sampling_rate == RATE
    raw = hf.cast_column("audio", datasets.Audio(decode=False))
    assert sorted(raw["id"]) == IDS
    for row in raw:
        item = job.items[row["id"]]
        assert row["audio"]["path"] == f"{item.key}.{job.fmt}" and row["audio"]["bytes"] == item.data
        samples, rate = decoded(row["audio"]["bytes"])
        assert rate == row["sampling_rate"] == RATE and len(samples) == item.meta["num_samples"]
        assert row["duration"] == pytest.approx(len(samples) / rate) and row["text"] == item.meta["text"]


def test_nemo_manifests_read_back_in_every_format(job):
    """NeMo's tarred manifest: each audio_filepath (KEY.flac, ...) is a member of the tar its shard_id
    names (audio_N.tar, the job's shard N) and decodes to the entry's duration; the webdataset pipeline
    NeMo's TarredAudioToCharDataset builds finds every entry's audio by the file name's stem."""
    import webdataset as wds

    nemo = job.out / "exports/nemo"
    entries = [json.loads(line) for line in (nemo / "tarred_audio_manifest.json").read_text().splitlines()]
    assert sorted(e["id"] for e in entries) == IDS
    tars = {}
    for e in entries:
        item = job.items[e["id"]]
        assert e["audio_filepath"] == f"{item.key}.{job.fmt}" and e["shard_id"] == item.shard
        if e["shard_id"] not in tars:
            with tarfile.open(nemo / f"audio_{e['shard_id']}.tar") as tar:
                tars[e["shard_id"]] = {m.name: tar.extractfile(m).read() for m in tar}
        samples, rate = decoded(tars[e["shard_id"]][e["audio_filepath"]])
        assert rate == RATE and len(samples) / rate == pytest.approx(e["duration"], abs=1e-9)
        assert e["text"] == item.meta["text"]
    urls = [str(nemo / f"audio_{n}.tar") for n in sorted(tars)]
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(),
                                wds.rename(audio="wav;flac;opus", key="__key__"), wds.to_tuple("audio", "key"))
    stems = {e["audio_filepath"].rpartition(".")[0]: e for e in entries}
    got = {key: audio for audio, key in pipeline}
    assert sorted(got) == sorted(stems)
    for stem, audio in got.items():
        assert len(decoded(audio)[0]) / RATE == pytest.approx(stems[stem]["duration"], abs=1e-9)


def test_lhotse_command_sources_decode_every_format(job):
    """Each Lhotse recording cuts its member's byte range out of the shard (a command source) and
    lhotse's load_audio decodes it, whatever the format, to the member's own samples."""
    import lhotse

    cuts = lhotse.CutSet.from_manifests(
        recordings=lhotse.load_manifest(job.out / "exports/lhotse/recordings.jsonl.gz"),
        supervisions=lhotse.load_manifest(job.out / "exports/lhotse/supervisions.jsonl.gz"))
    seen = Counter()
    for cut in cuts:
        item = job.by_key()[cut.recording_id]
        seen[item.meta["id"]] += 1
        assert cut.recording.sources[0].type == "command" and cut.sampling_rate == RATE
        assert [s.custom["id"] for s in cut.supervisions] == [item.meta["id"]] * len(cut.supervisions)
        assert_same_samples(cut.load_audio(), item, job.fmt)
    assert seen == Counter(IDS)


def test_lhotse_shar_loads_every_format(job):
    """`CutSet.from_shar` loads the Shar export: one Shar shard per job shard, every id once, the
    cut's audio the item's samples (a WAV job's stored as FLAC with the very same samples; any other
    format stored as the member's own bytes), and the Lhotse export's supervisions."""
    import lhotse

    shar = job.out / "exports/shar"
    assert sorted(p.name for p in shar.iterdir()) == ["cuts.000000.jsonl.gz", "cuts.000001.jsonl.gz",
                                                      "recording.000000.tar", "recording.000001.tar"]
    supervisions = {}
    for s in lhotse.load_manifest(job.out / "exports/lhotse/supervisions.jsonl.gz"):
        supervisions.setdefault(s.recording_id, []).append(s.to_dict())
    stored = {}
    for n in (0, 1):
        with tarfile.open(shar / f"recording.{n:06d}.tar") as tar:
            stored.update({m.name: (n, tar.extractfile(m).read()) for m in tar})
    ext = "flac" if job.fmt == "wav" else job.fmt
    cuts = list(lhotse.CutSet.from_shar(in_dir=shar))
    assert sorted(c.supervisions[0].custom["id"] for c in cuts) == IDS
    for cut in cuts:
        item = job.by_key()[cut.id]
        shard, data = stored[f"{item.key}.{ext}"]
        assert shard == item.shard and cut.shard_origin.name == f"cuts.{item.shard:06d}.jsonl.gz"
        if job.fmt == "wav":  # lossless and smaller: the same 16-bit samples
            assert data[:4] == b"fLaC" and len(data) < len(item.data)
            np.testing.assert_array_equal(soundfile.read(io.BytesIO(data), dtype="int16")[0],
                                          soundfile.read(io.BytesIO(item.data), dtype="int16")[0])
        else:  # the shard member itself, not encoded again
            assert data == item.data
        assert cut.sampling_rate == RATE and cut.num_samples == item.meta["num_samples"]
        assert_same_samples(cut.load_audio(), item, job.fmt)
        assert [s.to_dict() for s in cut.supervisions] == supervisions[cut.id]
    two = next(c for c in cuts if c.supervisions[0].custom["id"] == "two/0")
    assert [s.text for s in two.supervisions] == ["Where did I put my keys?", "Good morning, everyone!"]
    assert {s.language for s in two.supervisions} == {"en"}


def test_the_card_names_the_shards_format_and_the_shar_export(job):
    card = (job.out / "README.md").read_text()
    assert f"`KEY.{job.fmt}` (" in card and f"{RATE} Hz" in card
    assert "`exports/shar/`: the Lhotse Shar export." in card


@pytest.mark.slow
def test_the_copying_forms_and_export_to_shar_from_the_command_line(job, tmp_path):
    """`cosybatch export --to nemo,lhotse,shar --copy` on a copy of the job: the loose files are the
    members' own bytes named by format (in exports/wavs: the folder keeps its name), the NeMo
    manifest's paths decode to its durations, Lhotse's file sources to the members' samples, and
    the Shar export from the command line is the run's, byte for byte."""
    out = tmp_path / "out"
    shutil.copytree(job.out, out, symlinks=True)
    shutil.rmtree(out / "exports" / "shar")
    written = last_json(cli("export", out, "--to", "nemo,lhotse,shar", "--copy", check=True))
    assert written["shar"] == str(out / "exports" / "shar")
    loose = out / "exports" / "wavs"
    assert sorted(p.name for p in loose.iterdir()) == sorted(f"{i.key}.{job.fmt}" for i in job.items.values())
    for item in job.items.values():
        assert (loose / f"{item.key}.{job.fmt}").read_bytes() == item.data
    manifest = out / "exports/nemo/manifest.jsonl"
    entries = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert sorted(e["id"] for e in entries) == IDS
    for e in entries:
        samples, rate = soundfile.read(manifest.parent / e["audio_filepath"], dtype="float32")
        assert rate == RATE and len(samples) / rate == pytest.approx(e["duration"], abs=1e-9)

    import lhotse

    cuts = lhotse.CutSet.from_manifests(
        recordings=lhotse.load_manifest(out / "exports/lhotse/recordings.jsonl.gz"),
        supervisions=lhotse.load_manifest(out / "exports/lhotse/supervisions.jsonl.gz"))
    assert sorted(c.supervisions[0].custom["id"] for c in cuts) == IDS
    for cut in cuts:
        assert cut.recording.sources[0].type == "file"
        assert_same_samples(cut.load_audio(), job.by_key()[cut.recording_id], job.fmt)
    for name in ("cuts.000000.jsonl.gz", "recording.000000.tar", "cuts.000001.jsonl.gz", "recording.000001.tar"):
        assert (out / "exports/shar" / name).read_bytes() == (job.out / "exports/shar" / name).read_bytes()
    with gzip.open(out / "exports/lhotse/recordings.jsonl.gz", "rt") as f:
        assert all(Path(json.loads(line)["sources"][0]["source"]).parent == loose.resolve() for line in f)
