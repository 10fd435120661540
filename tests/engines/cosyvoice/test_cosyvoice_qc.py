"""What the CosyVoice LM tells the quality gate: why each row stopped (its end token, the length cap,
non-finite logits), and a folder whose end token never comes runs every row to the cap, which the
gate flags, retakes with new seeds and fails with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import read_output, write_parquet

from cosybatch.config import RunConfig
from cosybatch.cosyvoice.lm.slots import LMRequest, Sampling
from cosybatch.cosyvoice.lm.v2 import load_llm
from cosybatch.cosyvoice.tiny.v2 import SPEECH_TOKENS
from cosybatch.run.local import run

ROWS = [{"id": f"r{i}", "text": text, "speaker": "alice"} for i, text in
        enumerate(["Hello there.", "The kettle is boiling.", "Two cups, please."])]


def edited_folder(src: Path, dest: Path, edit) -> Path:
    """A copy of a model folder with its llm.pt changed by `edit(state)`."""
    shutil.copytree(src, dest)
    state = torch.load(dest / "llm.pt", weights_only=True)
    edit(state)
    torch.save(state, dest / "llm.pt")
    return dest


def no_end_token(state: dict) -> None:
    state["llm_decoder.bias"][SPEECH_TOKENS:] = -1e9  # the stop ids are never sampled


@pytest.fixture(scope="module")
def endless(cosyvoice_dir, tmp_path_factory) -> Path:
    return edited_folder(cosyvoice_dir, tmp_path_factory.mktemp("endless") / "CosyVoice2-endless", no_end_token)


def test_each_request_says_why_it_stopped(cosyvoice_dir, endless):
    lm = load_llm(cosyvoice_dir)
    stopped = LMRequest(text=list(range(100, 106)), min_tokens=0, max_tokens=400)
    lm.generate([stopped], Sampling(greedy=True))
    # The stop id is refused before the minimum length: here the minimum is the cap.
    capped = LMRequest(text=list(range(100, 106)), min_tokens=3, max_tokens=3)
    lm.generate([capped], Sampling(greedy=True))
    assert capped.stop == "length_cap" and len(capped.tokens) == 3
    never = load_llm(endless)
    runaway = LMRequest(text=list(range(100, 106)), max_tokens=40)
    never.generate([runaway])
    assert runaway.stop == "length_cap" and len(runaway.tokens) == 40
    assert stopped.stop == "eos" and len(stopped.tokens) < 400  # the folder's LM ends its rows (short=True)
    # Weights are checked for NaN at load; logits can still overflow at run time (here, by hand).
    with torch.no_grad():
        lm.llm_decoder.weight.fill_(float("nan"))
    nan = LMRequest(text=list(range(100, 106)), max_tokens=40)
    lm.generate([nan])
    assert nan.stop == "nonfinite"


def job(model: Path, corpus: Path, out: Path, **settings) -> RunConfig:
    return RunConfig.from_options(corpus=corpus, out=out, engine="cosyvoice", device="cpu", progress="none",
                     engine_options={"model": model}, **settings)


def test_rows_that_run_to_the_cap_are_flagged_retaken_and_failed(endless, tmp_path):
    corpus = write_parquet(tmp_path / "c.parquet", ROWS)
    signals_only = tmp_path / "signals"
    assert run(job(endless, corpus, signals_only)).status == "complete"
    for item in read_output(signals_only).values():  # recorded, committed: the default gates nothing
        qc = item["meta"]["qc"]
        assert qc["lm"]["stop"] == "length_cap" and "length_cap" in qc["flags"]
    out = tmp_path / "gated"
    result = run(job(endless, corpus, out, qc="gate"))
    assert (result.stats["items_done"], result.stats["items_failed"]) == (0, 3)
    for line in (out / "failures.jsonl").read_text().splitlines():
        failed = json.loads(line)
        assert failed["reason"].startswith("qc: length_cap") and failed["reason"].endswith("after 3 attempts")
        takes = failed["qc"]["attempts"]
        assert [t["lm"]["stop"] for t in takes] == ["length_cap"] * 3
        assert len({t["signals"]["duration_s"] for t in takes} | {t["lm"]["repeat_4gram"] for t in takes}) > 1
    assert result.stats["qc"]["retries"] == 6 and result.stats["qc"]["flags"]["length_cap"] == 3


def test_a_healthy_folder_records_each_rows_stop(cosyvoice_dir, tmp_path):
    corpus = write_parquet(tmp_path / "c.parquet", ROWS)
    out = tmp_path / "out"
    assert run(job(cosyvoice_dir, corpus, out)).status == "complete"
    for item in read_output(out).values():
        lm = item["meta"]["qc"]["lm"]
        assert lm["stop"] == "eos" and lm["tokens"] > 0 and lm["token_run"] >= 1
