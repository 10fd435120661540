"""What one CosyVoice row may ask of the job: an instruction or prompt transcript over its limit, a
prompt that would overflow the LM's decode slot, a NUL byte in prompt_wav. Each fails that row with
the reason; the other rows are written and the job ends normally (issue 23, cases 7 and 8)."""

from __future__ import annotations

import json
import resource

import numpy as np
import pytest
import soundfile as sf
from helpers import read_output, write_jsonl

from cosybatch.config import RunConfig
from cosybatch.engines import EngineOptions, VoiceRequest, open_engine
from cosybatch.engines.cosyvoice import CosyVoiceOptions
from cosybatch.errors import UsageError
from cosybatch.run.local import run


def run_rows(model, tmp_path, rows, **engine_options) -> tuple[dict, dict]:
    t = np.linspace(0, 1.5, 24000, endpoint=False)
    sf.write(tmp_path / "prompt.wav", (0.3 * np.sin(2 * np.pi * (180 + 60 * t) * t)).astype("float32"), 16000)
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "out"
    run(RunConfig.from_options(corpus=corpus, out=out, engine="cosyvoice", device="cpu", progress="none",
                  engine_options={"model": str(model), **engine_options}))
    failures = {json.loads(x)["id"]: json.loads(x)["reason"] for x in (out / "failures.jsonl").read_text().splitlines()}
    return read_output(out), failures


def test_long_instruct_and_prompt_text_fail_their_rows_only(cosyvoice_dir, tmp_path):
    peak_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = [
        {"id": "ok", "text": "Hello there.", "speaker": "alice", "instruct": "Speak cheerfully."},
        {"id": "long-instruct", "text": "Hello there.", "speaker": "alice", "instruct": "word " * 20_000},
        {"id": "long-prompt-text", "text": "Hello there.", "prompt_wav": "prompt.wav", "prompt_text": "x" * 5000},
        {"id": "ok-2", "text": "Zero-shot.", "prompt_wav": "prompt.wav", "prompt_text": "A short prompt."},
    ]
    items, failures = run_rows(cosyvoice_dir, tmp_path, rows)
    assert set(items) == {"ok", "ok-2"}
    assert set(failures) == {"long-instruct", "long-prompt-text"}
    assert "instruct is 99,999 characters" in failures["long-instruct"]
    assert "--max-instruct-chars" in failures["long-instruct"]
    assert "prompt_text is 5,000 characters" in failures["long-prompt-text"]
    # Before the bound the long instruction alone took this process past 12 GB.
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before_kib) / 1024
    assert grown_mib < 2048, grown_mib


def test_a_prompt_over_the_lm_context_fails_its_row(cosyvoice_dir, tmp_path):
    rows = [{"id": "ok", "text": "Hello there.", "speaker": "alice"},
            {"id": "over", "text": "Hello there.", "speaker": "alice", "instruct": "word " * 6000}]
    items, failures = run_rows(cosyvoice_dir, tmp_path, rows, max_instruct_chars=100_000)
    assert set(items) == {"ok"} and set(failures) == {"over"}
    assert "LM positions" in failures["over"] and "a decode slot holds" in failures["over"]


def test_the_job_default_instruct_is_bounded_too(cosyvoice_dir):
    with pytest.raises(UsageError, match="--max-instruct-chars"):
        open_engine("cosyvoice", None, EngineOptions(device="cpu", engine=CosyVoiceOptions(
            model=cosyvoice_dir, speaker="alice", instruct="x" * 1001)))


def test_nul_in_prompt_wav_fails_its_row_naming_the_column(cosyvoice_dir, tmp_path):
    rows = [{"id": "ok", "text": "Hello there.", "speaker": "alice"},
            {"id": "nul", "text": "Hello there.", "prompt_wav": "prompt\x00.wav", "prompt_text": "A prompt."},
            {"id": "ok-2", "text": "Zero-shot.", "prompt_wav": "prompt.wav", "prompt_text": "A short prompt."}]
    items, failures = run_rows(cosyvoice_dir, tmp_path, rows)
    assert set(items) == {"ok", "ok-2"} and set(failures) == {"nul"}
    assert "prompt_wav" in failures["nul"] and "NUL" in failures["nul"]


def test_engine_refuses_nul_prompt_paths_itself(cosyvoice_dir, tmp_path):
    """Below the job's own check: the engine's prepare (a direct caller, a library user)."""
    from cosybatch.engines import RowRejected

    engine = open_engine("cosyvoice", None, EngineOptions(device="cpu", corpus_dir=tmp_path,
                                                         engine=CosyVoiceOptions(model=cosyvoice_dir)))
    with pytest.raises(RowRejected, match="NUL"):
        engine.prepare("Hello.", "a", VoiceRequest(None, "p\x00.wav", "x", True))
    with pytest.raises(RowRejected, match="NUL"):
        engine.prepare("Hello.", "a", VoiceRequest(None, str(tmp_path / "p\x00.wav"), "x", False))
