"""Fun-CosyVoice3's LM and tiny folder against upstream's recorded outputs (tests/golden/v3/).

The fixtures come from ``tests/golden/make_v3_golden.py``, which ran upstream's own classes on the
folder our writer produces; these tests need neither upstream nor its dependencies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import GOLDEN as GOLDEN_ROOT

from cosybatch.cosyvoice.frontend.text import V3_SPECIALS
from cosybatch.cosyvoice.lm.slots import LMRequest, Sampling
from cosybatch.cosyvoice.lm.v3 import (
    ENDOFPROMPT_ID,
    SILENT_TOKENS,
    MissingEndOfPrompt,
    SpeechLM3,
    drop_long_silences,
    load_llm_v3,
)
from cosybatch.cosyvoice.tiny.v3 import folder_digests, write_model_dir
from cosybatch.cosyvoice.weights import ModelDirError

GOLDEN = GOLDEN_ROOT / "v3"
RERUN = "rerun tests/golden/make_v3_golden.py (see its docstring) if the change is intended"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads((GOLDEN / "lm.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory, golden) -> Path:
    """The tiny v3 folder the fixtures were recorded on, written by our writer."""
    folder = tmp_path_factory.mktemp("cosyvoice3") / "Fun-CosyVoice3-tiny"
    return write_model_dir(folder, seed=golden["folder"]["seed"])


@pytest.fixture(scope="module")
def lm(v3_dir) -> SpeechLM3:
    return load_llm_v3(v3_dir)


def requests_of(golden: dict) -> list[LMRequest]:
    return [LMRequest(text=c["text"], prompt_text=c["prompt_text"], prompt_speech=c["prompt_speech"])
            for c in golden["lm_cases"]]


def test_writer_writes_the_recorded_folder(v3_dir, golden):
    recorded, written = golden["folder"]["files"], folder_digests(v3_dir)
    assert sorted(written) == sorted(recorded), RERUN
    changed = sorted(name for name in recorded if written[name] != recorded[name])
    assert not changed, f"the tiny v3 writer now writes different {', '.join(changed)}; {RERUN}"


@pytest.mark.parametrize("slots", [2, None])
def test_greedy_tokens_match_upstream(lm, golden, slots):
    """Mixed lengths, with and without prompt speech, in fewer slots than requests (slots=2) and
    all at once: each row's tokens are upstream's single-utterance greedy tokens."""
    cases = golden["lm_cases"]
    reqs = requests_of(golden)
    for req in reqs:  # the v3 LM ignores the speaker embedding, as upstream's does
        req.embedding = torch.randn(192)
    tokens = lm.generate(reqs, Sampling(greedy=True), slots=slots, check_every=3)
    for case, got in zip(cases, tokens, strict=True):
        assert got == case["tokens"], case["name"]
    assert len({len(c["tokens"]) for c in cases}) > 2  # the batch really is mixed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_tokens_match_upstream_on_cuda_with_graphs(v3_dir, golden):
    """The decode step captured in CUDA graphs (fp32, no TF32) keeps upstream's CPU tokens (the
    smallest top-2 log-prob gap along the recorded paths is 2.6e-4)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        lm = load_llm_v3(v3_dir, device="cuda")
        for _ in range(2):  # the second call replays the graphs the first one captured
            tokens = lm.generate(requests_of(golden), Sampling(greedy=True), slots=2, check_every=3)
            assert tokens == [c["tokens"] for c in golden["lm_cases"]]
        assert lm._pool.use_graphs, "CUDA graph capture failed and the pool fell back to eager steps"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def test_stop_rule_keeps_upstreams_early_stop(lm, golden):
    """Upstream masks id 6561 (v3's start id) before min_len but stops on any of 6561..6760, so a
    row can stop early; the fixture holds such rows and we stop there too."""
    assert (lm.stop_from, lm.emit_limit, lm.min_len_masked) == (6561, 6761, slice(6561, 6562))
    early = [c for c in golden["lm_cases"] if c["stop_token"] is not None and len(c["tokens"]) < c["min_len"]]
    assert early and all(c["stop_token"] > 6561 for c in early)


def test_finish_tokens_is_upstreams_silence_filter(lm, golden):
    for case in golden["silence_filter"]:
        assert frozenset(case["silent_tokens"]) == SILENT_TOKENS
        assert drop_long_silences(case["input"]) == case["output"]
        assert lm.finish_tokens(list(case["input"])) == case["output"]
    for case in golden["lm_cases"]:
        assert lm.finish_tokens(case["tokens"]) == case["finished"]


def test_endofprompt_is_required(lm, golden):
    reqs = requests_of(golden)
    assert golden["tokenizer"]["<|endofprompt|>"] == [ENDOFPROMPT_ID]
    bad = LMRequest(text=[39, 561, 78], prompt_text=[56, 268])
    with pytest.raises(MissingEndOfPrompt, match=r"<\|endofprompt\|> \(id 151646\).*request\(s\) 1 of 3"):
        lm.generate([reqs[0], bad, reqs[1]], Sampling(greedy=True))
    # It may sit in the text instead of the prompt text (the fixture's "in_text" case decodes).
    assert any(ENDOFPROMPT_ID in c["text"] and not c["prompt_text"] for c in golden["lm_cases"])


def test_our_tokenizer_gives_upstreams_ids_for_the_lm_prompts(v3_dir, golden):
    from cosybatch.cosyvoice.model import load_text_tokenizer, read_config

    tok = load_text_tokenizer(read_config(v3_dir))  # what the engine uses for a v3 folder
    for text in ("You are a helpful assistant.<|endofprompt|>", "Hello there [breath] world.", "<|endofprompt|>",
                 "[laughter]<|endofsystem|>[AA1][zh]"):
        assert tok.encode(text) == golden["tokenizer"][text], text


def test_v3_specials_get_upstreams_ids(golden):
    """Upstream adds V3_SPECIALS after Qwen2's 151,646 ids; the first two exist already."""
    ids = {token: 151646 + i for i, token in enumerate(V3_SPECIALS[2:])}
    assert ids["<|endofprompt|>"] == ENDOFPROMPT_ID
    recorded = golden["tokenizer"]["[laughter]<|endofsystem|>[AA1][zh]"]
    assert recorded == [ids["[laughter]"], ids["<|endofsystem|>"], ids["[AA1]"], ids["[zh]"]]
    assert max(ids.values()) < 151936  # within the real embedding


@pytest.fixture
def lm_only_dir(v3_dir, tmp_path) -> Path:
    """A copy of the folder's LM files only (yaml, BlankEN config), for breaking llm.pt."""
    (tmp_path / "CosyVoice-BlankEN").mkdir()
    shutil.copy(v3_dir / "CosyVoice-BlankEN" / "config.json", tmp_path / "CosyVoice-BlankEN")
    shutil.copy(v3_dir / "cosyvoice3.yaml", tmp_path)
    return tmp_path


def test_strict_loading_names_bad_keys(v3_dir, lm_only_dir):
    state = torch.load(v3_dir / "llm.pt", weights_only=True)
    state.pop("llm.model.model.norm.weight")
    state["llm_decoder.bias"] = torch.zeros(6761)  # v2's decoder has a bias; v3's has none
    state["llm_embedding.weight"] = torch.zeros(2, 32)  # v2's start/task rows
    state["speech_embedding.weight"] = state["speech_embedding.weight"][:6564]  # v2's size
    torch.save(state, lm_only_dir / "llm.pt")
    with pytest.raises(ModelDirError) as err:
        load_llm_v3(lm_only_dir)
    message = str(err.value)
    for part in ("missing: llm.model.model.norm.weight", "unexpected: llm_decoder.bias, llm_embedding.weight",
                 "wrong shape: speech_embedding.weight"):
        assert part in message


def test_yaml_errors_are_named(lm_only_dir):
    yaml = lm_only_dir / "cosyvoice3.yaml"
    text = yaml.read_text()
    yaml.write_text(text.replace("cosyvoice.llm.llm.CosyVoice3LM", "cosyvoice.llm.llm.Qwen2LM"))
    with pytest.raises(ModelDirError, match=r"expected CosyVoice3LM, found cosyvoice\.llm\.llm\.Qwen2LM"):
        load_llm_v3(lm_only_dir)
    yaml.write_text(text.replace("llm_input_size: 32", "llm_input_size: 48"))
    with pytest.raises(ModelDirError, match="hidden_size 32"):
        load_llm_v3(lm_only_dir)
    yaml.unlink()
    with pytest.raises(ModelDirError, match=r"no cosyvoice3\.yaml"):
        load_llm_v3(lm_only_dir)


def test_drop_long_silences_rules():
    assert drop_long_silences([1] * 8) == [1] * 5
    assert drop_long_silences([1, 2, 28, 29, 55, 248, 7, 494]) == [1, 2, 28, 29, 55, 7, 494]
    assert drop_long_silences([1] * 3, keep=0) == []
    assert drop_long_silences(torch.tensor([1, 1, 9])) == [1, 1, 9]
