"""The base class of every family's speech-token LM: :class:`DecoderLM`.

Every family's LM (:mod:`.v1` CosyVoice-300M's transformer, :mod:`.v2` and :mod:`.v3` the Qwen2
ones of CosyVoice2 and 3) is a :class:`DecoderLM`: a subclass provides the decoder stack, the
embeddings, the head and the stop rule; the base class decodes a batch of requests in its
:class:`~.slots.SlotPool` (which holds the requests, the sampling and the pool itself). Here too:
:class:`Cache`, the no-cache forward of one unpadded sequence (the reference the pool is tested
against), and ``SPEECH_TOKENS``, the speech vocabulary of CosyVoice2 and 3.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .slots import CHECK_EVERY, LENGTH_BUCKET, LMRequest, PoolStats, Sampling, SlotPool, SlotWork, round_up

SPEECH_TOKENS = 6561


class Cache:
    """No cache: attention sees exactly the keys of this forward (a full, unpadded sequence)."""

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v


class DecoderLM(nn.Module):
    """What the slot pool needs of a speech-token LM, and batched decoding over it.

    A subclass provides ``llm_decoder`` (hidden -> logits over speech ids and control ids),
    ``speech_embedding`` (speech id -> input embedding), :meth:`prompt_embeddings`, :meth:`body`
    (the decoder stack over new positions, reading and writing a KV cache), ``kv_layout`` and
    ``hidden_size``. The stop rule is data: ids from ``stop_from`` on end a row, ids from
    ``emit_limit`` on are never emitted, and ``min_len_masked`` (a slice of ids) is refused before
    a row's minimum length.
    """

    speech_token_size: int = SPEECH_TOKENS

    def __init__(self) -> None:
        super().__init__()
        self._pool: SlotPool | None = None
        # One decode at a time: the pool (and its CUDA graphs) is shared state. With two workers,
        # one decodes while the other runs the flow and the vocoder.
        self._decoding = threading.Lock()

    # -- what a subclass provides ---------------------------------------------------------------
    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the KV cache."""
        raise NotImplementedError

    @property
    def hidden_size(self) -> int:
        raise NotImplementedError

    def prompt_embeddings(self, req: LMRequest, device: torch.device) -> Tensor:
        """(P, H) input embeddings of a request's prompt (everything before its first speech token)."""
        raise NotImplementedError

    def body(self, x: Tensor, positions: Tensor, cache, mask: Tensor) -> Tensor:
        """x: (B, T, H) inputs at ``positions`` (B or 1, T); returns (B, T, H) hidden states."""
        raise NotImplementedError

    # -- the stop rule (CosyVoice2's: one stop id, the ids after it never emitted) ---------------
    @property
    def stop_from(self) -> int:
        return self.speech_token_size

    @property
    def emit_limit(self) -> int:
        return self.speech_token_size + 1

    @property
    def min_len_masked(self) -> slice:
        return slice(self.speech_token_size, self.speech_token_size + 1)

    def finish_tokens(self, tokens: list[int]) -> list[int]:
        """A decoded row's tokens as the flow gets them (CosyVoice3 drops long silences here)."""
        return tokens

    # -- decoding -------------------------------------------------------------------------------
    def forward_full(self, embeds: Tensor) -> Tensor:
        """Log-probabilities over speech ids at every position of one unpadded sequence (no cache).

        The reference the cached batched decoder is tested against."""
        t = embeds.size(0)
        mask = torch.ones(t, t, dtype=torch.bool, device=embeds.device).tril()[None, None]
        positions = torch.arange(t, device=embeds.device)[None]
        hidden = self.body(embeds[None], positions, Cache(), mask)
        return self.llm_decoder(hidden[0]).log_softmax(-1)

    def slot_pool(self, slots: int, capacity: int, max_steps: int, sampling: Sampling, cuda_graphs: bool = True,
                  check_every: int = CHECK_EVERY) -> SlotPool:
        """The pool of the last call when it fits (its CUDA graphs stay valid), else a new one."""
        pool = self._pool
        if pool is None or not pool.fits(slots, capacity, max_steps, sampling, cuda_graphs, check_every):
            if pool is not None and pool.hidden.device.type == "cuda":
                # The LM may run on a stream of its own: let it finish with the old cache before the
                # allocator (which orders a free by the default stream) hands that memory out again.
                torch.cuda.synchronize(pool.hidden.device)
            self._pool = pool = None  # free the old cache before the new one is allocated
            self._pool = SlotPool(self, slots, round_up(capacity, LENGTH_BUCKET),
                                  round_up(max_steps, LENGTH_BUCKET), sampling, cuda_graphs, check_every)
        return self._pool

    def generate(self, requests: Sequence[LMRequest], sampling: Sampling | None = None, **options) -> list[list[int]]:
        """Speech tokens for every request (stop token excluded); also stored in ``request.tokens``.
        ``options`` are :meth:`decode`'s; ``self.last_stats`` says how full the slots were."""
        tokens, self.last_stats = self.decode(requests, sampling, **options)
        return tokens

    @torch.inference_mode()
    def decode(
        self,
        requests: Sequence[LMRequest],
        sampling: Sampling | None = None,
        min_ratio: float = 2.0,
        max_ratio: float = 20.0,
        slots: int | None = None,
        cuda_graphs: bool = True,
        check_every: int = CHECK_EVERY,
    ) -> tuple[list[list[int]], PoolStats]:
        """(tokens per request, this call's pool statistics). Requests decode in a pool of
        ``slots`` decode slots (default: one per request); a slot takes the next waiting request as
        soon as its row stops. Safe to call from several threads: calls take turns."""
        sampling = sampling or Sampling()
        out: list[list[int]] = [[] for _ in requests]
        stops = ["length_cap"] * len(requests)  # what a row that makes no token (max_tokens 0) hit
        hi = [r.max_tokens if r.max_tokens is not None else int(len(r.text) * max_ratio) for r in requests]
        lo = [r.min_tokens if r.min_tokens is not None else int(len(r.text) * min_ratio) for r in requests]
        todo = [i for i in range(len(requests)) if hi[i] > 0]  # nothing to generate for the others
        stats = PoolStats()
        if todo:
            device = self.llm_decoder.weight.device
            prompts = {i: self.prompt_embeddings(requests[i], device) for i in todo}
            capacity = max(prompts[i].size(0) + hi[i] for i in todo) + 1
            steps = max(hi[i] for i in todo)
            # Longest first, so the last rows to finish are short ones and the slots stay full.
            order = sorted(todo, key=lambda i: -hi[i])
            work = [SlotWork(i, prompts[i], lo[i], hi[i], requests[i].seed) for i in order]
            with self._decoding:
                pool = self.slot_pool(slots or len(todo), capacity, steps, sampling, cuda_graphs, check_every)
                stats = pool.run(work, out, stops)
        for req, tokens, stop in zip(requests, out, stops, strict=True):
            req.tokens, req.stop = tokens, stop
        return out, stats
