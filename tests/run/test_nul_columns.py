"""A NUL byte in a row's voice or prompt_wav fails that row, naming the column, for any engine: the
OS refuses such a path with a ValueError that used to end the job on every rerun (issue 23, case 8)."""

from __future__ import annotations

import json

from helpers import read_output, write_jsonl

from cosybatch.run.local import run


def test_nul_in_voice_or_prompt_wav_fails_the_row_naming_the_column(tone, tmp_path):
    rows = [{"id": "ok", "text": "Fine.", "voice": "a"},
            {"id": "nul-voice", "text": "Bad voice.", "voice": "a\x00b"},
            {"id": "nul-prompt", "text": "Bad prompt.", "voice": "a", "prompt_wav": "p\x00.wav"},
            {"id": "ok-2", "text": "Also fine.", "voice": "b"}]
    out = tmp_path / "out"
    result = run(tone(write_jsonl(tmp_path / "c.jsonl", rows), out))
    assert set(read_output(out)) == {"ok", "ok-2"}
    reasons = {json.loads(x)["id"]: json.loads(x)["reason"] for x in (out / "failures.jsonl").read_text().splitlines()}
    assert reasons["nul-voice"].startswith("voice ") and "NUL" in reasons["nul-voice"]
    assert reasons["nul-prompt"].startswith("prompt_wav ") and "NUL" in reasons["nul-prompt"]
    assert result.stats["items_failed"] == 2
