"""The planner: length bucketing beats random order, batches respect their limits, and every unit
is planned exactly once."""

from __future__ import annotations

import random

from helpers import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from cosybatch.plan import Unit, padding_ratio, plan_batches


def test_padding_beats_random_order_on_real_costs(engine):
    lines = [line for line in (ROOT / "examples" / "sentences.txt").read_text().splitlines() if line.strip()]
    units = []
    for row, text in enumerate(lines):
        prepared = engine.prepare(text, str(row))
        units += [Unit(row, part, cost, "") for part, cost in enumerate(q.cost for q in prepared.pieces)]
    planned = plan_batches(units, max_batch_size=8, batch_budget=10**9)
    shuffled = units[:]
    random.Random(0).shuffle(shuffled)
    naive = [plan_batches(shuffled[i:i + 8], 8, 10**9)[0] for i in range(0, len(shuffled), 8)]
    assert padding_ratio(planned) < 0.10
    assert padding_ratio(naive) > 0.25
    assert padding_ratio(planned) < padding_ratio(naive) / 3


def test_longest_first_and_deterministic():
    units = [Unit(i, 0, c, "g") for i, c in enumerate([5, 90, 40, 41, 7, 88])]
    a = plan_batches(units, 2, 1000)
    b = plan_batches(list(reversed(units)), 2, 1000)
    assert [[u.row_key for u in x.units] for x in a] == [[u.row_key for u in x.units] for x in b]
    longest = [max(u.cost for u in x.units) for x in a]
    assert longest == sorted(longest, reverse=True)


unit_lists = st.lists(
    st.tuples(st.integers(1, 500), st.sampled_from(["a", "b", "c"])), min_size=0, max_size=200
)


@settings(max_examples=200, deadline=None)
@given(unit_lists, st.integers(1, 16), st.integers(1, 3000))
def test_every_unit_once_and_batches_within_limits(items, max_batch, budget):
    units = [Unit(i, 0, cost, group) for i, (cost, group) in enumerate(items)]
    batches = plan_batches(units, max_batch, budget)
    planned = [u for b in batches for u in b.units]
    assert sorted(u.row_key for u in planned) == list(range(len(units)))
    for b in batches:
        assert len({u.group for u in b.units}) == 1
        assert len(b.units) <= max_batch
        assert b.padded_cost <= budget or len(b.units) == 1
    assert [b.seq for b in batches] == list(range(len(batches)))
