"""Voice pools, seeded prosody ranges and languages (docs/input.md "Voice pools", "Languages"):
which voice a row gets (stable under resume and --shard), per-row scales in one batch, the
language routing and its refusal, and what KEY.json and the manifest record."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import read_output, write_jsonl

from cosybatch.config import RunConfig
from cosybatch.corpus import Row
from cosybatch.engines import EngineOptions, RowRejected, ScaleRange, open_engine, parse_engine_options
from cosybatch.engines.piper.voice import bundled_voice
from cosybatch.errors import UsageError
from cosybatch.plan import Unit
from cosybatch.run.executor import EngineSet
from cosybatch.run.local import run
from cosybatch.voices import PoolEntry, parse_pool, parse_voice_map

SHORT = ["Yes.", "Good morning.", "Why not?", "The kettle is boiling.", "Close the door.", "It is late.",
         "See you soon.", "Thank you."]


def voice_copies(folder: Path, names=("a", "b")) -> Path:
    """Copies of the bundled voice under other names (symlinks): a pool of distinct voice names."""
    folder.mkdir(exist_ok=True)
    model, config = bundled_voice()
    for name in names:
        (folder / f"{name}.onnx").symlink_to(model)
        (folder / f"{name}.onnx.json").symlink_to(config)
    return folder


def short_corpus(path: Path, n: int = 8, **columns) -> Path:
    rows = [{"id": f"r{i}", "text": SHORT[i % len(SHORT)], **{k: v[i] for k, v in columns.items()}} for i in range(n)]
    return write_jsonl(path, rows)


def voices_of(out: Path) -> dict:
    return {item["meta"]["id"]: item["meta"]["voice"] for item in read_output(out).values()}


# -- parsing ---------------------------------------------------------------------------------------
def test_pool_specs_parse_weights_speakers_and_folders(tmp_path):
    voices = voice_copies(tmp_path / "voices")
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "p1.wav").write_bytes(b"RIFF")
    (prompts / "p1.txt").write_text("Hello  there.\n")
    (prompts / "p2.wav").write_bytes(b"RIFF")
    pool = parse_pool(f"x:2,#0-2,y#bob:0.5,{voices},{prompts}")
    assert pool[0] == PoolEntry("x", weight=2.0)
    assert [(e.voice, e.speaker) for e in pool[1:4]] == [(None, "0"), (None, "1"), (None, "2")]
    assert pool[4] == PoolEntry("y", "bob", weight=0.5)
    assert [Path(e.voice).name for e in pool[5:7]] == ["a.onnx", "b.onnx"]  # sorted
    assert pool[7].prompt_text == "Hello there." and pool[8].prompt_text is None  # a wav without its .txt
    # A job spec's list, with tables.
    assert parse_pool(["x", {"voice": "y", "speaker": 3, "weight": 2}]) == (PoolEntry("x"),
                                                                           PoolEntry("y", "3", weight=2))
    assert parse_pool({"x": 2, "#1": 1}) == (PoolEntry("x", weight=2.0), PoolEntry(None, "1"))  # a spec's table
    assert parse_voice_map("en=a|b, de-DE=c") == {"en": (PoolEntry("a"), PoolEntry("b")), "de-de": (PoolEntry("c"),)}
    assert parse_voice_map({"en": ["a", "b"]}) == {"en": (PoolEntry("a"), PoolEntry("b"))}
    for bad, says in (("a:0", "weight"), ("#", "no speaker"), (str(tmp_path), "holds no voices"),
                      ([{"voice": "a", "pitch": 2}], "unknown key")):
        with pytest.raises(UsageError, match=says):
            parse_pool(bad)
    with pytest.raises(UsageError, match="not a language code"):
        parse_voice_map("english language=a")
    with pytest.raises(UsageError, match="takes no prompt audio"):
        RunConfig.from_options(corpus=tmp_path / "c.txt", out=tmp_path / "o", voice_pool=str(prompts))
    with pytest.raises(UsageError, match="hash or balanced"):
        RunConfig.from_options(corpus=tmp_path / "c.txt", out=tmp_path / "o", voice_pool="a", voice_pool_mode="round")
    # A pool voice that does not exist stops the run before it starts, as a bad --voice does.
    from cosybatch.errors import CosybatchError
    from cosybatch.run.preflight import check

    corpus = short_corpus(tmp_path / "c.jsonl", 1)
    with pytest.raises(CosybatchError, match="nope") as refused:
        check(RunConfig.from_options(corpus=corpus, out=tmp_path / "o", voice_pool=f"default,{tmp_path}/nope.onnx"))
    assert refused.value.exit_code == 2


def test_a_job_spec_takes_a_pool_list_and_a_voice_map_table(tmp_path):
    from typer.testing import CliRunner

    from cosybatch.cli import app

    voices = voice_copies(tmp_path / "voices")
    corpus = short_corpus(tmp_path / "c.jsonl", 2)
    spec = tmp_path / "job.toml"
    spec.write_text(f'voice_pool = ["{voices}/a.onnx", {{ voice = "{voices}/b.onnx", weight = 3 }}]\n'
                    f'voice_pool_mode = "balanced"\n[voice_map]\nde = "{voices}/b.onnx"\n')
    result = CliRunner().invoke(app, ["run", str(corpus), "--job", str(spec), "--out", str(tmp_path / "o"), "--check"])
    assert result.exit_code == 0, result.output


# -- assignment ------------------------------------------------------------------------------------
def test_pool_voices_are_the_same_per_id_across_resume_and_shards(tmp_path):
    """Hash mode: a row's voice depends on its id (and the seed) only: resume, --shard and a
    ray-run actor give every id the same voice."""
    voices = voice_copies(tmp_path / "voices")
    corpus = short_corpus(tmp_path / "c.jsonl", 6)
    pool = f"{voices}/a.onnx,{voices}/b.onnx:2"
    whole = tmp_path / "whole"
    assert run(RunConfig.from_options(corpus=corpus, out=whole, voice_pool=pool, limit=3,
                                      progress="none")).exit_code == 0
    # resumes
    assert run(RunConfig.from_options(corpus=corpus, out=whole, voice_pool=pool, progress="none")).exit_code == 0
    once = voices_of(whole)
    assert sorted(once) == [f"r{i}" for i in range(6)] and set(once.values()) == {"a", "b"}
    sharded = {}
    for i in range(2):
        run(RunConfig.from_options(corpus=corpus, out=tmp_path / "sharded", voice_pool=pool, shard_index=i,
                                   shard_count=2,
                      progress="none"))
        sharded.update(voices_of(tmp_path / "sharded" / f"part-{i:05d}-of-00002"))
    assert sharded == once
    # A ray-run actor's engines (called in process here, without Ray) give each id the same voice.
    from cosybatch.corpus import Corpus
    from cosybatch.run.ray import SynthWorker

    (tmp_path / "ray" / ".cosybatch").mkdir(parents=True)
    actor = SynthWorker(RunConfig.from_options(corpus=corpus, out=tmp_path / "ray", voice_pool=pool), "cpu")
    made = actor.process(list(Corpus(corpus))[::-1])["items"]  # in another order
    assert {item["id"]: item["voice"] for item in made} == once
    manifest = pq.read_table(whole / "manifest.parquet").to_pylist()
    assert {r["id"]: r["voice"] for r in manifest} == once
    fingerprint = json.loads((whole / ".cosybatch" / "job.json").read_text())["fingerprint"]
    assert fingerprint["voices"]["mode"] == "hash" and fingerprint["voices"]["pool"][1]["weight"] == 2.0
    # Another pool is another job: the folder refuses it.
    with pytest.raises(Exception, match="voices"):
        run(RunConfig.from_options(corpus=corpus, out=whole, voice_pool=f"{voices}/a.onnx", progress="none"))


def test_balanced_mode_evens_predicted_audio_and_replays_on_resume(tmp_path):
    """Without audio: the assignment of EngineSet.prepare. Each row goes to the voice with the least
    predicted audio (phoneme ids) so far; a resumed run that observes the done rows first assigns
    the rest as the uninterrupted run did."""
    voices = voice_copies(tmp_path / "voices", ("a", "b", "c"))
    cfg = RunConfig.from_options(corpus=tmp_path / "c.txt", out=tmp_path / "o", voice_pool=str(voices),
                                 voice_pool_mode="balanced")
    rows = [Row(i, f"r{i}", SHORT[i % len(SHORT)] * (1 + i % 3)) for i in range(30)]
    engines = EngineSet(cfg, device="cpu")
    whole = [engines.prepare(row)[2] for row in rows]
    totals = engines.router.pool.totals
    assert max(totals) - min(totals) <= max(sum(p.cost for p in engines.prepare(r)[1].pieces) for r in rows)
    resumed = EngineSet(cfg, device="cpu")
    for row in rows[:12]:
        resumed.observe(row)  # committed before the interruption
    assert [resumed.prepare(row)[2] for row in rows[12:]] == whole[12:]
    # A retake keeps the voice its first take had, and counts nothing again.
    before = list(resumed.router.pool.totals)
    assert resumed.prepare(rows[0], attempt=1, entry=whole[0])[2] == whole[0]
    assert resumed.router.pool.totals == before


def test_a_resumed_balanced_run_gives_the_voices_an_uninterrupted_one_does(tmp_path):
    voices = voice_copies(tmp_path / "voices", ("a", "b", "c"))
    corpus = short_corpus(tmp_path / "c.jsonl", 6)
    common = {"corpus": corpus, "voice_pool": str(voices), "voice_pool_mode": "balanced", "progress": "none"}
    run(RunConfig.from_options(out=tmp_path / "fresh", **common))
    run(RunConfig.from_options(out=tmp_path / "resumed", limit=2, **common))
    run(RunConfig.from_options(out=tmp_path / "resumed", **common))
    fresh = voices_of(tmp_path / "fresh")
    assert voices_of(tmp_path / "resumed") == fresh and set(fresh.values()) == {"a", "b", "c"}


def test_ray_run_refuses_a_balanced_pool(tmp_path):
    from cosybatch.run.ray import RayOptions, RayRunner

    cfg = RunConfig.from_options(corpus=tmp_path / "c.txt", out=tmp_path / "o", voice_pool="a,b",
                                 voice_pool_mode="balanced")
    with pytest.raises(UsageError, match="hash"):
        RayRunner(RayOptions()).check(cfg)


# -- prosody ranges --------------------------------------------------------------------------------
def piper(**options):
    from cosybatch.engines import engine_class

    return open_engine("piper", None, EngineOptions(device="cpu", engine=parse_engine_options(engine_class("piper"),
                                                                                             options)))


def test_per_row_length_scales_in_one_batch_are_audible_in_durations():
    engine = piper(length_scale="0.8:1.3", noise_w="0")  # no duration noise: durations follow the scale alone
    text = "The library opens at nine in the morning."
    slow, fast = None, None
    for i in range(64):  # rows whose draws are near the ends of the range
        prepared = engine.prepare(text, f"id{i}")
        scale = prepared.meta["length_scale"]
        assert 0.8 <= scale <= 1.3 and set(prepared.meta) == {"length_scale"}
        if scale < 0.9 and fast is None:
            fast = prepared
        if scale > 1.2 and slow is None:
            slow = prepared
    assert slow is not None and fast is not None
    units = [Unit(k, 0, p.pieces[0].cost, "", p.pieces[0].payload) for k, p in enumerate((fast, slow))]
    batch = engine.synthesize(units).audio  # one batch, two rates
    assert len(batch[1]) > 1.15 * len(batch[0])  # the slower row is longer
    for got, row in zip(batch, (fast, slow), strict=True):  # as long as a job at that one value makes it
        fixed = piper(length_scale=str(row.meta["length_scale"]), noise_w="0")
        piece = fixed.prepare(text, "other").pieces[0]
        assert len(fixed.synthesize([Unit(0, 0, piece.cost, "", piece.payload)]).audio[0]) == len(got)
    alone = engine.synthesize(units[1:]).audio[0]
    assert len(alone) == len(batch[1]) and np.abs(alone - batch[1]).max() < 2e-3  # its own scale, in any batch
    # Drawn from the row's seed: the same id gives the same value; the quality gate's next take another.
    again = engine.prepare(text, "id7")
    assert again.meta == engine.prepare(text, "id7").meta != engine.prepare(text, "id7", attempt=1).meta
    assert engine.describe()["length_scale"] == [0.8, 1.3]
    noisy = piper(noise_scale="0.3:0.6", noise_w="0:0.8").prepare(text, "id1").meta
    assert 0.3 <= noisy["noise_scale"] <= 0.6 and 0 <= noisy["noise_w"] <= 0.8

def test_fixed_scales_keep_their_fingerprint_and_ranges_are_checked():
    assert piper(length_scale="1.1").describe()["length_scale"] == 1.1
    assert piper().describe()["noise_w"] == 0.8  # the voice's default, as before
    assert piper(length_scale="1.1").prepare("Yes.", "x").meta is None  # nothing drawn
    for bad in ("0:1", "1.3:0.9", "fast"):
        with pytest.raises(UsageError, match="length-scale"):
            piper(length_scale=bad)
    assert ScaleRange.parse("0.9:1.2", "--x").draw(0, "id", 0, "x") == ScaleRange.parse("0.9:1.2", "--x").draw(
        0, "id", 0, "x")


def test_length_scale_range_from_the_cli_flag_is_recorded_per_row(tmp_path):
    corpus = short_corpus(tmp_path / "c.jsonl", 4)
    out = tmp_path / "out"
    run(RunConfig.from_options(corpus=corpus, out=out, engine_options={"length_scale": "0.8:1.3"}, progress="none"))
    metas = [item["meta"] for item in read_output(out).values()]
    assert all(0.8 <= m["prosody"]["length_scale"] <= 1.3 for m in metas)
    assert all(m["settings"]["length_scale"] == [0.8, 1.3] for m in metas)


# -- multi-speaker voices --------------------------------------------------------------------------
def multi_speaker_voice(folder: Path) -> Path:
    """The bundled voice with a `sid` input [B] that scales each item's waveform by (1 + sid): a
    synthetic two-speaker voice whose speakers differ in a way a test can measure per item."""
    import onnx
    from onnx import TensorProto, helper

    model_path, config_path = bundled_voice()
    model = onnx.load(str(model_path))
    graph = model.graph
    for init in graph.initializer:  # the embedded voice names its phoneme embedding "sid": free the name
        if init.name == "sid":
            init.name = "cb_embedding"
    for node in graph.node:
        node.input[:] = ["cb_embedding" if i == "sid" else i for i in node.input]
    old = "output"
    for node in graph.node:
        node.output[:] = [f"{old}__voice" if o == old else o for o in node.output]
    graph.input.append(helper.make_tensor_value_info("sid", TensorProto.INT64, ["batch"]))
    graph.initializer.append(helper.make_tensor("cb_one", TensorProto.INT64, [], [1]))
    graph.initializer.append(helper.make_tensor("cb_shape", TensorProto.INT64, [4], [-1, 1, 1, 1]))
    graph.node.extend([
        helper.make_node("Add", ["sid", "cb_one"], ["cb_sid1"]),
        helper.make_node("Cast", ["cb_sid1"], ["cb_gain_flat"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["cb_gain_flat", "cb_shape"], ["cb_gain"]),
        helper.make_node("Mul", [f"{old}__voice", "cb_gain"], [old]),
    ])
    folder.mkdir(exist_ok=True)
    onnx.save(model, str(folder / "duo.onnx"))
    config = json.loads(config_path.read_text())
    config.update(num_speakers=2, speaker_id_map={"alice": 0, "bob": 1})
    (folder / "duo.onnx.json").write_text(json.dumps(config))
    return folder / "duo.onnx"


def test_speakers_of_a_multi_speaker_voice_share_a_batch(tmp_path):
    """A pool of speakers of one voice: one engine, one batch, each item with its own speaker id."""
    from cosybatch.engines import VoiceRequest, engine_class

    path = multi_speaker_voice(tmp_path / "voices")
    engine = open_engine("piper", str(path), EngineOptions(device="cpu", engine=parse_engine_options(
        engine_class("piper"), {"noise_scale": "0", "noise_w": "0"})))
    text = "Good morning to you."
    prepared = [engine.prepare(text, "same", VoiceRequest(speaker=s, pooled=True)) for s in ("alice", "bob", "1")]
    units = [Unit(k, 0, p.pieces[0].cost, "", p.pieces[0].payload) for k, p in enumerate(prepared)]
    for two_stage in (False, True):
        engine.two_stage = two_stage
        audio = engine.synthesize(units).audio
        assert len(audio[0]) == len(audio[1])
        assert np.abs(audio[1]).max() == pytest.approx(2 * np.abs(audio[0]).max(), rel=1e-3)
        assert np.abs(audio[2] - audio[1]).max() < 1e-5  # "bob" is speaker 1
    with pytest.raises(RowRejected, match="no speaker 'carol'"):
        engine.prepare(text, "x", VoiceRequest(speaker="carol", pooled=True))


def test_a_pool_of_speakers_records_each_rows_speaker(tmp_path):
    path = multi_speaker_voice(tmp_path / "voices")
    corpus = short_corpus(tmp_path / "c.jsonl", 6)
    out = tmp_path / "out"
    result = run(RunConfig.from_options(corpus=corpus, out=out, voice=str(path), voice_pool="#alice,#bob",
                                        progress="none"))
    assert result.exit_code == 0
    metas = {m["id"]: m for m in (i["meta"] for i in read_output(out).values())}
    assert {m["speaker"] for m in metas.values()} == {"alice", "bob"}
    assert {m["voice"] for m in metas.values()} == {"duo"}
    manifest = {r["id"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    assert all(manifest[k]["speaker"] == m["speaker"] for k, m in metas.items())


# -- languages -------------------------------------------------------------------------------------
def test_rows_route_by_language_and_an_unmapped_language_fails_with_the_fix(tmp_path):
    voices = voice_copies(tmp_path / "voices")
    langs = ["en", "en-GB", "de", None, "EN", "fr", "en", "en"]
    corpus = short_corpus(tmp_path / "c.jsonl", language=langs)
    out = tmp_path / "out"
    run(RunConfig.from_options(corpus=corpus, out=out, voice_map=f"en={voices}/a.onnx|{voices}/b.onnx",
                               progress="none"))
    metas = {m["id"]: m for m in (i["meta"] for i in read_output(out).values())}
    assert sorted(metas) == ["r0", "r1", "r3", "r4", "r6", "r7"]
    assert {metas[k]["voice"] for k in ("r0", "r1", "r4", "r6", "r7")} <= {"a", "b"}
    assert metas["r3"]["voice"] == "en_US-joe-medium" and "language" not in metas["r3"]  # no language: --voice
    assert metas["r1"]["language"] == "en-GB"
    failures = {json.loads(x)["id"]: json.loads(x)["reason"] for x in (out / "failures.jsonl").read_text().splitlines()}
    assert set(failures) == {"r2", "r5"}
    assert "language 'de' has no voice" in failures["r2"] and "add de=VOICE to --voice-map" in failures["r2"]
    manifest = {r["id"]: r["language"] for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    assert manifest["r1"] == "en-GB" and manifest["r3"] is None


def test_a_language_the_voice_does_not_speak_fails_without_a_map(tmp_path):
    corpus = short_corpus(tmp_path / "c.jsonl", 2, language=["de", "en-US"])
    out = tmp_path / "out"
    run(RunConfig.from_options(corpus=corpus, out=out, progress="none"))
    assert sorted(voices_of(out)) == ["r1"]
    reason = json.loads((out / "failures.jsonl").read_text().splitlines()[0])["reason"]
    assert "'de'" in reason and "speaks 'en'" in reason and "--voice-map de=VOICE" in reason


def test_a_bad_language_value_is_a_bad_row(tmp_path):
    from cosybatch.corpus import BadRow, Corpus

    corpus = short_corpus(tmp_path / "c.jsonl", 2, language=["en", "not a code"])
    rows = list(Corpus(corpus))
    assert rows[0].language == "en" and isinstance(rows[1], BadRow) and "not a language code" in rows[1].reason


def test_a_cosyvoice_pool_of_sft_speakers_and_prompts_with_a_speed_range(cosyvoice_dir, tmp_path):
    """CosyVoice (the tiny random-weight model): a pool of its SFT speakers and a zero-shot prompt
    (wav + txt) outside the corpus folder (pool paths come from the command line), speed drawn per row."""
    import soundfile as sf

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    t = np.linspace(0, 1.5, 24000, endpoint=False)
    sf.write(prompts / "p.wav", (0.3 * np.sin(2 * np.pi * (180 + 60 * t) * t)).astype("float32"), 16000)
    (prompts / "p.txt").write_text("A short prompt.")
    (tmp_path / "corpus").mkdir()
    corpus = short_corpus(tmp_path / "corpus" / "c.jsonl", 6)
    out = tmp_path / "out"
    result = run(RunConfig.from_options(corpus=corpus, out=out, engine="cosyvoice", voice_pool=f"alice,bob,{prompts}",
                           engine_options={"model": str(cosyvoice_dir), "speed": "0.9:1.1"}, progress="none",
                           qc="off"))
    assert result.exit_code == 0
    metas = [i["meta"] for i in read_output(out).values()]
    assert len(metas) == 6
    for meta in metas:
        assert 0.9 <= meta["prosody"]["speed"] <= 1.1 and meta["settings"]["speed"] == [0.9, 1.1]
        if meta["voice"].startswith("prompt:"):
            assert meta["prompt"] == str(prompts / "p.wav")
        else:
            assert meta["voice"] in ("spk:alice", "spk:bob") and "prompt" not in meta
    with pytest.raises(UsageError, match="without '#'"):
        RunConfig.from_options(corpus=corpus, out=out, engine="cosyvoice", voice_pool="#alice",
                  engine_options={"model": str(cosyvoice_dir)})


def test_a_repair_re_records_pool_rows_with_their_voice_and_language(tmp_path):
    """The journal lost its last line: the repair adopts the last shard's items from their KEY.json
    (their pool voice found among the pool's engines) and the manifest keeps their language."""
    voices = voice_copies(tmp_path / "voices")
    corpus = short_corpus(tmp_path / "c.jsonl", 6, language=["en"] * 6)
    out = tmp_path / "out"
    cfg = RunConfig.from_options(corpus=corpus, out=out, voice_pool=f"{voices}/a.onnx,{voices}/b.onnx",
                                 shard_max_items=3,
                    progress="none")
    run(cfg)
    before = {r["id"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    path = out / ".cosybatch" / "journal.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    last_items = max(i for i, line in enumerate(lines) if json.loads(line)["t"] == "items")
    path.write_bytes(b"".join(lines[:last_items]))
    result = run(cfg)
    assert result.status == "complete" and result.stats["items_done"] == 0  # adopted, not made again
    after = {r["id"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}
    assert {k: (r["voice"], r["language"]) for k, r in after.items()} == \
        {k: (r["voice"], r["language"]) for k, r in before.items()}
