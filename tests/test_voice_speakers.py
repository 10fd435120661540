"""Issue 31, hole 8 and its second note: a speaker range is checked before it is expanded (a cap of
MAX_SPEAKER_RANGE speakers a range, and the voice's own speaker count at preflight), and a pool
naming speakers of a one-speaker voice is refused naming the pool entry, never "drop --speaker"."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
from helpers import write_jsonl

from cosybatch.config import RunConfig
from cosybatch.engines import RowRejected, VoiceRequest
from cosybatch.errors import UsageError
from cosybatch.run.preflight import check
from cosybatch.voices import MAX_SPEAKER_RANGE, parse_pool


@pytest.mark.parametrize("spec", ["#0-100000000", "#0-99999999999999999999999", f"v#1-{MAX_SPEAKER_RANGE + 1}"])
def test_a_huge_speaker_range_is_refused_before_it_is_expanded(spec):
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(UsageError, match="speaker range"):
        parse_pool(spec)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib < 50 * 1024


def test_a_range_at_the_cap_is_expanded():
    assert len(parse_pool(f"#1-{MAX_SPEAKER_RANGE}")) == MAX_SPEAKER_RANGE


def config(tmp_path: Path, **kw) -> RunConfig:
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "Hello there."}])
    return RunConfig.from_options(corpus=corpus, out=tmp_path / "out", progress="none", **kw)


def test_speakers_of_a_one_speaker_voice_are_refused_at_check_naming_the_entry(tmp_path):
    with pytest.raises(UsageError) as info:
        check(config(tmp_path, voice_pool="#0-3"))
    message = str(info.value)
    assert message.startswith("--voice-pool entry '#0': voice") and "has one speaker" in message
    assert "--speaker" not in message


def two_speakers(tmp_path: Path) -> Path:
    from cosybatch.engines.piper.voice import bundled_voice

    model, voice_config = bundled_voice()
    raw = json.loads(voice_config.read_text())
    raw.update(num_speakers=2, speaker_id_map={"alice": 0, "bob": 1})
    (tmp_path / "duo.onnx").symlink_to(model)
    (tmp_path / "duo.onnx.json").write_text(json.dumps(raw))
    return tmp_path / "duo.onnx"


def test_speakers_past_the_voices_count_are_refused_at_check(tmp_path):
    voice = two_speakers(tmp_path)
    check(config(tmp_path, voice=str(voice), voice_pool="#0-1,#alice,#bob"))  # all of them: passes
    for pool, entry in (("#0-5", "#2"), ("#carol", "#carol"), (f"{voice}#7", f"{voice}#7")):
        with pytest.raises(UsageError) as info:
            check(config(tmp_path, voice=str(voice), voice_pool=pool))
        assert str(info.value).startswith(f"--voice-pool entry {entry!r}: voice 'duo' has speakers 0..1 (alice, bob)")


def test_a_pooled_speaker_of_a_one_speaker_voice_fails_its_row_naming_the_entry(engine):
    with pytest.raises(RowRejected) as info:
        engine.prepare("Hello there.", "x", VoiceRequest(speaker="2", pooled=True))
    message = str(info.value)
    assert message.startswith(f"--voice-pool entry {engine.voice_name}#2: voice") and "one speaker" in message
    assert "--speaker" not in message
