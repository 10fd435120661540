"""``--model DIR`` on a folder that is not a model says what was expected, not what the folder holds
(newcomer defect 7: it listed the folder's files)."""

from __future__ import annotations

import pytest

from cosybatch.engines.cosyvoice import check_setup
from cosybatch.errors import UsageError


def _refusal(folder) -> str:
    with pytest.raises(UsageError) as info:
        check_setup(folder, None, None, None)
    return str(info.value)


def test_a_folder_that_is_not_a_model_is_refused_with_what_was_expected(tmp_path):
    folder = tmp_path / "downloads"
    folder.mkdir()
    for i in range(40):
        (folder / f"holiday-{i:02d}.jpg").write_bytes(b"")
    message = _refusal(folder)
    assert "holiday-" not in message  # none of the folder's own files
    assert len(message.splitlines()) <= 2
    for expected in ("cosyvoice.yaml", "cosyvoice2.yaml", "cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt",
                     "campplus.onnx", "speech_tokenizer", "CosyVoice-BlankEN"):
        assert expected in message


def test_the_folder_above_a_model_points_at_it(tmp_path):
    parent = tmp_path / "pretrained_models"
    (parent / "CosyVoice2-0.5B").mkdir(parents=True)
    (parent / "CosyVoice2-0.5B" / "cosyvoice2.yaml").write_text("sample_rate: 24000\n")
    (parent / "notes.txt").write_text("")
    message = _refusal(parent)
    assert str(parent / "CosyVoice2-0.5B") in message and "pass that folder" in message
    assert "notes.txt" not in message
