"""The GPU paths' structure, checked on CPU (issue 25): the capture gate, counted CUDA-graph
captures and failures, staged host->device copies, the LM inside the out-of-memory split, the
stage streams' CPU path. A GPU run checks the rest (benchmarks/gpu_throughput.py)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from cosybatch import gpu
from cosybatch.cosyvoice.lm import slots as slots_module
from cosybatch.cosyvoice.lm.slots import LMRequest, PoolStats, Sampling
from cosybatch.cosyvoice.lm.v2 import load_llm

GREEDY = Sampling(greedy=True)


@pytest.fixture(scope="module")
def lm(cosyvoice_dir):
    model = load_llm(cosyvoice_dir)
    with torch.no_grad():
        model.llm_decoder.bias[6561:] = -1e4
    return model


def requests() -> list[LMRequest]:
    return [LMRequest(text=list(range(10, 10 + n)), prompt_speech=[1, 2, 3][: n % 3], seed=n) for n in (2, 5, 3, 4, 2)]


def test_capture_waits_for_other_work_and_holds_new_work_back():
    gate = gpu.CaptureGate()
    order: list[str] = []
    started = threading.Event()

    def worker():
        with gate.work():
            started.set()
            time.sleep(0.2)
            order.append("work ends")

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    with gate.capture():
        order.append("capture")
        assert gate.capturing
        late = threading.Thread(target=lambda: (gate.work().__enter__(), order.append("late work")))
        late.start()
        time.sleep(0.1)
        order.append("capture ends")
    late.join()
    thread.join()
    assert order == ["work ends", "capture", "capture ends", "late work"]
    assert gate.captures == 1 and not gate.capturing


def test_a_failed_capture_is_counted_warned_and_the_step_runs_eagerly(lm, monkeypatch, caplog):
    pool = lm.slot_pool(2, 64, 64, GREEDY, cuda_graphs=False)
    before = gpu.CAPTURE_GATE.captures
    seen = {}

    class FailingGraph:
        def capture_begin(self, **kwargs):
            seen["gate held"] = gpu.CAPTURE_GATE.capturing
            raise RuntimeError("operation not permitted when stream is capturing (injected)")

        def capture_end(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FailingGraph)
    pool.use_graphs, pool.stats = True, PoolStats()
    with caplog.at_level(logging.WARNING):
        assert pool._capture(2, 64) is None
    assert seen == {"gate held": True} and gpu.CAPTURE_GATE.captures == before + 1
    assert (pool.stats.capture_failures, pool.stats.eager_steps, pool.capture_failures) == (1, 1, 1)
    assert not pool.use_graphs and "capture of the decode step (2 slots, 64 positions) failed" in caplog.text
    lm._pool = None  # the fake left this pool in a state no later test should inherit


def test_cpu_steps_are_counted_eager_and_host_values_go_through_staging(lm, monkeypatch):
    reference, _ = lm.decode(requests(), GREEDY, slots=2, cuda_graphs=False)
    calls: list[tuple] = []
    real = slots_module.staged

    def spy(values, dtype, device):
        calls.append((dtype, device.type))
        return real(values, dtype, device)

    monkeypatch.setattr(slots_module, "staged", spy)
    lm._pool = None
    tokens, stats = lm.decode(requests(), GREEDY, slots=2, cuda_graphs=True)  # graphs: CUDA only
    assert tokens == reference
    assert stats.steps > 0 and stats.eager_steps == stats.steps
    assert stats.graphs == stats.graph_replays == stats.capture_failures == 0
    # admission (rows, uniforms), prefill (slots, lengths) and the pool's compaction all stage
    assert (torch.long, "cpu") in calls and (torch.float64, "cpu") in calls and len(calls) >= 4
    totals = PoolStats().add(stats).add(stats)
    assert totals.steps == 2 * stats.steps and totals.as_dict()["eager_steps"] == 2 * stats.eager_steps


def test_staged_keeps_values_and_dtype_on_cpu():
    out = slots_module.staged([[1, 2], [3, 4]], torch.long, torch.device("cpu"))
    assert out.dtype == torch.long and out.tolist() == [[1, 2], [3, 4]]
    host = torch.arange(4, dtype=torch.float64)
    assert slots_module.staged(host, torch.float64, torch.device("cpu")) is host


def test_the_lm_decodes_inside_the_out_of_memory_split(cosyvoice_dir, monkeypatch):
    from cosybatch.cosyvoice.pipeline import Pipeline, Segment, Token2Wav

    model = load_llm(cosyvoice_dir)
    with torch.no_grad():
        model.llm_decoder.bias[6561:] = -1e4
    pipeline = Pipeline(model, GREEDY, Token2Wav(cosyvoice_dir), lm_slots=4, flow_batch=1, hift_batch=1,
                        segment_tokens=40)
    assert pipeline.streams.enabled is False  # CPU: both stages run in place

    class Voice:
        prompt_tokens = None
        embedding = torch.zeros(192)

    segs = [Segment((5, 6, 7), Voice(), (), 1), Segment((8, 9), Voice(), (), 2), Segment((3, 4, 5, 6), Voice(), (), 3)]
    whole, _, whole_info = pipeline.decode(segs)
    real = model.decode
    sizes = []

    def flaky(reqs, *args, **kwargs):
        sizes.append(len(reqs))
        if len(reqs) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return real(reqs, *args, **kwargs)

    monkeypatch.setattr(model, "decode", flaky)
    split, split_stats, split_info = pipeline.decode(segs)
    assert split == whole and sizes == [3, 1, 2, 1, 1]
    assert split_info == whole_info  # each row's stop reason survives the split
    assert split_stats.steps > 0 and split_stats.prefills == 3


class _FakeStream:
    def wait_stream(self, other):
        pass


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: "capture" runs the step, then puts every pool
    tensor back as it was (a real capture records without running); replay runs the step."""

    pool = None

    def capture_begin(self, **kwargs):
        self.saved = [t.clone() for t in self.pool._rows()]
        self.key = None

    def capture_end(self):
        for tensor, saved in zip(self.pool._rows(), self.saved, strict=True):
            tensor.copy_(saved)

    def replay(self):
        self.pool._step(*self.key)


def test_graph_path_counts_captures_replays_and_eager_warm_ups(lm, monkeypatch):
    """The CUDA-graph path of the pool, run on CPU with stand-ins for the CUDA calls: same tokens as
    eager decoding, and the counts say what ran (no "graphs: true" row that was eager)."""
    import contextlib

    reference, eager = lm.decode(requests(), GREEDY, slots=4, cuda_graphs=False)
    lm._pool = None
    pool = lm.slot_pool(4, 256, 256, GREEDY, cuda_graphs=True)
    pool.use_graphs, pool._stream = True, _FakeStream()
    _FakeGraph.pool = pool
    real_step = pool._step

    def step(n, window):
        graph = getattr(pool, "_capturing", None)
        if graph is not None:
            graph.key = (n, window)
        real_step(n, window)

    real_capture = pool._capture

    def capture(n, window):
        graph_cls = torch.cuda.CUDAGraph
        made = []

        class Recording(graph_cls):
            def capture_begin(self, **kwargs):
                made.append(self)
                pool._capturing = self
                super().capture_begin(**kwargs)

            def capture_end(self):
                pool._capturing = None
                super().capture_end()

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Recording)
        try:
            return real_capture(n, window)
        finally:
            monkeypatch.setattr(torch.cuda, "CUDAGraph", graph_cls)

    monkeypatch.setattr(pool, "_step", step)
    monkeypatch.setattr(pool, "_capture", capture)
    monkeypatch.setattr(pool, "fits", lambda *args: True)  # it would refuse graphs on a CPU device
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    ahead = pool.capture_ahead([(4, 256)])
    assert (ahead.graphs, ahead.eager_steps, ahead.graph_replays) == (1, 1, 1)
    tokens, stats = lm.decode(requests(), GREEDY, slots=4, cuda_graphs=True)
    assert lm._pool is pool and tokens == reference
    keys = len(pool.graphs)
    assert stats.graphs == keys - 1 and stats.capture_failures == 0  # (4, 256) was captured ahead
    # each new shape: one eager warm-up, then captured; every other step a replay
    assert stats.eager_steps == stats.graphs and stats.graph_replays == stats.steps - stats.eager_steps
    assert stats.steps == eager.steps and stats.graph_replays > stats.eager_steps
    lm._pool = None
