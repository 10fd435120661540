"""Issue 31, hole 6: a damaged ASR model folder (a truncated model.bin, a tokenizer.json that does
not parse or is not Whisper's) is a usage error (exit 2) naming the file and the fix, at
`run --check`, before a run writes anything, and in `cosybatch qc --asr` before it reads a clip:
never an internal error with a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import cli, write_jsonl

from cosybatch.errors import UsageError
from cosybatch.qc import asr

pytest.importorskip("ctranslate2")
REAL = asr.default_model_dir()
pytestmark = pytest.mark.skipif(REAL is None, reason="the QC extra's tiny.en is not installed")


def damaged(tmp_path: Path, how: str) -> Path:
    """A copy of the real tiny.en folder with one file damaged."""
    folder = tmp_path / f"tiny-{how}"
    folder.mkdir()
    for name in sorted(p.name for p in REAL.iterdir()):
        if how == "no-vocabulary" and name.startswith("vocabulary"):
            continue
        if how == "truncated" and name == "model.bin":
            with (REAL / name).open("rb") as src:
                (folder / name).write_bytes(src.read(1_000_000))
        elif how == "not-json" and name == "tokenizer.json":
            (folder / name).write_text('{"version": "1.0", "model": ')
        elif how == "foreign-tokenizer" and name == "tokenizer.json":
            (folder / name).write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0},
                                                                            "unk_token": "a"}}))
        else:
            (folder / name).symlink_to(REAL / name)
    return folder


CASES = [("truncated", "model.bin"), ("no-vocabulary", "vocabulary"),
         ("not-json", "tokenizer.json"), ("foreign-tokenizer", "tokenizer.json")]


@pytest.mark.parametrize(("how", "file"), CASES)
def test_ready_model_opens_the_files_and_names_the_damaged_one(tmp_path, how, file):
    folder = damaged(tmp_path, how)
    with pytest.raises(UsageError) as info:
        asr.ready_model(folder)
    message = str(info.value)
    assert f"--qc-asr-model {folder}: {file} is damaged" in message or (file == "vocabulary" and
                                                                         "cannot load its vocabulary" in message)
    assert "ct2-transformers-converter" in message


def test_the_real_model_passes_and_is_opened_once(monkeypatch):
    assert asr.ready_model(REAL) == REAL
    import ctranslate2

    def not_again(*args, **kw):
        raise AssertionError("opened twice")

    monkeypatch.setattr(ctranslate2.models, "Whisper", not_again)
    assert asr.ready_model(REAL) == REAL


@pytest.mark.parametrize(("how", "file"), [CASES[0], CASES[2]])
def test_run_check_and_run_refuse_with_exit_2_and_write_nothing(tmp_path, how, file):
    folder = damaged(tmp_path, how)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "One."}])
    out = tmp_path / "out"
    for extra in (["--check"], []):
        proc = cli("run", corpus, "--out", out, "--engine", "tone", "--qc", "asr", "--qc-asr-model", folder, *extra)
        assert proc.returncode == 2, proc.stderr
        assert f"{file} is damaged" in proc.stderr and "Traceback" not in proc.stderr
        assert not out.exists()


def test_qc_asr_refuses_with_exit_2_before_reading_the_folder(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "One."}])
    out = tmp_path / "out"
    cli("run", corpus, "--out", out, "--engine", "tone", check=True)
    before = sorted(p.name for p in out.iterdir())
    folder = damaged(tmp_path, "truncated")
    proc = cli("qc", out, "--asr", "--asr-model", folder)
    assert proc.returncode == 2, proc.stderr
    assert "model.bin is damaged" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == before
    shutil.rmtree(out)
