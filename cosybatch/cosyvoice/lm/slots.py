"""The slot pool that decodes speech tokens: requests, sampling and the pool of decode slots.

Every family's LM (a :class:`~.decoder.DecoderLM`) decodes here. Upstream decodes one utterance
at a time and samples in Python from the global random generator. Here utterances
(:class:`LMRequest`) decode in a :class:`SlotPool`: continuous batching over a static KV cache, a
decode step of fixed shapes that never waits on the host, one read back every few steps, CUDA
graphs on CUDA; :class:`PoolStats` counts how full the slots were. Each row stops on its own (stop
token, or 20x its text tokens; the stop token is refused before 2x), and repetition-aware sampling
(:class:`Sampling`, the yaml's ``ras_sampling`` settings; :func:`sample`) runs for all rows at once
on uniforms drawn ahead from each row's own seed, so a row's tokens depend on its seed, not on its
neighbours, the pool size or when it was admitted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from ..yamlconf import Call

log = logging.getLogger(__name__)

# Decode steps between two looks at which rows stopped: the one host sync of the loop. A row that
# stops just after a look costs up to this many wasted slot-steps (a few percent of a segment).
CHECK_EVERY = 8
# Attention reads the cache up to the longest live row, rounded up to this many positions (one
# CUDA graph per window size and slot count).
LENGTH_BUCKET = 256
# Padded prompt positions per prefill forward (bounds its attention memory).
PREFILL_TOKENS = 8192


@dataclass(frozen=True)
class Sampling:
    """Repetition-aware sampling (upstream's ``ras_sampling``); ``greedy`` takes the argmax."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    greedy: bool = False

    @classmethod
    def from_yaml(cls, llm: Call | None) -> Sampling:
        """The ``sampling`` node of the yaml's ``llm`` (``!name:...ras_sampling`` and its
        arguments); upstream's defaults for arguments it leaves out, or when there is no ``llm``."""
        node = llm.kwargs.get("sampling") if llm is not None else None
        if node is None:
            return cls()
        if not isinstance(node, Call) or node.name != "ras_sampling":
            found = node.target if isinstance(node, Call) else repr(node)
            raise ValueError(f"llm.sampling: {found}; only ras_sampling (CosyVoice2's) is supported")
        known = {"top_p", "top_k", "win_size", "tau_r"}
        unknown = sorted(set(node.kwargs) - known)
        if unknown:
            raise ValueError(f"llm.sampling: unknown argument {', '.join(unknown)}")
        try:
            values = {k: (int if k in ("top_k", "win_size") else float)(v) for k, v in node.kwargs.items()}
        except (TypeError, ValueError):
            raise ValueError(f"llm.sampling: arguments must be numbers (got {node.kwargs})") from None
        made = cls(**values)
        if not (0 < made.top_p <= 1 and made.top_k >= 1 and made.win_size >= 1 and made.tau_r > 0):
            raise ValueError(f"llm.sampling: need 0 < top_p <= 1, top_k >= 1, win_size >= 1, tau_r > 0 (got {values})")
        return made

    def describe(self) -> dict:
        if self.greedy:
            return {"greedy": True}
        return {"top_p": self.top_p, "top_k": self.top_k, "win_size": self.win_size, "tau_r": self.tau_r}


@dataclass
class LMRequest:
    """One utterance to decode: its text tokens, an optional zero-shot prompt, its random seed."""

    text: Sequence[int]
    prompt_text: Sequence[int] = ()
    prompt_speech: Sequence[int] = ()
    seed: int = 0
    min_tokens: int | None = None  # default: min_ratio x len(text)
    max_tokens: int | None = None  # default: max_ratio x len(text)
    embedding: Tensor | None = None  # the speaker embedding (192,), for LMs that read one (CosyVoice-300M)
    tokens: list[int] = field(default_factory=list)  # filled by generate()
    stop: str = ""  # filled by generate(): "eos" (its stop token), "length_cap" (max_tokens) or "nonfinite"


def round_up(value: int, step: int) -> int:
    """``value`` rounded up to a multiple of ``step``."""
    return -(-value // step) * step


def slot_buckets(slots: int) -> list[int]:
    """The slot counts a decode step runs at: the powers of two below ``slots``, then ``slots``."""
    sizes, size = [], 1
    while size < slots:
        sizes.append(size)
        size *= 2
    return [*sizes, slots]


@dataclass
class PoolStats:
    steps: int = 0  # decode steps
    slot_steps: int = 0  # rows computed over all steps (the active slot count per step, summed)
    live_slot_steps: int = 0  # rows that were still decoding (the tokens made, stop tokens included)
    host_syncs: int = 0  # device -> host reads in the decode loop
    prefills: int = 0  # prefill forwards
    graphs: int = 0  # CUDA graphs captured
    graph_replays: int = 0  # decode steps run by replaying a CUDA graph
    eager_steps: int = 0  # decode steps run eagerly (CPU, graphs off, a graph's warm-up, a failed capture)
    capture_failures: int = 0  # CUDA graph captures that failed (the pool then decodes eagerly)

    @property
    def live_fraction(self) -> float:
        return self.live_slot_steps / self.slot_steps if self.slot_steps else 1.0

    def add(self, other: PoolStats) -> PoolStats:
        """Add ``other``'s counts to these (several calls' totals); returns self."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def as_dict(self) -> dict:
        return {"steps": self.steps, "slot_steps": self.slot_steps, "live_slot_steps": self.live_slot_steps,
                "live_fraction": round(self.live_fraction, 4), "host_syncs": self.host_syncs,
                "prefills": self.prefills, "graphs": self.graphs, "graph_replays": self.graph_replays,
                "eager_steps": self.eager_steps, "capture_failures": self.capture_failures}


def staged(values, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host values (a list, or a CPU tensor) as a tensor on ``device``. On CUDA through pinned memory
    with ``non_blocking``: the copy is queued on the stream and the host goes on (a tensor built from a
    list on the device is a synchronous copy). torch's pinned-memory cache keeps the buffer until the
    copy has run. On CPU the same values, no copy."""
    host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class SlotWork:
    """One request as the pool takes it: where its tokens go, its prompt, its length limits, its seed."""

    index: int  # the request's position in the caller's list
    prompt: Tensor  # (P, H) prompt embeddings
    lo: int
    hi: int
    seed: int


class _PrefillCache:
    """Writes a prefill's keys and values into slots at positions 0..T-1; attention sees just them."""

    def __init__(self, pool: SlotPool, slots: Tensor):
        self.pool, self.slots = pool, slots

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        t = k.size(2)
        self.pool.k[layer][self.slots, :, :t] = k
        self.pool.v[layer][self.slots, :, :t] = v
        return k, v


class _SlotCache:
    """A decode step's cache: each of the first n slots writes its new key at its own position (a
    tensor index, so shapes never change) and attends over the first ``window`` positions."""

    def __init__(self, pool: SlotPool, n: int, window: int, pos: Tensor):
        self.pool, self.n, self.window = pool, n, window
        _, kv_heads, head_dim = pool.lm.kv_layout
        self.index = pos.view(n, 1, 1, 1).expand(n, kv_heads, 1, head_dim)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.pool.k[layer][: self.n], self.pool.v[layer][: self.n]
        keys.scatter_(2, self.index, k.to(keys.dtype))  # no-op unless under autocast
        values.scatter_(2, self.index, v.to(values.dtype))
        return keys[:, :, : self.window], values[:, :, : self.window]


class SlotPool:
    """A fixed pool of decode slots over a static KV cache, ``(slots, kv_heads, capacity, head_dim)``
    per layer, for continuous batching.

    A waiting request is admitted into a free slot (a prefill writes its prompt's keys at positions
    0..P-1 of that slot), then decodes one token per step until it stops; its slot then takes the
    next request. Every per-row value lives on the device in a fixed-shape tensor (position, tokens
    made, length limits, the last ``win_size`` tokens, the row's uniforms drawn ahead from its own
    seed), so a step has the same shapes and kernels whatever the rows are doing: finished and
    empty slots are masked, not removed, and the step never reads anything back to the host. Every
    ``check_every`` steps one read brings back the tokens of those steps and which rows stopped.

    Steps run on the first n slots, n a power of two (or ``slots``): admission fills the lowest free
    slots, and once no request waits, the remaining rows are moved down so n can halve. On CUDA each
    (n, window) step is captured in a CUDA graph the second time it is needed (the first, eager run
    is its warm-up) and replayed after that.

    ``lm`` is the :class:`~.decoder.DecoderLM` that owns the pool (annotated as a module: the
    decoder module imports this one, not the other way round).
    """

    def __init__(self, lm: nn.Module, slots: int, capacity: int, max_steps: int, sampling: Sampling,
                 cuda_graphs: bool = True, check_every: int = CHECK_EVERY):
        layers, kv_heads, head_dim = lm.kv_layout
        weight = lm.llm_decoder.weight
        device, dtype = weight.device, weight.dtype
        self.lm, self.slots, self.capacity, self.max_steps = lm, slots, capacity, max_steps
        self.sampling, self.check_every = sampling, check_every
        shape = (slots, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]

        def longs(fill: int = 0, *size: int) -> Tensor:
            return torch.full((slots, *size), fill, dtype=torch.long, device=device)

        self.hidden = torch.zeros(slots, lm.hidden_size, device=device, dtype=dtype)
        self.pos, self.count, self.lo, self.hi = longs(), longs(), longs(), longs()
        self.done = torch.ones(slots, dtype=torch.bool, device=device)
        self.nonfinite = torch.zeros(slots, dtype=torch.bool, device=device)  # a row's logits went NaN or infinite
        self.history = longs(-1, sampling.win_size)
        self.uniforms = torch.zeros(slots, max_steps, 2, dtype=torch.float64, device=device)
        self.recent = longs(0, check_every)
        self.recent_live = torch.zeros(slots, check_every, dtype=torch.bool, device=device)
        self.positions = torch.arange(capacity, device=device)
        # Host side, known without asking the device.
        self.owner: list[SlotWork | None] = [None] * slots
        self.bound = [0] * slots  # at least each slot's position
        self.left = [0] * slots  # at most the steps each slot may still take
        self.use_graphs = cuda_graphs and device.type == "cuda"
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._seen: set[tuple[int, int]] = set()
        self._graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._stream = torch.cuda.Stream(device) if self.use_graphs else None
        self.stats = PoolStats()
        self.capture_failures = 0  # over the pool's life (stats counts one call's)

    def fits(self, slots: int, capacity: int, max_steps: int, sampling: Sampling, cuda_graphs: bool,
             check_every: int) -> bool:
        weight = self.lm.llm_decoder.weight
        return (self.slots == slots and self.capacity >= capacity and self.max_steps >= max_steps
                and self.sampling == sampling and self.check_every == check_every
                and (self.hidden.dtype, self.hidden.device) == (weight.dtype, weight.device)
                and self.use_graphs == (cuda_graphs and self.hidden.device.type == "cuda"))

    def _rows(self) -> list[Tensor]:
        """Every per-slot tensor (first dimension = slot)."""
        return [*self.k, *self.v, self.hidden, self.pos, self.count, self.lo, self.hi, self.done, self.history,
                self.uniforms, self.recent, self.recent_live, self.nonfinite]

    # -- scheduling ---------------------------------------------------------------------------
    def run(self, work: list[SlotWork], out: list[list[int]], stops: list[str] | None = None) -> PoolStats:
        """Decode every request of ``work`` into ``out`` (tokens per request index); ``stops`` gets
        why each row ended."""
        stops = stops if stops is not None else [""] * len(out)
        self.stats = PoolStats(graphs=len(self.graphs))
        # A call that failed half-way (out of memory, say) may have left rows behind: drop them.
        self.owner = [None] * self.slots
        self.done.fill_(True)
        queue = list(reversed(work))  # pop() takes the next
        while queue or any(w is not None for w in self.owner):
            free = [s for s in range(self.slots) if self.owner[s] is None]
            if queue and free:
                self._admit([(s, queue.pop()) for s in free[: len(queue)]])
            if not queue:
                self._compact()
            used = [s for s in range(self.slots) if self.owner[s] is not None]
            n = next(b for b in slot_buckets(self.slots) if b > used[-1])
            steps = min(self.check_every, max(self.left[s] for s in used))
            start = max(self.bound[s] for s in used)
            for i in range(steps):
                window = min(self.capacity, round_up(start + i + 1, LENGTH_BUCKET))
                self._run_step(n, window)
            self.stats.steps += steps
            self.stats.slot_steps += steps * n
            self._harvest(n, steps, out, stops)
        self.stats.graphs = len(self.graphs) - self.stats.graphs
        return self.stats

    def _admit(self, placed: list[tuple[int, SlotWork]]) -> None:
        device = self.hidden.device
        placed = sorted(placed, key=lambda p: p[1].prompt.size(0))
        chunk: list[tuple[int, SlotWork]] = []
        for item in placed:
            if chunk and (len(chunk) + 1) * item[1].prompt.size(0) > PREFILL_TOKENS:
                self._prefill(chunk)
                chunk = []
            chunk.append(item)
        self._prefill(chunk)
        uniforms = torch.zeros(len(placed), self.max_steps, 2, dtype=torch.float64)
        for row, (s, w) in enumerate(placed):
            # A row's uniforms come from its own seed only, two per step, drawn ahead.
            rng = np.random.default_rng([int(w.seed) & 0xFFFFFFFFFFFFFFFF, 0x5EED])
            uniforms[row, : w.hi] = torch.from_numpy(rng.random((w.hi, 2)))
            self.owner[s], self.bound[s], self.left[s] = w, w.prompt.size(0), w.hi
        # Every per-row value in one staged copy (slot, position, lo, hi), the uniforms in another.
        rows = staged([[s, w.prompt.size(0), w.lo, w.hi] for s, w in placed], torch.long, device)
        slots = rows[:, 0]
        self.pos[slots] = rows[:, 1]
        self.lo[slots] = rows[:, 2]
        self.hi[slots] = rows[:, 3]
        self.count[slots] = 0
        self.done[slots] = False
        self.nonfinite[slots] = False
        self.history[slots] = -1
        self.recent_live[slots] = False
        self.uniforms[slots] = staged(uniforms, torch.float64, device)

    def _prefill(self, placed: list[tuple[int, SlotWork]]) -> None:
        """One forward over the prompts of ``placed`` (right-padded), keys into their slots, and
        each row's last hidden state into ``hidden``."""
        lm, device = self.lm, self.hidden.device
        lengths = [w.prompt.size(0) for _, w in placed]
        width = max(lengths)
        x = torch.zeros(len(placed), width, lm.hidden_size, device=device, dtype=self.hidden.dtype)
        for row, (_, w) in enumerate(placed):
            x[row, : lengths[row]] = w.prompt
        staging = staged([[s for s, _ in placed], lengths], torch.long, device)
        slots, last = staging[0], staging[1] - 1
        # Right padding: a real position only sees earlier (real) ones; padded keys are written but
        # the first decode steps overwrite them before any row can see them.
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()[None, None]
        h = lm.body(x, self.positions[:width][None], _PrefillCache(self, slots), causal)
        self.hidden[slots] = h[torch.arange(len(placed), device=device), last]
        self.stats.prefills += 1

    def _compact(self) -> None:
        """Move the rows above the smallest slot count that holds them all into free slots below it."""
        used = [s for s in range(self.slots) if self.owner[s] is not None]
        if not used:
            return
        target = next(b for b in slot_buckets(self.slots) if b >= len(used))
        movers = [s for s in used if s >= target]
        if not movers:
            return
        holes = [s for s in range(target) if self.owner[s] is None][: len(movers)]
        moves = staged([movers, holes], torch.long, self.hidden.device)
        src, dst = moves[0], moves[1]
        for tensor in self._rows():
            tensor[dst] = tensor[src]
        self.done[src] = True
        for a, b in zip(movers, holes, strict=True):
            self.owner[b], self.bound[b], self.left[b] = self.owner[a], self.bound[a], self.left[a]
            self.owner[a] = None

    def _harvest(self, n: int, steps: int, out: list[list[int]], stops: list[str]) -> None:
        """The loop's one host read: the last ``steps`` tokens of each row, whether it was live for
        each, whether its logits stayed finite, and whether it has stopped."""
        packed = torch.cat([self.recent[:n, -steps:], self.recent_live[:n, -steps:].long(),
                            self.nonfinite[:n, None].long(), self.done[:n, None].long()], dim=1).tolist()
        self.stats.host_syncs += 1
        stop = self.lm.stop_from
        for s in range(n):
            w = self.owner[s]
            if w is None:
                continue
            row = packed[s]
            tokens = out[w.index]
            for token, live in zip(row[:steps], row[steps : 2 * steps], strict=True):
                if live:
                    tokens.append(token)
                    self.stats.live_slot_steps += 1
            if row[-1]:
                if row[-2]:
                    stops[w.index] = "nonfinite"
                elif tokens and tokens[-1] >= stop:
                    stops[w.index] = "eos"
                else:
                    stops[w.index] = "length_cap"
                if tokens and tokens[-1] >= stop:
                    tokens.pop()
                self.owner[s] = None
            else:
                self.bound[s] += steps
                self.left[s] -= steps

    # -- the decode step ----------------------------------------------------------------------
    def _run_step(self, n: int, window: int) -> None:
        if not self.use_graphs:
            self._step(n, window)
            self.stats.eager_steps += 1
            return
        key = (n, window)
        graph = self.graphs.get(key)
        if graph is None:
            first = key not in self._seen
            self._seen.add(key)
            # Warm-up and capture run on a side stream (the documented pattern). The low-level
            # capture calls are used because torch.cuda.graph() empties the allocator's cache
            # first, which would hand back the memory pool cosybatch reserved.
            main = torch.cuda.current_stream()
            self._stream.wait_stream(main)
            with torch.cuda.stream(self._stream):
                if first:  # the first run is eager: it initialises what capture needs
                    self._step(n, window)
                    self.stats.eager_steps += 1
                else:
                    graph = self._capture(n, window)
            main.wait_stream(self._stream)
            if graph is None:
                return
        graph.replay()
        self.stats.graph_replays += 1

    def _capture(self, n: int, window: int) -> torch.cuda.CUDAGraph | None:
        """The step for (n, window) as a CUDA graph (recorded, not run); None, with graphs turned
        off for this pool and the step run eagerly instead, if capture fails (counted in
        ``capture_failures`` and warned).

        Capture holds the process's capture gate (:data:`cosybatch.gpu.CAPTURE_GATE`): the
        allocator's "capture under way" state is process-wide, so no other worker's flow or vocoder
        allocates or frees while a graph is recorded."""
        from ...gpu import CAPTURE_GATE

        graph = torch.cuda.CUDAGraph()
        try:
            with CAPTURE_GATE.capture():
                graph.capture_begin(pool=self._graph_pool, capture_error_mode="thread_local")
                try:
                    self._step(n, window)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:
            if "out of memory" in str(exc):
                raise
            self.stats.capture_failures += 1
            self.capture_failures += 1
            log.warning("CUDA graph capture of the decode step (%d slots, %d positions) failed (%s); this pool "
                        "decodes without CUDA graphs from now on", n, window, exc)
            self.use_graphs = False
            self._step(n, window)
            self.stats.eager_steps += 1
            return None
        self.graphs[(n, window)] = graph
        return graph

    def graph_keys(self) -> list[tuple[int, int]]:
        """Every (slots, window) a decode step of this pool can run at: one CUDA graph each."""
        windows = range(LENGTH_BUCKET, self.capacity + 1, LENGTH_BUCKET)
        return [(n, w) for n in slot_buckets(self.slots) for w in windows]

    def capture_ahead(self, keys: Sequence[tuple[int, int]], warm_up_only: bool = False) -> PoolStats:
        """Warm up and capture the decode step's CUDA graphs for ``keys`` now (before the memory
        pool is reserved and before workers start), instead of on their second use; with
        ``warm_up_only``, just the eager warm-up step of each (so a caller can measure the capture's
        memory apart). The steps run on the idle pool: every slot is done, and a request's admission
        resets what they wrote."""
        self.stats = PoolStats(graphs=len(self.graphs))
        self.owner = [None] * self.slots
        self.done.fill_(True)
        for n, window in keys:
            if not self.use_graphs:
                break
            if (n, window) not in self.graphs:
                if (n, window) not in self._seen:
                    self._run_step(n, window)  # the eager warm-up
                if not warm_up_only:
                    self._run_step(n, window)  # the capture, then one replay
        self.stats.graphs = len(self.graphs) - self.stats.graphs
        return self.stats

    def _step(self, n: int, window: int) -> None:
        """Sample one token per slot from ``hidden``, then run those tokens through the model."""
        lm, s = self.lm, self.sampling
        stop = lm.stop_from
        hidden, pos, count = self.hidden[:n], self.pos[:n], self.count[:n]
        done, history = self.done[:n], self.history[:n]
        logits = lm.llm_decoder(hidden).float()
        self.nonfinite[:n].logical_or_(~done & ~torch.isfinite(logits).all(-1))
        logp = logits.log_softmax(-1)
        # Ids from emit_limit on are never emitted (upstream skips them and repeats the step);
        # the stop ids are refused before a row's minimum length.
        if lm.emit_limit < logp.size(-1):
            logp[:, lm.emit_limit :] = -math.inf
        early = lm.min_len_masked
        logp[:, early] = logp[:, early].masked_fill((count < self.lo[:n])[:, None], -math.inf)
        index = count.clamp(max=self.max_steps - 1).view(n, 1, 1).expand(n, 1, 2)
        # A masked id can come out only of NaN logits or a rounding edge of the draw: it stops the row.
        ids = sample(logp, history, self.uniforms[:n].gather(1, index)[:, 0], s).clamp(max=lm.emit_limit - 1)
        live = ~done
        ended = live & ((ids >= stop) | (count + 1 >= self.hi[:n]))
        history.copy_(torch.cat([history[:, 1:], ids[:, None]], dim=1))
        self.recent[:n] = torch.cat([self.recent[:n, 1:], ids[:, None]], dim=1)
        self.recent_live[:n] = torch.cat([self.recent_live[:n, 1:], live[:, None]], dim=1)
        count.add_(live.long())
        done.logical_or_(ended)
        embeds = lm.speech_embedding(ids)[:, None]
        mask = (self.positions[:window][None, :] <= pos[:, None])[:, None, None, :]
        h = lm.body(embeds, pos[:, None], _SlotCache(self, n, window, pos), mask)
        hidden.copy_(h[:, -1])
        pos.add_(live.long())


def sample(logp: Tensor, history: Tensor, uniforms: Tensor, s: Sampling) -> Tensor:
    """Repetition-aware sampling for a batch: (B, V) log-probs, (B, W) recent tokens, (B, 2) uniforms.

    Per row: nucleus sampling (the most likely ids while their cumulative probability is below
    top_p, at most top_k of them); if the pick already occurs ``win_size * tau_r`` times or more in
    the last ``win_size`` tokens, sample from the whole distribution instead (upstream's RAS).
    """
    if s.greedy:
        return logp.argmax(-1)
    probs = logp.softmax(-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p
    rank = torch.arange(probs.size(-1), device=probs.device)[None]
    kept = torch.where((before < s.top_p) & (rank < s.top_k), sorted_p, torch.zeros_like(sorted_p))
    nucleus = order.gather(-1, pick(kept, uniforms[:, 0])[:, None])[:, 0]
    repeats = (history == nucleus[:, None]).sum(-1)
    fallback = pick(probs, uniforms[:, 1])
    return torch.where(repeats >= s.win_size * s.tau_r, fallback, nucleus)


def pick(weights: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw per row from unnormalised non-negative weights, with uniforms u in [0, 1)."""
    cdf = weights.double().cumsum(-1)
    target = u.double()[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    return index.clamp(max=weights.size(-1) - 1)
