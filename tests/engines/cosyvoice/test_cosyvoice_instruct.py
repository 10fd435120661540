"""Instructions (`instruct` rows, --instruct) and the LM prompts they make, for every CosyVoice
family that follows them, end to end on tiny official-layout folders; an engine that cannot follow
one fails only those rows. Which family a folder holds: test_cosyvoice_folders.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from helpers import cli, read_output, write_jsonl

from cosybatch.cosyvoice.family import ENDOFPROMPT
from cosybatch.engines import EngineOptions, VoiceRequest, open_engine
from cosybatch.engines.cosyvoice import CosyVoiceOptions


@pytest.fixture(scope="module")
def prompt_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("family-corpus")
    t = np.linspace(0, 1.5, 24000, endpoint=False)
    sf.write(folder / "prompt.wav", (0.3 * np.sin(2 * np.pi * (180 + 60 * t) * t)).astype("float32"), 16000)
    return folder


@pytest.fixture(scope="module")
def v2_engine(cosyvoice_dir, prompt_folder):
    return open_engine("cosyvoice", None, EngineOptions(device="cpu", corpus_dir=prompt_folder,
                                                        engine=CosyVoiceOptions(model=cosyvoice_dir)))


def test_v2_instruction_is_the_lm_prompt_and_replaces_prompt_speech(v2_engine):
    instruct = "Speak slowly and calmly."
    zero = v2_engine.prepare("Hello there.", "a", VoiceRequest(None, "prompt.wav", "A short prompt.", True))
    told = v2_engine.prepare("Hello there.", "a", VoiceRequest(None, "prompt.wav", "A short prompt.", True, instruct))
    assert told.instruct == instruct and zero.instruct is None
    seg = told.pieces[0].payload
    # upstream's inference_instruct2: the instruction (ending in <|endofprompt|>) is the LM's prompt
    # text, the LM reads no prompt speech, the flow keeps the prompt's speech and embedding.
    assert seg.prompt_text_tokens == tuple(v2_engine.tokenizer.encode(instruct + ENDOFPROMPT))
    assert not seg.lm_speech and zero.pieces[0].payload.lm_speech
    assert seg.voice.prompt_tokens is not None
    # An instruction already ending in <|endofprompt|> is taken as it is.
    again = v2_engine.prepare("Hello there.", "a", VoiceRequest("alice", None, None, True, instruct + ENDOFPROMPT))
    assert again.pieces[0].payload.prompt_text_tokens == seg.prompt_text_tokens


@pytest.mark.slow
def test_instruct_rows_run_and_are_recorded(cosyvoice_dir, prompt_folder, tmp_path):
    corpus = write_jsonl(prompt_folder / "instruct.jsonl", [
        {"id": "plain", "text": "Hello there.", "speaker": "alice"},
        {"id": "told", "text": "Hello there.", "speaker": "alice", "instruct": "Whisper it."},
        {"id": "cloned", "text": "Zero-shot with a style.", "prompt_wav": "prompt.wav",
         "prompt_text": "A short prompt.", "instruct": "Sound happy."},
        {"id": "default", "text": "The job's default instruction.", "speaker": "bob"},
    ])
    out = tmp_path / "out"
    proc = cli("run", str(corpus), "--engine", "cosyvoice", "--model", str(cosyvoice_dir), "--out", str(out),
               "--progress", "none", "--device", "cpu", "--instruct", "Speak fast.",
               "--export", "hf,nemo")
    assert proc.returncode == 0, proc.stderr
    items = read_output(out)
    assert sorted(items) == ["cloned", "default", "plain", "told"]
    said = {i: items[i]["meta"].get("instruct") for i in items}
    # Rows without an instruct value take --instruct; rows with one keep theirs.
    assert said == {"plain": "Speak fast.", "told": "Whisper it.", "cloned": "Sound happy.", "default": "Speak fast."}
    manifest = pq.read_table(out / "manifest.parquet").to_pylist()
    assert {m["id"]: m["instruct"] for m in manifest} == said
    # The dataset exports carry it too.
    hf = pq.read_table(next((out / "exports" / "hf" / "data").glob("*.parquet")), columns=["id", "instruct"])
    assert dict(zip(hf.column("id").to_pylist(), hf.column("instruct").to_pylist(), strict=True)) == said
    nemo_manifest = out / "exports" / "nemo" / "tarred_audio_manifest.json"
    nemo = [json.loads(line) for line in nemo_manifest.read_text().splitlines()]
    assert {e["id"]: e["instruct"] for e in nemo} == said
    for item in items.values():
        assert item["audio"].size > 0 and item["meta"]["num_samples"] == item["audio"].size


@pytest.mark.slow
def test_engines_that_cannot_follow_instructions_fail_only_those_rows(tmp_path):
    corpus = write_jsonl(tmp_path / "piper.jsonl", [
        {"id": "ok", "text": "A plain row."},
        {"id": "told", "text": "An instructed row.", "instruct": "Whisper it."},
    ])
    out = tmp_path / "out"
    proc = cli("run", str(corpus), "--out", str(out), "--progress", "none")
    assert proc.returncode == 0, proc.stderr
    assert sorted(read_output(out)) == ["ok"]
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert [f["id"] for f in failures] == ["told"]
    assert "cannot follow an instruction" in failures[0]["reason"]


# -- CosyVoice-300M ------------------------------------------------------------------------------
def family_corpus(folder: Path, name: str, rows: list[dict]) -> Path:
    return write_jsonl(folder / f"{name}.jsonl", rows)


def run_job(model: Path, corpus: Path, out: Path, *extra: str) -> tuple[dict, dict]:
    proc = cli("run", str(corpus), "--engine", "cosyvoice", "--model", str(model), "--out", str(out),
               "--progress", "none", "--device", "cpu", "--no-normalize", *extra)
    assert proc.returncode == 0, proc.stderr
    failures = {}
    if (out / "failures.jsonl").exists():
        failures = {json.loads(line)["id"]: json.loads(line)["reason"]
                    for line in (out / "failures.jsonl").read_text().splitlines()}
    return read_output(out), failures


@pytest.mark.slow
def test_v1_instruct_rows_take_a_speaker_and_drop_its_embedding_from_the_lm(cosyvoice_v1_instruct_dir,
                                                                           prompt_folder, tmp_path):
    model = cosyvoice_v1_instruct_dir
    engine = open_engine("cosyvoice", None, EngineOptions(device="cpu", corpus_dir=prompt_folder,
                                                          engine=CosyVoiceOptions(model=model)))
    speaker = engine.voices.speakers[0]
    told = engine.prepare("Hello there.", "a", VoiceRequest(speaker, None, None, True, "A calm narrator."))
    seg = told.pieces[0].payload
    # upstream's frontend_instruct: the instruction is the LM's prompt text, the LM gets no speaker
    # embedding, the flow keeps it.
    # The released 300M-Instruct frontend: the normalised instruction, then "<endofprompt>".
    assert seg.prompt_text_tokens == tuple(engine.tokenizer.encode(engine._normalize("A calm narrator.")
                                                                   + "<endofprompt>"))
    assert not seg.lm_embedding and not seg.lm_speech and seg.voice.embedding.shape == (192,)
    plain = engine.prepare("Hello there.", "a", VoiceRequest(speaker, None, None, True))
    assert plain.pieces[0].payload.lm_embedding and plain.pieces[0].payload.prompt_text_tokens == ()

    corpus = family_corpus(prompt_folder, "v1i", [
        {"id": "told", "text": "Hello there.", "speaker": speaker, "instruct": "A calm narrator."},
        {"id": "plain", "text": "Hello there.", "speaker": speaker},
        {"id": "prompted", "text": "Prompt audio and an instruction.", "prompt_wav": "prompt.wav",
         "prompt_text": "A short prompt.", "instruct": "Sound happy."},
    ])
    items, failures = run_job(model, corpus, tmp_path / "out")
    assert sorted(items) == ["plain", "told"] and list(failures) == ["prompted"]
    assert "built-in speaker" in failures["prompted"]
    assert items["told"]["meta"]["instruct"] == "A calm narrator." and "instruct" not in items["plain"]["meta"]


# -- Fun-CosyVoice3 ------------------------------------------------------------------------------
def test_v3_lm_prompts_open_with_the_system_prompt(cosyvoice_v3_dir, prompt_folder):
    engine = open_engine("cosyvoice", None, EngineOptions(device="cpu", corpus_dir=prompt_folder,
                                                          engine=CosyVoiceOptions(model=cosyvoice_v3_dir)))
    encode = engine.tokenizer.encode
    zero = engine.prepare("Hello there.", "a", VoiceRequest(None, "prompt.wav", "A short prompt.", True))
    cross = engine.prepare("Hello there.", "a", VoiceRequest(None, "prompt.wav", None, True))
    told = engine.prepare("Hello there.", "a", VoiceRequest(None, "prompt.wav", "A short prompt.", True, "Be quick."))
    # Upstream's CosyVoice3 examples: every LM prompt opens with the system prompt and <|endofprompt|>.
    assert zero.pieces[0].payload.prompt_text_tokens == tuple(encode("You are a helpful assistant.<|endofprompt|>"
                                                               "A short prompt."))
    assert zero.pieces[0].payload.lm_speech
    assert cross.pieces[0].payload.prompt_text_tokens == tuple(encode("You are a helpful assistant.<|endofprompt|>"))
    assert not cross.pieces[0].payload.lm_speech
    assert told.pieces[0].payload.prompt_text_tokens == tuple(
        encode("You are a helpful assistant. Be quick.<|endofprompt|>"))
    assert not told.pieces[0].payload.lm_speech
    # Written the way upstream's examples write them, the system prompt is not doubled.
    full = "You are a helpful assistant. Be quick.<|endofprompt|>"
    as_upstream = engine.prepare("Hello there.", "a", VoiceRequest(None, "prompt.wav", "A short prompt.", True, full))
    assert as_upstream.pieces[0].payload.prompt_text_tokens == told.pieces[0].payload.prompt_text_tokens
    upstream_prompt = VoiceRequest(None, "prompt.wav", "You are a helpful assistant.<|endofprompt|>A short prompt.",
                                   True)
    assert engine.prepare("Hello there.", "a", upstream_prompt).pieces[0].payload.prompt_text_tokens == \
        zero.pieces[0].payload.prompt_text_tokens


def test_jsonl_instruct_is_read_past_the_sniffed_lines(tmp_path):
    from cosybatch.corpus import JSONL_SNIFF_ROWS, Corpus

    rows = [{"id": f"r{i}", "text": "Hello."} for i in range(JSONL_SNIFF_ROWS + 20)]
    rows[-1]["instruct"] = "  Whisper it.  "
    got = {r.id: r.instruct for r in Corpus(write_jsonl(tmp_path / "late.jsonl", rows))}
    assert got[f"r{JSONL_SNIFF_ROWS + 19}"] == "Whisper it." and got["r0"] is None


def test_default_instruction_is_cleaned_and_fingerprinted(cosyvoice_dir):
    def describe(instruct):
        options = CosyVoiceOptions(model=cosyvoice_dir, speaker="alice", instruct=instruct)
        return open_engine("cosyvoice", None, EngineOptions(device="cpu", engine=options)).describe()

    plain = describe(None)
    assert "instruct" not in plain and describe("   ") == plain  # blank: no instruction
    # A changed --instruct changes the fingerprint, so a resume with another one is refused.
    assert describe(" Speak fast. ")["instruct"] == "Speak fast."


def test_merge_joins_parts_with_and_without_instructions(tmp_path, monkeypatch):
    """With --shard, one worker's rows may all lack an instruction: its manifest has no instruct
    column while another's has one; the merged manifest keeps every row and fills the gap. The
    parts here are manifests only, so merge's checks that each part is the same job, finished and
    whole (tested in tests/store/test_distributed.py) are passed over: this is about the join."""
    from cosybatch.store import distributed
    from cosybatch.store.checkpoint import write_manifest_table
    from cosybatch.store.distributed import merge

    monkeypatch.setattr(distributed, "check_same_job", lambda root, parts, count, verb: None)
    monkeypatch.setattr(distributed, "unmergeable", lambda part: None)

    def record(i: int, **extra) -> dict:
        return {"key": f"k{i}", "id": f"r{i}", "shard": "shard-000000.tar", "text": "Hello.", "voice": "spk:alice",
                "duration_s": 1.0, "num_samples": 24000, "sample_rate": 24000, "row": i, **extra}

    for index, records in enumerate([[record(0, instruct="Whisper it."), record(1)], [record(2)]]):
        part = tmp_path / f"part-{index:05d}-of-00002"
        part.mkdir()
        (part / "stats.json").write_text(json.dumps({"status": "complete"}))
        write_manifest_table(part, records)
    assert merge(tmp_path)["items"] == 3
    merged = pq.read_table(tmp_path / "manifest.parquet").to_pylist()
    assert {m["id"]: m["instruct"] for m in merged} == {"r0": "Whisper it.", "r1": None, "r2": None}
