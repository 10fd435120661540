"""Out of memory never ends a job: batches split and retry, the budget shrinks, a unit too big
even alone fails its row. The engine is the tone plugin (costs are characters); only the OOM is
injected."""

from __future__ import annotations

import json
import weakref

import numpy as np
import torch
from helpers import read_output, write_parquet

from cosybatch.engines import Synthesised
from cosybatch.plan import Batch, BudgetGuard, Unit, plan_batches
from cosybatch.run.executor import run_batch
from cosybatch.run.local import run

SENTENCES = ["The kettle is boiling.", "Close the window, please.", "Rain is expected today.",
             "The library opens at nine.", "Bring a warm coat.", "The train leaves soon."]


def run_with_oom(tmp_path, monkeypatch, tone, name: str) -> tuple[list[tuple[int, int]], dict, list[dict]]:
    """Run 96 short rows and one giant one with batches of up to 16, on an "accelerator" whose
    memory holds 200 padded characters; returns the synthesize calls, stats and failures."""
    from cosybatch_tone import ToneEngine

    rows = [{"id": f"r{i:03d}", "text": SENTENCES[i % len(SENTENCES)]} for i in range(96)]
    giant = "A sentence that never fits " + "and goes on " * 60 + "without a stop"
    rows.append({"id": "giant", "text": giant})
    corpus = write_parquet(tmp_path / f"{name}.parquet", rows)
    real = ToneEngine.synthesize
    calls: list[tuple[int, int]] = []
    memory = 200

    def flaky(self, units):
        padded = len(units) * max(u.cost for u in units)
        calls.append((len(units), padded))
        if padded > memory:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {padded} MiB")
        return real(self, units)

    monkeypatch.setattr(ToneEngine, "synthesize", flaky)
    out = tmp_path / name
    # window=16: the planner cuts later windows after earlier batches have run (and shrunk the budget).
    result = run(tone(corpus, out, batch_size=16, batch_budget=100_000, workers=1, window=16,
                      engine_options={"max_chars": 10_000}))
    assert result.exit_code == 0
    items = read_output(out)
    assert sorted(items) == sorted(r["id"] for r in rows if r["id"] != "giant")
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    return calls, json.loads((out / "stats.json").read_text()), failures


def test_oom_splits_batches_shrinks_the_budget_and_fails_only_the_giant(tmp_path, monkeypatch, tone):
    calls, stats, failures = run_with_oom(tmp_path, monkeypatch, tone, "guarded")
    assert [f["id"] for f in failures] == ["giant"]
    assert "out of memory even alone" in failures[0]["reason"]
    assert stats["items_done"] == 96 and stats["items_failed"] == 1
    assert stats["oom_retries"] > 0
    assert stats["budget_changes"] and all(c["new_budget"] < c["old_budget"] for c in stats["budget_changes"])
    ooms = sum(padded > 200 for _, padded in calls)

    # The same job with a budget that never shrinks runs out of memory more often.
    monkeypatch.setattr(BudgetGuard, "shrink", lambda self, batch: self.budget)
    calls_fixed, stats_fixed, _ = run_with_oom(tmp_path, monkeypatch, tone, "fixed")
    assert stats_fixed["budget_changes"] == []
    assert sum(padded > 200 for _, padded in calls_fixed) > ooms


def test_budget_guard_lowers_only_the_failing_length_range():
    guard = BudgetGuard(1000)
    long_batch = Batch(0, tuple(Unit(i, 0, 100, "") for i in range(8)))
    assert guard.shrink(long_batch) == 400  # half of the 800 that failed
    assert guard(100) == 400 and guard(127) == 400  # same power-of-two range
    assert guard(20) == 1000  # short units keep the full budget
    assert guard.shrink(Batch(1, (Unit(0, 0, 100, ""),))) == 100  # never below one unit
    assert len(guard.changes) == 2
    units = [Unit(i, 0, 100, "") for i in range(8)] + [Unit(100 + i, 0, 20, "") for i in range(8)]
    batches = plan_batches(units, 16, guard)
    assert [len(b.units) for b in batches if b.units[0].cost == 100] == [1] * 8
    assert [len(b.units) for b in batches if b.units[0].cost == 20] == [8]


def test_retries_do_not_hold_the_failed_attempts_memory():
    """The halves run only after the failed call's tensors are freed (its traceback dropped)."""

    class Buffer:  # stands for the activations a failed GPU call leaves behind
        pass

    class Engine:
        def __init__(self):
            self.buffers: list[weakref.ref] = []
            self.alive_at_call: list[int] = []

        def synthesize(self, units):
            self.alive_at_call.append(sum(ref() is not None for ref in self.buffers))
            if len(units) > 1:
                activations = Buffer()
                self.buffers.append(weakref.ref(activations))
                raise torch.cuda.OutOfMemoryError(f"CUDA out of memory ({id(activations)})")
            return Synthesised([np.zeros(4, np.float32)], 4, 4)

    engine = Engine()
    batch = Batch(0, tuple(Unit(i, 0, 10, "") for i in range(4)))
    outcome = run_batch(engine, batch, BudgetGuard(1000))
    assert all(isinstance(a, np.ndarray) for a in outcome.audio)
    assert outcome.oom_retries == 3  # 4 -> 2 + 2 -> 1 + 1 + 1 + 1
    assert engine.alive_at_call == [0] * 7
