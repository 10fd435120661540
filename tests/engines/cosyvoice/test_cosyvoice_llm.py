"""CosyVoice2 LM: token-for-token parity with upstream, cached decode vs full forward, sampling."""

from __future__ import annotations

import json
import math

import pytest
import torch
import upstream

from cosybatch.cosyvoice.lm.slots import LMRequest, Sampling, sample
from cosybatch.cosyvoice.lm.v2 import load_llm
from cosybatch.cosyvoice.weights import ModelDirError

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


@pytest.mark.slow
def test_greedy_batch_matches_upstream_token_for_token(lm, cosyvoice_dir):
    reference = upstream_greedy(cosyvoice_dir)
    reqs = requests()
    for r, got in zip(reqs, lm.generate(reqs, GREEDY), strict=True):
        assert len(got) == 20 * len(r.text), "no stop token: runs to upstream's max of 20x the text tokens"
        assert got == reference(r)


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


# -- the slot pool: continuous batching with a static decode step ------------------------------


def mixed(n: int, seed: int = 11) -> list[LMRequest]:
    """Rows whose lengths (20x their text tokens, the stop token kept off) differ up to 20x."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 12, 3, 20, 2, 7, 5, 15, 1, 9, 4, 18, 6, 2, 11, 3][:n]
    return [LMRequest(text=torch.randint(0, 1000, (t,), generator=gen).tolist(),
                      prompt_text=torch.randint(0, 1000, (k % 3,), generator=gen).tolist(),
                      prompt_speech=torch.randint(0, 6561, (2 * (k % 4),), generator=gen).tolist(),
                      seed=1000 + k) for k, t in enumerate(lengths)]


def upstream_greedy(cosyvoice_dir):
    upstream.load()
    from cosyvoice.llm.llm import Qwen2Encoder, Qwen2LM

    ref = Qwen2LM(
        llm_input_size=64, llm_output_size=64, speech_token_size=6561,
        sampling=lambda scores, decoded, sampling: scores.argmax().reshape(1),
        llm=Qwen2Encoder(str(cosyvoice_dir / "CosyVoice-BlankEN")), length_normalized_loss=True, lsm_weight=0,
        mix_ratio=[5, 15],
    ).eval()
    ref.load_state_dict(torch.load(cosyvoice_dir / "llm.pt", weights_only=True), strict=True)
    with torch.no_grad():
        ref.llm_decoder.bias[6561:] = -1e4

    def run(r: LMRequest) -> list[int]:
        def ids(values):
            return torch.tensor([list(values)], dtype=torch.int32).reshape(1, -1)

        return list(ref.inference(
            text=ids(r.text), text_len=torch.tensor([len(r.text)]),
            prompt_text=ids(r.prompt_text), prompt_text_len=torch.tensor([len(r.prompt_text)]),
            prompt_speech_token=ids(r.prompt_speech), prompt_speech_token_len=torch.tensor([len(r.prompt_speech)]),
            embedding=torch.zeros(1, 192)))

    return run


@pytest.mark.slow
def test_slot_pool_greedy_matches_upstream_while_rows_come_and_go(lm, cosyvoice_dir):
    """Three slots for eight rows of 20 to 400 tokens: rows are admitted as others stop, the pool
    shrinks at the end, and every row is token-identical to upstream's single-row decode."""
    reqs = mixed(8)
    got = lm.generate(reqs, GREEDY, slots=3)
    stats = lm.last_stats
    assert stats.prefills > 1, "rows were admitted while others decoded"
    reference = upstream_greedy(cosyvoice_dir)
    for r, tokens in zip(reqs, got, strict=True):
        assert len(tokens) == 20 * len(r.text)
        assert tokens == reference(r)


def test_sampled_tokens_do_not_depend_on_pool_size_neighbours_or_admission_order(lm):
    reqs = mixed(6)
    want = lm.generate([copy(r) for r in reqs], slots=6)
    assert len({tuple(t) for t in want}) == 6
    for slots in (1, 2, 4):
        assert lm.generate([copy(r) for r in reqs], slots=slots) == want
    # Other rows around them, and the list in another order (so another admission order).
    others = [copy(r, seed=r.seed + 77) for r in mixed(5, seed=99)]
    shuffled = [copy(r) for r in reversed(reqs)] + others
    got = lm.generate(shuffled, slots=3)
    assert got[: len(reqs)] == list(reversed(want))


def test_stop_tokens_end_rows_at_their_own_lengths(cosyvoice_dir):
    lm = load_llm(cosyvoice_dir)
    with torch.no_grad():
        lm.llm_decoder.bias[6561] = 1e4  # the stop token wins as soon as it is allowed (2x the text)
        lm.llm_decoder.bias[6562:] = -1e4
    reqs = mixed(7)
    got = lm.generate(reqs, slots=2, check_every=4)
    assert [len(t) for t in got] == [2 * len(r.text) for r in reqs]
    assert all(0 <= t < 6561 for tokens in got for t in tokens)


def test_slot_pool_stays_full_and_reads_the_device_once_per_check(lm):
    reqs = mixed(16)
    lm.generate(reqs, GREEDY, slots=4)
    stats = lm.last_stats
    assert stats.live_slot_steps == sum(20 * len(r.text) for r in reqs)
    assert stats.live_fraction >= 0.9, stats.as_dict()
    # One read per round of check_every steps (a round is shorter only when every row ends sooner).
    assert stats.host_syncs <= stats.steps // 8 + 8, stats.as_dict()


def _on_meta(pool):
    """The pool's state moved to the meta device, where any read of a value on the host fails."""
    for name in ("k", "v"):
        setattr(pool, name, [t.to("meta") for t in getattr(pool, name)])
    for name in ("hidden", "pos", "count", "lo", "hi", "done", "history", "uniforms", "recent", "recent_live",
                 "positions"):
        setattr(pool, name, getattr(pool, name).to("meta"))


def test_decode_step_never_reads_a_value_back_to_the_host(cosyvoice_dir):
    from cosybatch.cosyvoice.lm.slots import SlotPool

    lm = load_llm(cosyvoice_dir)
    with torch.inference_mode():
        pool = SlotPool(lm, 4, 256, 256, Sampling())
        lm.to("meta")
        _on_meta(pool)
        for _ in range(3):
            pool._step(4, 256)  # tolist, item, nonzero or a branch on a tensor would raise here
        with pytest.raises(NotImplementedError):
            pool.done.tolist()


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, weights=()):
        super().__init__()
        self.ops: list[str] = []
        self.weight_casts = 0
        self._weights = {w.data_ptr() for w in weights}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:  # kernels; views cost no launch (and a full-size slice is skipped)
            self.ops.append(str(func.overloadpacket))
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.to) and args and \
                isinstance(args[0], torch.Tensor) and args[0].data_ptr() in self._weights:
            self.weight_casts += 1
        return func(*args, **(kwargs or {}))


def _step_ops(lm, n: int, weights=()) -> _OpLog:
    from cosybatch.cosyvoice.lm.slots import SlotPool

    with torch.inference_mode():
        pool = SlotPool(lm, 8, 256, 256, Sampling())
        pool._step(n, 256)  # warm (lazy initialisation is not part of a step)
        log = _OpLog(weights)
        with log:
            pool._step(n, 256)
    return log


def test_decode_step_runs_the_same_kernels_for_every_slot_count(lm):
    counts = {n: _step_ops(lm, n).ops for n in (1, 2, 4, 8)}
    assert counts[1] == counts[2] == counts[4] == counts[8]


def test_half_precision_weights_are_never_cast_inside_the_loop(cosyvoice_dir):
    fp32 = load_llm(cosyvoice_dir)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the old way: the detector must see casts here
        assert _step_ops(fp32, 4, fp32.parameters()).weight_casts > 0
    bf16 = load_llm(cosyvoice_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.qwen.inv_freq.dtype == torch.float32
    log = _step_ops(bf16, 4, bf16.parameters())
    assert log.weight_casts == 0
    with torch.no_grad():
        bf16.llm_decoder.bias[6561:] = -1e4  # no stop id: every row decodes its 10 tokens
    tokens = bf16.generate([copy(r, max_tokens=10) for r in requests()], GREEDY, slots=2)
    assert all(len(t) == 10 and all(0 <= x < 6561 for x in t) for t in tokens)


def test_sampling_settings_come_from_the_yaml():
    from cosybatch.cosyvoice.yamlconf import Call

    node = Call("cosyvoice.llm.llm.Qwen2LM", kwargs={
        "sampling": Call("cosyvoice.utils.common.ras_sampling", kwargs={"top_p": 0.5, "top_k": 7})})
    assert Sampling.from_yaml(node) == Sampling(top_p=0.5, top_k=7, win_size=10, tau_r=0.1)
    assert Sampling.from_yaml(None) == Sampling()
    other = Call("x", kwargs={"sampling": Call("cosyvoice.utils.common.nucleus_sampling", kwargs={})})
    with pytest.raises(ValueError, match="only ras_sampling"):
        Sampling.from_yaml(other)
    bad = Call("x", kwargs={"sampling": Call("a.ras_sampling", kwargs={"top_p": 2})})
    with pytest.raises(ValueError, match="top_p"):
        Sampling.from_yaml(bad)


def test_a_call_that_failed_half_way_leaves_nothing_behind_in_the_pool(cosyvoice_dir):
    """An error mid-decode (out of memory, say) must not leak its rows into the next call, which
    reuses the same pool."""
    lm = load_llm(cosyvoice_dir)
    with torch.no_grad():
        lm.llm_decoder.bias[6561:] = -1e4
    reqs = mixed(5)
    want = lm.generate([copy(r) for r in reqs], slots=3)
    pool = lm._pool
    real_harvest, calls = pool._harvest, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA out of memory (injected)")
        return real_harvest(*args)

    pool._harvest = failing
    with pytest.raises(RuntimeError, match="injected"):
        lm.generate([copy(r) for r in reqs], slots=3)
    pool._harvest = real_harvest
    assert lm.generate([copy(r) for r in reqs], slots=3) == want
    assert lm._pool is pool, "the pool (and its CUDA graphs) is reused"


def test_threads_sharing_one_model_take_turns_with_the_pool(lm):
    """Engine workers call synthesize from several threads on one model: decodes must not share
    slots (they once came back silently truncated)."""
    import threading

    reqs = mixed(6)
    want = lm.generate([copy(r) for r in reqs], GREEDY, slots=4)
    results: dict[int, list] = {}

    def work(k: int) -> None:
        results[k] = lm.decode([copy(r) for r in reqs], GREEDY, slots=4)[0]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: want, 1: want, 2: want}


def test_nan_logits_stop_the_row_instead_of_emitting_a_control_id(cosyvoice_dir):
    lm = load_llm(cosyvoice_dir)
    with torch.no_grad():
        lm.llm_decoder.bias[:] = float("nan")  # as an fp16 overflow would leave them
    got = lm.generate(requests(), slots=2)
    assert got == [[], [], [], []]
