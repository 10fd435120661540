"""CosyVoice-300M LM and text tokenizer: parity with upstream's ``TransformerLM`` and whisper's tokenizer.

The oracle is upstream's own code: ``TransformerLM`` from the ``cosyvoice2-eu`` wheel (built from
the same yaml node, holding the same ``llm.pt``) and whisper's ``tokenizer.py`` run from the
installed openai-whisper package (loaded by file, so ``whisper/__init__`` and numba stay out).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch
import upstream

from cosybatch.cosyvoice.frontend.whisper import WhisperTextTokenizer, whisper_vocab_path
from cosybatch.cosyvoice.lm.slots import LMRequest, Sampling
from cosybatch.cosyvoice.lm.v1 import build_llm_v1, load_llm_v1
from cosybatch.cosyvoice.weights import ModelDirError
from cosybatch.cosyvoice.yamlconf import load_yaml

torch.set_num_threads(1)
GREEDY = Sampling(greedy=True)
EOS = 4096

# The llm node of upstream's cosyvoice.yaml (examples/libritts/cosyvoice/conf), sizes shrunk.
YAML = """\
sample_rate: 22050
text_encoder_input_size: 16
llm_input_size: 32
llm_output_size: 32
spk_embed_dim: 192

llm: !new:cosyvoice.llm.llm.TransformerLM
    text_encoder_input_size: !ref <text_encoder_input_size>
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    text_token_size: 51866
    speech_token_size: 4096
    length_normalized_loss: True
    lsm_weight: 0
    spk_embed_dim: !ref <spk_embed_dim>
    text_encoder: !new:cosyvoice.transformer.encoder.ConformerEncoder
        input_size: !ref <text_encoder_input_size>
        output_size: 32
        attention_heads: 2
        linear_units: 48
        num_blocks: 2
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.0
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        use_cnn_module: False
        macaron_style: False
        use_dynamic_chunk: False
        use_dynamic_left_chunk: False
        static_chunk_size: 1
    llm: !new:cosyvoice.transformer.encoder.TransformerEncoder
        input_size: !ref <llm_input_size>
        output_size: !ref <llm_output_size>
        attention_heads: 4
        linear_units: 48
        num_blocks: 2
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.0
        input_layer: 'linear_legacy'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        static_chunk_size: 1
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1
"""


def argmax_sampling(min_len: int = 0):
    """Upstream's sampling hook, greedy; refuses the stop id before ``min_len`` tokens (what HEAD's
    mask does; the wheel would resample the same argmax until it gives up)."""

    def pick(scores, decoded, top_k):
        if len(decoded) < min_len:
            scores = scores.clone()
            scores[EOS] = -math.inf
        return scores.argmax().reshape(1)

    return pick


@pytest.fixture(scope="module")
def v1_dir(tmp_path_factory):
    """A tiny CosyVoice-300M LM folder: cosyvoice.yaml and llm.pt with random weights (every
    parameter drawn, the positional biases and LayerNorms included). Small biases elsewhere keep
    greedy decoding off a one-token loop, so rows differ."""
    folder = tmp_path_factory.mktemp("v1") / "CosyVoice-300M-tiny"
    folder.mkdir()
    (folder / "cosyvoice.yaml").write_text(YAML)
    lm = build_llm_v1(load_yaml(folder / "cosyvoice.yaml")["llm"])
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            scale = (0.5 if "pos_bias" in name else 0.02) if p.dim() < 2 else 1.0 / math.sqrt(p.size(-1))
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * scale + centre)
    torch.save(lm.state_dict(), folder / "llm.pt")
    return folder


def upstream_lm(folder, sampling):
    ref = upstream.lm_v1_model(load_yaml(folder / "cosyvoice.yaml")["llm"], sampling)
    ref.load_state_dict(torch.load(folder / "llm.pt", weights_only=True), strict=True)
    return ref


def keep_running(*models):
    """Random weights: keep greedy decoding off the stop id so rows run to their length limit (the
    wheel would retry a stop before min_len until it raises)."""
    with torch.no_grad():
        for m in models:
            m.llm_decoder.bias[EOS] = -1e4


def requests() -> list[LMRequest]:
    """Text lengths 1..6, with and without prompt text, prompt speech and speaker embedding."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(3, 0, 0, True), (1, 2, 5, True), (6, 3, 0, False), (2, 0, 4, False), (5, 1, 9, True),
              (4, 0, 0, True), (2, 4, 2, True)]
    out = []
    for k, (text, prompt_text, prompt_speech, spk) in enumerate(shapes):
        out.append(LMRequest(
            text=torch.randint(0, 51866, (text,), generator=gen).tolist(),
            prompt_text=torch.randint(0, 51866, (prompt_text,), generator=gen).tolist(),
            prompt_speech=torch.randint(0, 4096, (prompt_speech,), generator=gen).tolist(),
            embedding=torch.randn(192, generator=gen) * 3 if spk else None,
            seed=k,
        ))
    return out


# -- the LM -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_full_sequence_log_probs_equal_upstream_forward(v1_dir):
    """Upstream's training forward (speaker, text, speech tokens, causal) vs ours over the same
    sequence: the state dict loads strictly into both and every position's log-probs agree."""
    ours = load_llm_v1(v1_dir)
    ref = upstream_lm(v1_dir, argmax_sampling())
    captured = []
    ref.llm_decoder.register_forward_hook(lambda m, args, out: captured.append(out))
    req = requests()[4]
    text = [*req.prompt_text, *req.text]
    speech = [*req.prompt_speech, 17, 4095, 0, 77]
    batch = {
        "text_token": torch.tensor([text]), "text_token_len": torch.tensor([len(text)]),
        "speech_token": torch.tensor([speech]), "speech_token_len": torch.tensor([len(speech)]),
        "embedding": req.embedding[None],
    }
    with torch.no_grad():
        ref(batch, torch.device("cpu"))
        want = captured[0][0].log_softmax(-1)
        seq = ours.prompt_embeddings(LMRequest(text=text, prompt_speech=speech, embedding=req.embedding),
                                     torch.device("cpu"))
        got = ours.forward_full(seq)
    assert got.shape == want.shape == (1 + 1 + len(text) + 1 + len(speech), 4097)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The speaker slot matters: a zero vector is not "no embedding", and neither matches.
    alone = ours.forward_full(ours.prompt_embeddings(LMRequest(text=text, prompt_speech=speech), torch.device("cpu")))
    assert alone.shape[0] == got.shape[0] - 1
    assert not torch.allclose(alone[-1], got[-1], atol=1e-3)


@pytest.mark.slow
def test_slot_pool_greedy_matches_upstream_inference_while_slots_refill(v1_dir):
    """Seven requests in three slots: rows are admitted as others stop, prompts of different
    lengths are prefilled together, and every row equals upstream's one-at-a-time cached decode
    (its forward_chunk with rel_shift) token for token, up to 20x its text tokens."""
    ours = load_llm_v1(v1_dir)
    ref = upstream_lm(v1_dir, argmax_sampling())
    keep_running(ours, ref)
    reqs = requests()
    got = ours.generate(reqs, GREEDY, slots=3)
    assert ours.last_stats.prefills > 1, "rows were admitted while others decoded"
    assert ours.last_stats.host_syncs < sum(len(t) for t in got) // 4, "no per-step host reads"
    for r, tokens in zip(reqs, got, strict=True):
        assert len(tokens) == 20 * len(r.text)
        assert tokens == upstream.lm_v1_inference(ref, r)
    assert len({tuple(t[:20]) for t in got}) == len(got), "rows differ (the test would catch a mix-up)"


@pytest.mark.slow
def test_stop_rule_and_length_limits_match_upstream(v1_dir):
    """A stop id that always wins once allowed: upstream stops right at 2x the text tokens (the
    count of ``text``, not of the prompt text), and so do we; max_tokens caps a row."""
    ours = load_llm_v1(v1_dir)
    with torch.no_grad():
        ours.llm_decoder.bias[EOS] = 1e4
    reqs = requests()[:4]
    got = ours.generate(reqs, GREEDY, slots=2)
    for r, tokens in zip(reqs, got, strict=True):
        assert len(tokens) == 2 * len(r.text)
        assert all(0 <= t < EOS for t in tokens)
        ref_lm = upstream_lm(v1_dir, argmax_sampling(min_len=2 * len(r.text)))
        with torch.no_grad():
            ref_lm.llm_decoder.bias[EOS] = 1e4
        assert tokens == upstream.lm_v1_inference(ref_lm, r)
    capped = ours.generate([dataclasses.replace(reqs[2], max_tokens=3, min_tokens=3)], GREEDY)
    assert capped == [got[2][:3]]


def test_sampled_rows_follow_their_seed_not_the_batch(v1_dir):
    ours = load_llm_v1(v1_dir)
    keep_running(ours)
    reqs = requests()
    batch = ours.generate(reqs, slots=4)
    alone = ours.generate([requests()[2]])[0]
    assert alone == batch[2]
    assert all(0 <= t < EOS for row in batch for t in row)


def test_tables_follow_weights_dtype_and_length(v1_dir):
    """The projected distance tables are rebuilt when weights, dtype or the needed length change."""
    ours = load_llm_v1(v1_dir)
    seq = ours.prompt_embeddings(requests()[1], torch.device("cpu"))
    before = ours.forward_full(seq)
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    state["llm.encoders.0.self_attn.linear_pos.weight"] *= 3
    ours.load_state_dict(state)
    changed = ours.forward_full(seq)
    fresh = load_llm_v1(v1_dir)
    fresh.load_state_dict(state)
    torch.testing.assert_close(changed, fresh.forward_full(seq))
    assert not torch.allclose(before, changed)
    longer = torch.cat([seq, seq, seq])  # beyond the tables built so far
    ours.double()
    assert ours.forward_full(longer.double()).dtype == torch.float64


# -- loading ----------------------------------------------------------------------------------


def test_strict_loading_names_the_bad_keys(v1_dir, tmp_path):
    (tmp_path / "cosyvoice.yaml").write_text(YAML)
    state = torch.load(v1_dir / "llm.pt", weights_only=True)
    del state["llm.encoders.1.self_attn.pos_bias_v"]
    state["llm.encoders.2.norm1.weight"] = torch.ones(32)
    state["spk_embed_affine_layer.weight"] = torch.zeros(32, 80)
    torch.save(state, tmp_path / "llm.pt")
    with pytest.raises(ModelDirError) as err:
        load_llm_v1(tmp_path)
    message = str(err.value)
    for part in ("missing: llm.encoders.1.self_attn.pos_bias_v", "unexpected: llm.encoders.2.norm1.weight",
                 "wrong shape: spk_embed_affine_layer.weight"):
        assert part in message


def test_yaml_errors_are_named(tmp_path):
    with pytest.raises(ModelDirError, match=r"no cosyvoice\.yaml"):
        load_llm_v1(tmp_path)
    for old, new, says in [
        ("pos_enc_layer_type: 'rel_pos_espnet'\n        selfattention_layer_type: 'rel_selfattn'\n        use_cnn",
         "pos_enc_layer_type: 'rel_pos'\n        selfattention_layer_type: 'rel_selfattn'\n        use_cnn",
         "text_encoder.pos_enc_layer_type: 'rel_pos'"),
        ("input_layer: 'linear_legacy'", "input_layer: 'conv2d'", "llm.llm.input_layer: 'conv2d'"),
        ("TransformerLM", "Qwen2LM", "expected TransformerLM"),
        ("        macaron_style: False\n", "", "macaron_style: True"),
    ]:
        assert old in YAML
        (tmp_path / "cosyvoice.yaml").write_text(YAML.replace(old, new, 1))
        with pytest.raises(ModelDirError, match=says.replace(".", r"\.")):
            load_llm_v1(tmp_path)


# -- the text tokenizer -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def whisper_tokenizer():
    """whisper's own get_tokenizer, as CosyVoice-300M's yaml calls it (whisper/tokenizer.py run
    from the installed package; it imports only tiktoken)."""
    path = whisper_vocab_path().parent.parent / "tokenizer.py"
    spec = importlib.util.spec_from_file_location("_whisper_tokenizer_oracle", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_tokenizer(multilingual=True, num_languages=100, language="en", task="transcribe")


SENTENCES = [
    "Hello world, this is a test.",
    "The kettle is boiling; it's 3:45 pm and we've 2 cups left!",
    "<|en|>Rain is expected this afternoon.<|endoftext|>",
    "  Spaces   and\ttabs\nnewlines  ",
    "Ünïcödé façade — naïve café, 你好，世界。",
    "<|zh|>希望你以后能够做的比我还好呦。",
    "I'll <|0.00|> say <|30.00|> <endofprompt>",
]


def test_tokenizer_ids_equal_whispers(whisper_tokenizer):
    ours = WhisperTextTokenizer()
    ref = whisper_tokenizer
    assert ours.vocab_size == ref.encoding.n_vocab == 51866
    for text in SENTENCES:
        assert ours.encode(text) == ref.encode(text, allowed_special="all"), text
    assert ours.encode_batch(SENTENCES[:3]) == [ref.encode(t, allowed_special="all") for t in SENTENCES[:3]]
    # Every special token sits where whisper puts it.
    for token, index in ref.encoding._special_tokens.items():
        assert ours.token_to_id(token) == index, token
    assert (ours.eot, ours.timestamp_begin) == (ref.eot, ref.timestamp_begin)
    sot = [ours.token_to_id(t) for t in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>")]
    assert sot == list(ref.sot_sequence)
    ids = ours.encode(SENTENCES[2] + " <|1.00|>")
    assert ours.decode(ids) == ref.decode(ids)


def test_tokenizer_known_ids():
    """Ids checked once against whisper's tokenizer, pinned here."""
    tok = WhisperTextTokenizer()
    assert tok.encode("Hello world, this is a test. <|en|>") == [15947, 1002, 11, 341, 307, 257, 1500, 13, 220, 50259]
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|startoftranscript|>", "<|yue|>", "<|notimestamps|>",
                                         "<|0.00|>", "<|30.00|>")] == [50257, 50258, 50358, 50364, 50365, 51865]
    assert tok.token_to_id("<|xx|>") is None
