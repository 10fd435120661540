"""Newcomer defect 1: a run into a folder holding another job is refused with one sentence first,
in the terms a user chose, and --restart is never offered without saying that it deletes audio."""

from __future__ import annotations

import pytest
from helpers import write_jsonl

from cosybatch.config import RunConfig
from cosybatch.errors import ResumeMismatchError
from cosybatch.run.local import run


def tone(tmp_path, **kw) -> RunConfig:
    corpus = kw.pop("corpus", None) or write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "One."},
                                                                           {"id": "b", "text": "Two."}])
    return RunConfig.from_options(**{"corpus": corpus, "out": tmp_path / "out", "engine": "tone", "progress": "none",
                                     **kw})


def refusal(cfg: RunConfig) -> str:
    with pytest.raises(ResumeMismatchError) as info:
        run(cfg)
    return str(info.value)


def check_restart_is_explained(message: str, out) -> None:
    for line in message.splitlines():
        if "--restart" in line:
            assert "delete" in line.lower() and str(out) in line, line


def test_another_engine_is_named_in_the_first_line(tmp_path):
    assert run(tone(tmp_path)).status == "complete"
    message = refusal(tone(tmp_path, engine="piper"))
    first = message.splitlines()[0]
    assert first == f"{tmp_path / 'out'}: this folder holds a tone job; this run asks for piper."
    assert "engine.engine was 'tone', now 'piper'" in message.splitlines()[1]  # the details after
    check_restart_is_explained(message, tmp_path / "out")


def test_another_setting_names_the_setting(tmp_path):
    assert run(tone(tmp_path)).status == "complete"
    message = refusal(tone(tmp_path, engine_options={"base_hz": 300}))
    assert message.splitlines()[0].endswith("this run's settings differ from the job in this folder: base_hz.")
    check_restart_is_explained(message, tmp_path / "out")


def test_another_corpus_file_and_a_changed_corpus(tmp_path):
    assert run(tone(tmp_path)).status == "complete"
    other = write_jsonl(tmp_path / "other.jsonl", [{"id": "a", "text": "One."}])
    message = refusal(tone(tmp_path, corpus=other))
    assert message.splitlines()[0].endswith("this folder was made from c.jsonl; this run reads other.jsonl.")
    check_restart_is_explained(message, tmp_path / "out")

    changed = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "One."}, {"id": "b", "text": "Three."}])
    message = refusal(tone(tmp_path, corpus=changed))
    assert "another version of the corpus (c.jsonl changed)" in message.splitlines()[0]
    assert "--allow-corpus-change" in message
    check_restart_is_explained(message, tmp_path / "out")
