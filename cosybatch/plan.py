"""The plan: sort prepared units into length buckets and cut them into batches.

Batching cost on every engine grows with `batch size x longest item` (the padded cost), so units
of similar length go together. Within one window of the corpus the units are sorted by cost, which
is the finest bucketing there is; windows keep memory bounded on corpora of any size.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class Unit:
    """One piece of work for an engine: a sentence of a row, prepared for synthesis."""

    row_key: int  # position of the row in the job's row table
    part: int  # index of this piece within its row (rows are rejoined in this order)
    cost: int  # estimated length in engine units (phoneme ids for Piper)
    group: str  # units in one batch share a group (for example the voice)
    payload: Any = None  # engine-specific prepared input


@dataclass(frozen=True)
class Batch:
    seq: int  # position in the plan; the writer commits batches in this order
    units: tuple[Unit, ...]

    @property
    def group(self) -> str:
        return self.units[0].group

    @property
    def padded_cost(self) -> int:
        return len(self.units) * max(u.cost for u in self.units)

    @property
    def real_cost(self) -> int:
        return sum(u.cost for u in self.units)


class BudgetGuard:
    """The padded-cost budget per length range, lowered where a batch ran out of memory.

    Length ranges are powers of two of a batch's longest unit, so a long-row OOM does not shrink
    the budget for short rows. Thread-safe: inference threads shrink, the planner reads.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self._by_range: dict[int, int] = {}
        self._lock = threading.Lock()
        self.changes: list[dict] = []

    @staticmethod
    def _range(longest: int) -> int:
        return max(1, longest).bit_length()

    def __call__(self, longest: int) -> int:
        with self._lock:
            return self._by_range.get(self._range(longest), self.budget)

    def shrink(self, batch: Batch) -> int:
        """Halve the budget of the batch's length range below what failed; returns the new budget."""
        longest = max(u.cost for u in batch.units)
        key = self._range(longest)
        with self._lock:
            old = self._by_range.get(key, self.budget)
            new = max(longest, min(old, batch.padded_cost) // 2)
            if new < old:
                self._by_range[key] = new
                self.changes.append({"longest_from": 1 << (key - 1), "longest_to": (1 << key) - 1,
                                     "old_budget": old, "new_budget": new})
            return min(old, new)


def plan_batches(
    units: Iterable[Unit], max_batch_size: int, batch_budget: Union[int, Callable[[int], int]], first_seq: int = 0
) -> list[Batch]:
    """Cut units into batches: same group, sorted by cost, `len x longest <= batch_budget`.

    `batch_budget` is a number, or a function of a batch's longest cost (a :class:`BudgetGuard`).

    A unit costlier than the whole budget gets a batch of its own. Batches come longest first, so
    the slowest work (and any out-of-memory surprise) shows up at the start of a window.
    The result depends only on the units, never on dict or hash order.
    """
    if max_batch_size < 1:
        raise ValueError("max_batch_size must be at least 1")
    budget_for = batch_budget if callable(batch_budget) else (lambda _longest: batch_budget)
    if budget_for(1) < 1:
        raise ValueError("batch_budget must be at least 1")
    ordered = sorted(units, key=lambda u: (u.group, -u.cost, u.row_key, u.part))
    batches: list[list[Unit]] = []
    current: list[Unit] = []
    for unit in ordered:
        if current:
            longest = current[0].cost  # sorted descending within a group
            fits = (
                unit.group == current[0].group
                and len(current) < max_batch_size
                and (len(current) + 1) * longest <= budget_for(longest)
            )
            if not fits:
                batches.append(current)
                current = []
        current.append(unit)
    if current:
        batches.append(current)
    batches.sort(key=lambda b: (-b[0].cost, b[0].group, b[0].row_key, b[0].part))
    return [Batch(first_seq + i, tuple(b)) for i, b in enumerate(batches)]


def padding_ratio(batches: Sequence[Batch]) -> float:
    """Share of the padded cost that is padding: 0 means no padding at all."""
    padded = sum(b.padded_cost for b in batches)
    if not padded:
        return 0.0
    return 1.0 - sum(b.real_cost for b in batches) / padded
