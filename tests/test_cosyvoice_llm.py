"""CosyVoice2 LM: token-for-token parity with upstream, cached decode vs full forward, sampling."""

from __future__ import annotations

import json
import math

import pytest
import torch
import upstream

from cosybatch.cosyvoice.llm import LMRequest, Sampling, load_llm, sample
from cosybatch.cosyvoice.model import ModelDirError

GREEDY = Sampling(greedy=True)


def requests(seed: int = 3) -> list[LMRequest]:
    """Mixed prompt shapes: plain, zero-shot (prompt text + prompt speech), lengths far apart."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for text, prompt_text, prompt_speech in [(5, 0, 0), (3, 4, 7), (9, 2, 3), (2, 0, 0)]:
        out.append(
            LMRequest(
                text=torch.randint(0, 1000, (text,), generator=gen).tolist(),
                prompt_text=torch.randint(0, 1000, (prompt_text,), generator=gen).tolist(),
                prompt_speech=torch.randint(0, 6561, (prompt_speech,), generator=gen).tolist(),
                seed=int(torch.randint(0, 2**31, (1,), generator=gen)),
            )
        )
    return out


def copy(r: LMRequest, **changes) -> LMRequest:
    fields = dict(text=r.text, prompt_text=r.prompt_text, prompt_speech=r.prompt_speech, seed=r.seed)
    return LMRequest(**(fields | changes))


@pytest.fixture(scope="module")
def lm(cosyvoice_dir):
    model = load_llm(cosyvoice_dir)
    with torch.no_grad():
        # Random weights: keep greedy decoding off the control ids (a trained model emits them rarely;
        # upstream would loop on the step) so both sides run to their length limit.
        model.llm_decoder.bias[6561:] = -1e4
    return model


def test_greedy_batch_matches_upstream_token_for_token(lm, cosyvoice_dir):
    upstream.load()
    from cosyvoice.llm.llm import Qwen2Encoder, Qwen2LM

    def greedy(scores, decoded, sampling):
        return scores.argmax().reshape(1)

    ref = Qwen2LM(
        llm_input_size=64, llm_output_size=64, speech_token_size=6561, sampling=greedy,
        llm=Qwen2Encoder(str(cosyvoice_dir / "CosyVoice-BlankEN")), length_normalized_loss=True, lsm_weight=0,
        mix_ratio=[5, 15],
    ).eval()
    ref.load_state_dict(torch.load(cosyvoice_dir / "llm.pt", weights_only=True), strict=True)
    with torch.no_grad():
        ref.llm_decoder.bias[6561:] = -1e4
    reqs = requests()
    batch = lm.generate(reqs, GREEDY)

    def ids(values):
        return torch.tensor([list(values)], dtype=torch.int32).reshape(1, -1)

    for r, got in zip(reqs, batch, strict=True):
        want = list(ref.inference(
            text=ids(r.text), text_len=torch.tensor([len(r.text)]),
            prompt_text=ids(r.prompt_text), prompt_text_len=torch.tensor([len(r.prompt_text)]),
            prompt_speech_token=ids(r.prompt_speech), prompt_speech_token_len=torch.tensor([len(r.prompt_speech)]),
            embedding=torch.zeros(1, 192),
        ))
        assert len(got) == 20 * len(r.text), "no stop token: runs to upstream's max of 20x the text tokens"
        assert got == want


def test_cached_batched_decode_equals_full_forward(lm):
    """Each emitted token is the argmax of a full, uncached forward over everything before it."""
    reqs = [copy(r, max_tokens=12) for r in requests()]
    batch = lm.generate(reqs, GREEDY)
    with torch.inference_mode():
        for r, tokens in zip(reqs, batch, strict=True):
            prompt = lm.prompt_embeddings(r, torch.device("cpu"))
            seq = torch.cat([prompt, lm.speech_embedding(torch.tensor(tokens[:-1], dtype=torch.long))])
            logp = lm.forward_full(seq)[prompt.size(0) - 1 :]
            logp[:, 6561:] = -math.inf
            assert logp.argmax(-1).tolist() == tokens


def test_sampled_tokens_follow_the_item_not_the_batch(lm):
    reqs = requests()
    batch = lm.generate(reqs)
    assert all(len(t) == 20 * len(r.text) for r, t in zip(reqs, batch, strict=True))
    for i in (1, 3):
        alone = lm.generate([copy(reqs[i])])[0]
        assert alone == batch[i]
    reseeded = lm.generate([copy(reqs[1], seed=reqs[1].seed + 1)])[0]
    assert reseeded != batch[1]


def test_stop_token_and_length_limits(cosyvoice_dir):
    lm = load_llm(cosyvoice_dir)
    with torch.no_grad():
        lm.llm_decoder.bias[6561] = 1e4  # the stop token always wins once it is allowed
        lm.llm_decoder.bias[6562:] = -1e4
    reqs = requests()
    for tokens, r in zip(lm.generate(reqs), reqs, strict=True):
        assert len(tokens) == 2 * len(r.text), "stop refused before 2x the text tokens, taken right after"
        assert all(0 <= t < 6561 for t in tokens)
    capped = lm.generate([copy(reqs[0], min_tokens=0, max_tokens=0)])
    assert capped == [[]]


def test_ras_sampling_semantics():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logp = probs.log()
    s = Sampling(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
    none = torch.full((1, 10), -1)
    # Nucleus: ids 0, 1, 2 (cumulative before 0.5 and 0.7 < 0.8, then 0.85 stops it).
    picks = {int(sample(logp, none, torch.tensor([[u, 0.0]]), s)) for u in torch.linspace(0, 0.999, 200).tolist()}
    assert picks == {0, 1, 2}
    top2 = {
        int(sample(logp, none, torch.tensor([[u, 0.0]]), Sampling(top_k=2)))
        for u in torch.linspace(0, 0.999, 200).tolist()
    }
    assert top2 == {0, 1}
    # A nucleus pick already in the window falls back to the full distribution (second uniform).
    seen = torch.tensor([[0] + [-1] * 9])
    assert int(sample(logp, seen, torch.tensor([[0.0, 0.999]]), s)) == 4
    assert int(sample(logp, none, torch.tensor([[0.0, 0.999]]), s)) == 0


def test_model_dir_errors(cosyvoice_dir, tmp_path):
    (tmp_path / "CosyVoice-BlankEN").mkdir()
    with pytest.raises(ModelDirError, match=r"config\.json"):
        load_llm(tmp_path)
    config = json.loads((cosyvoice_dir / "CosyVoice-BlankEN" / "config.json").read_text())
    (tmp_path / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(ModelDirError, match="only qwen2"):
        load_llm(tmp_path)
    (tmp_path / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    (tmp_path / "llm.pt").symlink_to(cosyvoice_dir / "llm.pt")
    with pytest.raises(ModelDirError, match=r"missing: llm\.model\.model\.layers\.2"):
        load_llm(tmp_path)


def test_nothing_to_generate_gives_nothing_alone_or_in_a_batch(lm):
    reqs = requests()
    empty = copy(reqs[0], max_tokens=0)
    assert lm.generate([empty]) == [[]]
    mixed = lm.generate([empty, copy(reqs[3])])
    assert mixed[0] == [] and mixed[1] == lm.generate([copy(reqs[3])])[0]
