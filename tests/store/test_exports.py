"""Dataset formats: the Hugging Face, NeMo and Lhotse exports load in their own libraries (NeMo, not
installed, as its tarred reader reads the shards), in the forms that point into the shards and the
copying ones, and the HF export decodes where torchcodec is installed. An export checks the folder
first and never leaves half an export (issue 23, case 4)."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import soundfile
from helpers import cli, corpus_rows, finished_tone_job, read_output, write_parquet

from cosybatch.config import RunConfig
from cosybatch.errors import DamagedOutputError
from cosybatch.run.local import run
from cosybatch.store.exports import export


@pytest.mark.slow
def test_dataset_formats_load_in_their_libraries(tmp_path):
    rows = corpus_rows(5)
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    run(RunConfig.from_options(corpus=corpus, out=out, export=("hf", "nemo", "lhotse"), shard_max_items=2,
                               progress="none"))
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

    # NeMo's tarred audio over the shards themselves: each audio_filepath is a member of the shard
    # its shard_id names (audio_N.tar, a link to it), and the duration is that member's.
    nemo = out / "exports/nemo"
    entries = [json.loads(line) for line in (nemo / "tarred_audio_manifest.json").read_text().splitlines()]
    assert sorted(e["id"] for e in entries) == sorted(truth)
    assert not (out / "exports/wavs").exists()  # no audio was copied
    members = nemo_members(nemo)
    for e in entries:
        assert set(e) >= {"audio_filepath", "duration", "text", "shard_id"}
        info = soundfile.info(io.BytesIO(members[e["shard_id"]][e["audio_filepath"]]))
        assert info.duration == pytest.approx(e["duration"], abs=1e-3)
        assert e["text"] == truth[e["id"]]["meta"]["text"]
        assert e["qc_s_per_unit"] == truth[e["id"]]["meta"]["qc"]["signals"]["s_per_unit"]
    for n in members:  # the per-shard manifests NeMo's Lhotse reader takes hold the same entries
        shard_entries = [json.loads(line) for line in (nemo / f"sharded_manifests/manifest_{n}.json").read_text()
                         .splitlines()]
        assert shard_entries == [e for e in entries if e["shard_id"] == n]
    # NeMo's Lhotse reader (LazyNeMoTarredIterator) takes the shard id from each name with these
    # patterns, and with skip_missing_manifest_entries passes over the members no entry names.
    for n in members:
        assert re.search(r"audio[^/]*_(\d+)[^/]*\.tar", f"{nemo}/audio_{n}.tar").group(1) == str(n)
        assert re.search(r"manifest[^/]*_(\d+)[^/]*\.json", f"{nemo}/sharded_manifests/manifest_{n}.json").group(1) \
            == str(n)
        named = {e["audio_filepath"] for e in entries if e["shard_id"] == n}
        assert all(name.endswith(".json") for name in set(members[n]) - named)
    # As NeMo's (webdataset) TarredAudioToCharDataset reads them: samples by __key__, audio by extension,
    # matched to the manifest by the file name's stem; the KEY.json members ride along unread.
    import webdataset as wds

    urls = [str(nemo / f"audio_{n}.tar") for n in sorted(members)]
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(),
                                wds.rename(audio="wav;flac;mp3", key="__key__"), wds.to_tuple("audio", "key"))
    by_stem = {os.path.splitext(os.path.basename(e["audio_filepath"]))[0]: e for e in entries}
    seen = [(key, len(audio)) for audio, key in pipeline]
    assert sorted(k for k, _ in seen) == sorted(by_stem)

    # Lhotse: every recording reads its WAV member's bytes out of the shard (a command source).
    import lhotse

    cuts = lhotse.CutSet.from_manifests(
        recordings=lhotse.load_manifest(out / "exports/lhotse/recordings.jsonl.gz"),
        supervisions=lhotse.load_manifest(out / "exports/lhotse/supervisions.jsonl.gz"))
    assert len(cuts) == 5
    for cut in cuts:
        item_id = cut.supervisions[0].custom["id"]
        assert cut.recording.sources[0].type == "command"
        assert cut.duration == pytest.approx(truth[item_id]["meta"]["duration"])
        assert cut.supervisions[0].text == truth[item_id]["meta"]["text"]
        samples = cut.load_audio()
        assert samples.shape == (1, len(truth[item_id]["audio"]))
        assert samples[0] == pytest.approx(truth[item_id]["audio"], abs=1e-4)
        assert cut.supervisions[0].custom["qc"]["qc_score"] == truth[item_id]["meta"]["qc"]["score"]

    # `cosybatch export --copy` writes the loose-file forms, also for a sharded job's root.
    proc = cli("export", str(out), "--to", "nemo,lhotse", "--copy")
    assert proc.returncode == 0 and json.loads(proc.stdout)["nemo"].endswith("manifest.jsonl")
    manifest = out / "exports/nemo/manifest.jsonl"
    entries = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert sorted(e["id"] for e in entries) == sorted(truth)
    for e in entries:
        info = soundfile.info(str(manifest.parent / e["audio_filepath"]))
        assert info.duration == pytest.approx(e["duration"], abs=1e-3)
        assert e["text"] == truth[e["id"]]["meta"]["text"]
    cuts = lhotse.CutSet.from_manifests(
        recordings=lhotse.load_manifest(out / "exports/lhotse/recordings.jsonl.gz"),
        supervisions=lhotse.load_manifest(out / "exports/lhotse/supervisions.jsonl.gz"))
    for cut in cuts:
        assert cut.load_audio().shape == (1, len(truth[cut.supervisions[0].custom["id"]]["audio"]))
    with gzip.open(out / "exports/lhotse/recordings.jsonl.gz", "rt") as f:
        sources = [json.loads(line)["sources"][0] for line in f]
    assert all(s["type"] == "file" and Path(s["source"]).is_absolute() for s in sources)


def test_a_run_exports_the_copying_forms_when_asked(tmp_path):
    """`run --export nemo,lhotse --export-copy` (export_copy = true in a job spec): loose WAV files."""
    corpus = write_parquet(tmp_path / "c.parquet", [{"id": f"r{i}", "text": f"Row {i}."} for i in range(3)])
    out = tmp_path / "out"
    result = run(RunConfig.from_options(corpus=corpus, out=out, engine="tone", export=("nemo", "lhotse"),
                                        export_copy=True,
                           progress="none"))
    assert result.status == "complete"
    assert sorted(p.name for p in (out / "exports/wavs").iterdir()) == ["r0.wav", "r1.wav", "r2.wav"]
    assert (out / "exports/nemo/manifest.jsonl").exists() and not (out / "exports/nemo/audio_0.tar").exists()
    with gzip.open(out / "exports/lhotse/recordings.jsonl.gz", "rt") as f:
        assert {json.loads(line)["sources"][0]["type"] for line in f} == {"file"}


def nemo_members(nemo: Path) -> dict[int, dict[str, bytes]]:
    """shard_id -> {member name: bytes} of each audio_N.tar of a NeMo tarred export."""
    found = {}
    for link in nemo.glob("audio_*.tar"):
        with tarfile.open(link) as tar:
            found[int(link.stem.split("_")[1])] = {m.name: tar.extractfile(m).read() for m in tar}
    return found


# -- reading the HF export (docs/production.md's snippet runs in tests/docs) ---------------------------


def hf_export_in(tmp_path: Path) -> dict:
    """out/corpus/exports/hf under tmp_path, as the README's paths expect; the env to run in."""
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(3))
    result = run(RunConfig.from_options(corpus=corpus, out=tmp_path / "out" / "corpus", export=("hf",),
                                        progress="none"))
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


# -- segment times (KEY.json "segments", a Lhotse supervision per segment) ----------------------------


def test_segment_times_tile_the_clip_and_each_holds_its_piece(tmp_path):
    """A 3-sentence row: its segments tile the clip (gaps of --sentence-silence between), the audio
    of segment i is piece i's audio (synthesised alone, scaled by the clip's normalisation) and the
    text its sentence's; a one-sentence row has one segment; Lhotse loads a supervision per segment."""
    import numpy as np

    from cosybatch.engines import EngineOptions, VoiceRequest
    from cosybatch.engines.piper.engine import PiperEngine, PiperOptions
    from cosybatch.plan import Unit

    three = "The kettle clicked off. Where did I put my keys? Good morning, everyone!"
    rows = [{"id": "three", "text": three}, {"id": "one", "text": "That sounds wonderful."}]
    out = tmp_path / "out"
    result = run(RunConfig.from_options(corpus=write_parquet(tmp_path / "c.parquet", rows), out=out, export=("lhotse",),
                           sentence_silence=0.3, progress="none"))
    assert result.exit_code == 0
    items = read_output(out)
    meta, audio = items["three"]["meta"], items["three"]["audio"]
    sr, segments = meta["sample_rate"], meta["segments"]
    assert [s["text"] for s in segments] == ["The kettle clicked off.", "Where did I put my keys?",
                                             "Good morning, everyone!"]
    gap = round(0.3 * sr) / sr
    assert segments[0]["start"] == 0.0 and segments[-1]["end"] == pytest.approx(meta["duration"], abs=1e-12)
    for a, b in itertools.pairwise(segments):
        assert a["end"] == pytest.approx(b["start"] - gap, abs=1e-12)

    engine = PiperEngine(None, EngineOptions(engine=PiperOptions()))
    pieces = engine.prepare(three, "three", VoiceRequest()).pieces
    alone = [engine.synthesize([Unit(0, i, p.cost, "", p.payload)]).audio[0] for i, p in enumerate(pieces)]
    peak = max(float(np.abs(a).max()) for a in alone)
    for seg, piece in zip(segments, alone, strict=True):
        start, end = round(seg["start"] * sr), round(seg["end"] * sr)
        assert end - start == len(piece)  # sample for sample
        np.testing.assert_allclose(audio[start:end], piece / peak, atol=2e-4)  # 16-bit PCM
        assert not audio[end:end + round(gap * sr)].any()  # silence between (none after the last)
    one = items["one"]["meta"]
    assert one["segments"] == [{"text": "That sounds wonderful.", "start": 0.0, "end": one["duration"]}]

    import lhotse

    cuts = {c.recording_id: c for c in lhotse.CutSet.from_manifests(
        recordings=lhotse.load_manifest(out / "exports/lhotse/recordings.jsonl.gz"),
        supervisions=lhotse.load_manifest(out / "exports/lhotse/supervisions.jsonl.gz"))}
    sups = sorted(cuts[items["three"]["key"]].supervisions, key=lambda s: s.start)
    assert [s.text for s in sups] == [s["text"] for s in segments]
    for sup, seg in zip(sups, segments, strict=True):
        assert sup.start == pytest.approx(seg["start"]) and sup.end == pytest.approx(seg["end"])
        assert sup.custom["id"] == "three"
    whole = cuts[items["one"]["key"]].supervisions
    assert len(whole) == 1 and whole[0].duration == pytest.approx(one["duration"]) and whole[0].text == one["text"]
    trimmed = cuts[items["three"]["key"]].trim_to_supervisions(keep_overlapping=False)
    assert [len(c.load_audio()[0]) for c in trimmed] == [len(a) for a in alone]


def test_exports_carry_the_rows_language_and_pool_speaker(tmp_path):
    """The language column reaches every export (HF `language`, NeMo `lang`, Lhotse supervisions'
    `language`), each loaded by its own library; rows without one have none."""
    rows = corpus_rows(3)
    rows[0]["language"], rows[1]["language"] = "en", "en-GB"
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    run(RunConfig.from_options(corpus=corpus, out=out, export=("hf", "nemo", "lhotse"), progress="none", qc="off"))
    want = {"utt/0": "en", "utt/1": "en-GB", "utt/2": None}

    import datasets

    hf = datasets.load_dataset("parquet", data_files=sorted(map(str, (out / "exports/hf/data").glob("*.parquet"))),
                               split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert hf.features["language"] == datasets.Value("string")
    assert dict(zip(hf["id"], hf["language"], strict=True)) == want

    entries = [json.loads(line) for line in (out / "exports/nemo/tarred_audio_manifest.json").read_text().splitlines()]
    assert {e["id"]: e.get("lang") for e in entries} == want

    import lhotse

    supervisions = lhotse.load_manifest(out / "exports/lhotse/supervisions.jsonl.gz")
    assert {s.custom["id"]: s.language for s in supervisions} == want


# -- export checks the folder first and never leaves half an export (issue 23, case 4) -------------
@pytest.mark.parametrize("fmt", ["hf", "nemo", "lhotse", "shar"])
def test_export_refuses_a_folder_that_lost_a_shard(tone, tmp_path, fmt):
    _, out = finished_tone_job(tone, tmp_path)
    (out / "shard-000001.tar").unlink()
    with pytest.raises(DamagedOutputError, match=r"shard-000001.tar is missing.*Rerun the job's `cosybatch run`"):
        export(out, fmt)
    assert not (out / "exports" / fmt).exists()
    assert DamagedOutputError.exit_code == 3


@pytest.mark.parametrize("fmt", ["hf", "nemo", "lhotse", "shar"])
def test_an_unreadable_shard_leaves_the_earlier_export_whole(tone, tmp_path, fmt):
    _, out = finished_tone_job(tone, tmp_path)
    export(out, fmt)
    before = export_files(out / "exports" / fmt)
    shard = out / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[:512] = b"\xff" * 512  # the same size, so only reading it finds the damage
    shard.write_bytes(bytes(data))
    with pytest.raises(DamagedOutputError, match=r"shard-000001.tar is unreadable"):
        export(out, fmt)
    after = export_files(out / "exports" / fmt)
    assert after == before
    assert [p.name for p in (out / "exports").iterdir() if p.name.startswith(".")] == []


def export_files(folder: Path) -> dict:
    """Each file of an export, and where each of its links points (NeMo's audio_N.tar link to the shards)."""
    return {p.relative_to(folder): os.readlink(p) if p.is_symlink() else p.read_bytes()
            for p in folder.rglob("*") if p.is_symlink() or p.is_file()}


def test_an_unreadable_shard_leaves_no_export(tone, tmp_path):
    _, out = finished_tone_job(tone, tmp_path)
    shard = out / "shard-000001.tar"
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    with pytest.raises(DamagedOutputError):
        export(out, "hf")
    assert not (out / "exports" / "hf").exists()
