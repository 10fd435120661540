"""Which CosyVoice a folder holds, and instruct rows, end to end on tiny official-layout folders."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
from conftest import write_jsonl
from helpers import read_output

from cosybatch.cosyvoice.family import ENDOFPROMPT
from cosybatch.cosyvoice.model import ModelDirError, read_config
from cosybatch.engines import EngineOptions, VoiceRequest, open_engine
from cosybatch.engines.cosyvoice import CosyVoiceOptions, check_setup
from cosybatch.errors import UsageError


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cosybatch", *args], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def prompt_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("family-corpus")
    t = np.linspace(0, 1.5, 24000, endpoint=False)
    sf.write(folder / "prompt.wav", (0.3 * np.sin(2 * np.pi * (180 + 60 * t) * t)).astype("float32"), 16000)
    return folder


# -- which model a folder is ---------------------------------------------------------------------
def test_check_reports_the_family(cosyvoice_dir):
    report = check_setup(cosyvoice_dir, "alice", None, None)
    assert (report["family"], report["version"], report["sample_rate"]) == ("CosyVoice2-0.5B", 2, 24000)


def test_folders_that_are_no_cosyvoice_are_refused_with_what_was_found(cosyvoice_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelDirError, match=r"no CosyVoice yaml .*found: model\.safetensors"):
        read_config(empty)

    text = (cosyvoice_dir / "cosyvoice2.yaml").read_text()
    # A CosyVoice3 yaml under CosyVoice2's name: the classes say what it is.
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "cosyvoice2.yaml").write_text(
        text.replace("cosyvoice.llm.llm.Qwen2LM", "cosyvoice.llm.llm.CosyVoice3LM")
        .replace("cosyvoice.flow.flow.CausalMaskedDiffWithXvec", "cosyvoice.flow.flow.CausalMaskedDiffWithDiT")
        .replace("cosyvoice.hifigan.generator.HiFTGenerator", "cosyvoice.hifigan.generator.CausalHiFTGenerator"))
    with pytest.raises(ModelDirError) as err:
        read_config(wrong)
    message = str(err.value)
    assert "not a CosyVoice2-0.5B model" in message and "llm builds CosyVoice3LM (expected Qwen2LM)" in message
    assert "Fun-CosyVoice3-0.5B's classes" in message and "cosyvoice3.yaml" in message

    two = tmp_path / "two"
    two.mkdir()
    (two / "cosyvoice2.yaml").write_text(text)
    (two / "cosyvoice3.yaml").write_text(text)
    with pytest.raises(ModelDirError, match=r"holds cosyvoice2\.yaml and cosyvoice3\.yaml"):
        read_config(two)


def test_check_names_the_missing_files_of_the_family(cosyvoice_dir, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(cosyvoice_dir / "cosyvoice2.yaml", partial / "cosyvoice2.yaml")
    with pytest.raises(UsageError, match=r"missing llm\.pt, flow\.pt, .*speech_tokenizer_v2\.onnx.*CosyVoice2-0\.5B"):
        check_setup(partial, None, None, None)


# -- instructions --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v2_engine(cosyvoice_dir, prompt_folder):
    return open_engine("cosyvoice", None, EngineOptions(device="cpu", corpus_dir=prompt_folder,
                                                        engine=CosyVoiceOptions(model=cosyvoice_dir)))


def test_v2_instruction_is_the_lm_prompt_and_replaces_prompt_speech(v2_engine):
    instruct = "Speak slowly and calmly."
    zero = v2_engine.prepare("Hello there.", "a", VoiceRequest(None, "prompt.wav", "A short prompt.", True))
    told = v2_engine.prepare("Hello there.", "a", VoiceRequest(None, "prompt.wav", "A short prompt.", True, instruct))
    assert told.instruct == instruct and zero.instruct is None
    seg = told.payloads[0]
    # upstream's inference_instruct2: the instruction (ending in <|endofprompt|>) is the LM's prompt
    # text, the LM reads no prompt speech, the flow keeps the prompt's speech and embedding.
    assert seg.prompt_text_tokens == tuple(v2_engine.tokenizer.encode(instruct + ENDOFPROMPT))
    assert not seg.lm_speech and zero.payloads[0].lm_speech
    assert seg.voice.prompt_tokens is not None
    # An instruction already ending in <|endofprompt|> is taken as it is.
    again = v2_engine.prepare("Hello there.", "a", VoiceRequest("alice", None, None, True, instruct + ENDOFPROMPT))
    assert again.payloads[0].prompt_text_tokens == seg.prompt_text_tokens


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
               "--progress", "none", "--device", "cpu", "--instruct", "Speak fast.")
    assert proc.returncode == 0, proc.stderr
    items = read_output(out)
    assert sorted(items) == ["cloned", "default", "plain", "told"]
    said = {i: items[i]["meta"].get("instruct") for i in items}
    # Rows without an instruct value take --instruct; rows with one keep theirs.
    assert said == {"plain": "Speak fast.", "told": "Whisper it.", "cloned": "Sound happy.", "default": "Speak fast."}
    manifest = pq.read_table(out / "manifest.parquet").to_pylist()
    assert {m["id"]: m["instruct"] for m in manifest} == said
    for item in items.values():
        assert item["audio"].size > 0 and item["meta"]["num_samples"] == item["audio"].size


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
