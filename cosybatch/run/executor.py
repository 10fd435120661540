"""The parts the row line (line.py) is built of: engines by voice (`EngineSet`), batch sizing
from the engine and the budget guard (`BatchPolicy`), one batch through an engine with
out-of-memory split-and-retry (`run_batch`), rows cut into pieces and put back together
(`RowAssembler`), and a row's pieces joined into one clip (`assemble_audio`, `segment_times`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from ..config import RunConfig, cpu_count
from ..corpus import Row
from ..engines import Engine, Piece, Prepared, RowRejected, Synthesised, VoiceRequest, open_engine
from ..errors import CosybatchError, EngineError, PieceTooLong
from ..plan import Batch, BudgetGuard, Unit, plan_batches
from ..stats import BatchWork
from ..voices import PoolEntry, language_family

log = logging.getLogger("cosybatch")


@dataclass
class PendingRow:
    row: Row
    text: str  # what is spoken: the row's text after the engine's normalisation
    voice: str  # the engine's key in EngineSet
    parts: list  # audio per piece, filled in by finished batches
    remaining: int
    error: Optional[str] = None
    label: Optional[str] = None  # the row's voice for the manifest (multi-voice engines)
    instruct: Optional[str] = None  # the instruction it is spoken with, for the manifest
    lm: Optional[list] = None  # per piece, what an LM-based engine said of it (Synthesised.lm)
    texts: Optional[list] = None  # per piece, what it says (Piece.text); None: the engine does not tell
    entry: Optional[PoolEntry] = None  # the pool's voice the job chose for it (its retakes keep it)
    meta: Optional[dict] = None  # KEY.json fields of this row: speaker, prompt, language, prosody
    expected_s: Optional[float] = None  # how long its engine expects the clip to be (`expected_seconds`)
    shaped: Any = None  # its take made ready for the shard (run.shaping.Shaped), once joined


@dataclass
class Outcome:
    batch: Batch
    audio: list  # per unit: np.ndarray, or an error string
    lm: Optional[list] = None  # per unit: the engine's Synthesised.lm entry, when it gives them
    real_frames: int = 0
    padded_frames: int = 0
    infer_s: float = 0.0
    oom_retries: int = 0

    def work(self) -> BatchWork:
        return BatchWork(len(self.batch.units), self.real_frames, self.padded_frames, self.infer_s, self.oom_retries)


class ClipRejected(Exception):
    """A row's audio that must not be committed (empty, non-finite, constant); the message is why."""


def clip_fault(audio: np.ndarray) -> Optional[str]:
    """Why a clip is no speech at all (None: it may be committed). The floor under every engine: a
    model with broken weights gives silence or a NaN waveform without raising (quality gates go finer)."""
    if audio.size == 0:
        return "the engine returned empty audio (0 samples)"
    finite = np.isfinite(audio)
    if not finite.all():
        return (f"the engine returned non-finite audio ({audio.size - int(finite.sum())} of {audio.size} "
                "samples NaN or infinite); check the model's weights")
    if float(audio.max()) == float(audio.min()):
        return (f"the engine returned constant audio ({audio.size} samples all {float(audio[0]):g}); "
                "check the model's weights")
    return None


def expected_seconds(engine, pieces, sentence_silence: float) -> Optional[float]:
    """How long the clip of `pieces` (one row's, from the engine's prepare) should be, by the
    engine's own estimate of each piece, with the silence `assemble_audio` puts between them; None
    when the engine cannot say for a piece."""
    each = [engine.estimate_seconds(piece) for piece in pieces]
    if not each or any(s is None for s in each):
        return None
    return sum(each) + sentence_silence * (len(each) - 1)


def assemble_audio(parts: list, sample_rate: int, cfg: RunConfig) -> np.ndarray:
    """A row's sentences joined in order (with --sentence-silence between); its level, rate and
    format are `run.shaping.shape`'s. Raises ClipRejected for a piece that is no speech
    (`clip_fault`): checked per piece, before the silence between pieces could hide it."""
    for i, part in enumerate(parts):
        fault = clip_fault(np.asarray(part))
        if fault:
            raise ClipRejected(fault if len(parts) == 1 else f"piece {i + 1} of {len(parts)}: {fault}")
    if len(parts) == 1:
        audio = parts[0]
    else:
        gap = np.zeros(round(cfg.output.sentence_silence_s * sample_rate), dtype=np.float32)
        pieces = []
        for i, part in enumerate(parts):
            if i:
                pieces.append(gap)
            pieces.append(part)
        audio = np.concatenate(pieces)
    return audio


def segment_times(parts: list, texts: Optional[list], sample_rate: int, cfg: RunConfig) -> Optional[list]:
    """Where each piece of a row is in the clip `assemble_audio` makes of `parts`: [{"text",
    "start", "end"}] in seconds, from the sample counts (the --sentence-silence gap between one
    piece's end and the next one's start). None when the engine told no piece's text (`texts`
    None or all None); a piece whose text it could not tell has text None."""
    if not texts or all(t is None for t in texts):
        return None
    gap = round(cfg.output.sentence_silence_s * sample_rate) if len(parts) > 1 else 0
    segments, at = [], 0
    for i, (part, text) in enumerate(zip(parts, texts, strict=True)):
        if i:
            at += gap
        end = at + len(part)
        segments.append({"text": text, "start": at / sample_rate, "end": end / sample_rate})
        at = end
    return segments


def row_extra(pending: PendingRow) -> dict:
    """What `render_item` records of a finished row besides its voice and instruction."""
    return pending.meta or {}


def _shown(value) -> str:
    text = repr(value)
    return (text if len(text) <= 60 else text[:59] + "…") + f" (a {type(value).__name__})"


def prepared_fault(prepared) -> Optional[str]:
    """What of a `Prepared` breaks the contract (None: nothing), naming the field."""
    if not isinstance(prepared, Prepared):
        return f"returned {_shown(prepared)}, not a Prepared"
    if not isinstance(prepared.pieces, (tuple, list)):
        return f"returned Prepared.pieces {_shown(prepared.pieces)}, not a tuple of Piece"
    for i, piece in enumerate(prepared.pieces):
        if not isinstance(piece, Piece):
            return f"returned Prepared.pieces[{i}] {_shown(piece)}, not a Piece"
        if not isinstance(piece.cost, int) or isinstance(piece.cost, bool) or piece.cost < 0:
            return f"returned Prepared.pieces[{i}].cost {_shown(piece.cost)}, not an int >= 0"
        if piece.text is not None and not isinstance(piece.text, str):
            return f"returned Prepared.pieces[{i}].text {_shown(piece.text)}, not a str or None"
    if not isinstance(prepared.text, str):
        return f"returned Prepared.text {_shown(prepared.text)}, not a str"
    for name in ("voice", "instruct"):
        value = getattr(prepared, name)
        if value is not None and not isinstance(value, str):
            return f"returned Prepared.{name} {_shown(value)}, not a str or None"
    if prepared.meta is not None and not isinstance(prepared.meta, dict):
        return f"returned Prepared.meta {_shown(prepared.meta)}, not a dict or None"
    return None


def synthesised_fault(syn, units: int) -> Optional[str]:
    """What of a `Synthesised` for `units` pieces breaks the contract (None: nothing), naming the field."""
    if not isinstance(syn, Synthesised):
        return f"returned {_shown(syn)}, not a Synthesised"
    if not isinstance(syn.audio, (list, tuple)) or len(syn.audio) != units:
        size = f"{len(syn.audio)} clips" if isinstance(syn.audio, (list, tuple)) else _shown(syn.audio)
        return f"returned Synthesised.audio of {size} for {units} pieces (one 1-D array per piece)"
    for i, audio in enumerate(syn.audio):
        if not isinstance(audio, np.ndarray) or audio.ndim != 1 or audio.dtype.kind != "f":
            shape = f"an array of shape {audio.shape} and dtype {audio.dtype}" if isinstance(audio, np.ndarray) \
                else _shown(audio)
            return f"returned Synthesised.audio[{i}] {shape}, not a 1-D float array"
    for name in ("real_frames", "padded_frames"):
        value = getattr(syn, name)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            return f"returned Synthesised.{name} {_shown(value)}, not an int >= 0"
    if syn.lm is not None and (not isinstance(syn.lm, (list, tuple)) or len(syn.lm) != units):
        return f"returned Synthesised.lm {_shown(syn.lm)}, not None or a list of one entry per piece"
    return None


def run_batch(engine: Engine, batch: Batch, guard: Optional[BudgetGuard] = None) -> Outcome:
    """Synthesise one batch, never letting one unit or an out-of-memory error end the job.

    Out of memory: the batch is split in halves and each is retried (recursively), and `guard`
    lowers the budget of that length range for the rest of the run. A unit that runs out of
    memory alone fails its row with the reason. Any other error: each unit is retried alone, so
    one bad unit fails only its own row."""
    from ..gpu import is_oom

    t = time.monotonic()
    outcome = Outcome(batch, [None] * len(batch.units))

    def attempt(indices: list[int]) -> None:
        units = tuple(batch.units[i] for i in indices)
        error = None
        try:
            syn = engine.synthesize(units)
        except Exception as exc:
            # Keep only the message: the traceback holds the failed call's frames, and with them
            # its (GPU) tensors, which the retries below need freed.
            error, oom = (str(exc) if isinstance(exc, PieceTooLong) else repr(exc)), is_oom(exc)
            exc.__traceback__ = None
            del exc
        fault = synthesised_fault(syn, len(units)) if error is None else None
        if fault is not None:  # a plugin's bug, the same on any retry: the batch's rows fail with it
            message = str(EngineError(f"engine {engine.name!r}: its synthesize() {fault} (docs/writing-an-engine.md)"))
            for i in indices:
                outcome.audio[i] = message
        elif error is None:
            for i, audio in zip(indices, syn.audio, strict=True):
                outcome.audio[i] = audio
            if syn.lm is not None:
                if outcome.lm is None:
                    outcome.lm = [None] * len(batch.units)
                for i, info in zip(indices, syn.lm, strict=True):
                    outcome.lm[i] = info
            outcome.real_frames += syn.real_frames
            outcome.padded_frames += syn.padded_frames
        elif oom and len(indices) > 1:
            outcome.oom_retries += 1
            if guard is not None:
                guard.shrink(Batch(batch.seq, units))
            log.warning("out of memory on a batch of %d (padded cost %d); retrying it in halves",
                        len(units), len(units) * max(u.cost for u in units))
            half = len(indices) // 2
            attempt(indices[:half])
            attempt(indices[half:])
        elif len(indices) > 1:
            for i in indices:
                attempt([i])
        elif oom:
            outcome.audio[indices[0]] = (f"out of memory even alone (a piece of cost {units[0].cost}): {error}; "
                                         "split the row into shorter ones or give the job more GPU memory")
        else:
            outcome.audio[indices[0]] = f"synthesis failed: {error}"

    attempt(list(range(len(batch.units))))
    outcome.infer_s = time.monotonic() - t
    return outcome


class EngineSet:
    """Engines by voice, opened on first use: one shared instance for a `multi_voice` engine, one
    per voice otherwise. A voice that fails to load fails its rows, not the job."""

    def __init__(self, cfg: RunConfig, device: Optional[str] = None):
        self.cfg = cfg
        self.device = device
        self.cls = cfg.engine_class()
        self.by_voice: dict[str, Engine] = {}
        self.errors: dict[str, str] = {}
        self.router = cfg.voice_router()

    def get(self, voice: Optional[str], from_row: bool) -> Engine:
        if self.cls.multi_voice and "" in self.by_voice:
            return self.by_voice[""]  # one instance serves every voice
        key = "" if self.cls.multi_voice else voice or ""
        if key in self.by_voice:
            return self.by_voice[key]
        if key in self.errors:
            raise RowRejected(self.errors[key])
        try:
            engine = open_engine(self.cfg.engine.name, voice, self.cfg.engine_options_for(self.device, not from_row))
        except CosybatchError as exc:
            if not from_row:
                raise
            self.errors[key] = str(exc)
            raise RowRejected(str(exc)) from None
        self.by_voice[key] = engine
        return engine

    def prepare(self, row: Row, attempt: int = 0,
                entry: Optional[PoolEntry] = None) -> tuple[str, Prepared, Optional[PoolEntry]]:
        """Choose the row's voice (its own; else by its language from --voice-map, or from
        --voice-pool; else --voice), open (or reuse) its engine and prepare the row. Returns the batch
        group (rows of one group may share a batch), the prepared row (its `meta`: what KEY.json
        records of it) and the pool entry chosen (None: none). Raises RowRejected. `attempt` > 0:
        the quality gate's next take of the row (new seeds), with the `entry` its first take had."""
        for column, value in (("voice", row.voice), ("prompt_wav", row.prompt_wav)):
            if value is not None and "\x00" in value:
                # A NUL cannot be in a path or a name: the OS refuses it with a ValueError that would end the job.
                raise RowRejected(f"{column} {value!r} holds a NUL byte; a {column} is a name or a path without one")
        own = row.voice is not None or row.prompt_wav is not None
        # A retake's entry passed the language check at its first take (or was routed by language).
        pool, by_language, index = None, entry is not None, None
        if not own and entry is None and self.router.active:
            try:
                pool, by_language = self.router.pool_for(row.language)
            except LookupError as exc:
                raise RowRejected(str(exc)) from None
            if pool is not None:
                index = self.router.pick(pool, row.id)
                entry = pool.entries[index]
        if entry is not None:
            voice = entry.voice or self.cfg.engine.voice
            engine = self.get(voice, from_row=False)
            request = VoiceRequest(voice, entry.prompt_wav, entry.prompt_text, False, row.instruct,
                                   speaker=entry.speaker, pooled=True)
        else:
            voice = row.voice or self.cfg.engine.voice
            engine = self.get(voice, from_row=row.voice is not None)
            request = VoiceRequest(voice, row.prompt_wav, row.prompt_text, own, row.instruct)
        if row.prompt_wav is not None and not self.cls.zero_shot:
            raise RowRejected(f"engine {self.cls.name!r} takes no prompt audio; drop the prompt_wav column "
                              "or choose an engine that clones voices")
        if row.instruct is not None and not self.cls.takes_instruct:
            raise RowRejected(f"engine {self.cls.name!r} cannot follow an instruction; drop the instruct column "
                              "or use --engine cosyvoice with a model that takes instructions")
        speaks = getattr(engine, "language", None)
        if row.language is not None and not own and not by_language and speaks \
                and language_family(row.language) != language_family(speaks):
            raise RowRejected(f"the row's language is {row.language!r} but voice {engine.voice_name!r} speaks "
                              f"{speaks!r}; route it with --voice-map {row.language}=VOICE")
        prepared = (engine.prepare(row.text, row.id, request, attempt=attempt) if attempt
                    else engine.prepare(row.text, row.id, request))
        fault = prepared_fault(prepared)
        if fault is not None:  # a plugin built on another contract: every row would break the same way
            raise EngineError(f"engine {self.cls.name!r}: its prepare() {fault} for row {row.id!r} "
                              "(docs/writing-an-engine.md)")
        if not prepared.pieces:
            raise RowRejected(f"engine {self.cls.name!r} cut the row into no pieces; an engine rejects a row it "
                              "cannot speak")
        if index is not None and self.router.mode == "balanced":
            pool.add(index, sum(piece.cost for piece in prepared.pieces))
        meta = {"language": row.language, "prosody": prepared.meta}
        if entry is not None:
            meta.update(speaker=entry.speaker, prompt=entry.prompt_wav)
        return ("" if self.cls.multi_voice else voice or ""), replace(prepared, meta=meta), entry

    def observe(self, row: Row) -> None:
        """A row the run does not make (committed before): in balanced mode its voice's predicted
        audio is counted again, so that the rows after it get the voices they would have got in the
        run that was interrupted (the same rows read in the same order; rows that failed are not
        counted again, so after failures the rest may be spread otherwise)."""
        if self.router.mode != "balanced" or not self.router.active or row.voice is not None \
                or row.prompt_wav is not None:
            return
        with contextlib.suppress(RowRejected):  # it was rejected then too: it counted nothing
            self.prepare(row)

    def candidate_engines(self, row: Row) -> list[Engine]:
        """The engines a committed row without its own voice may have been made with (its pool's
        voices, or the job's voice): for adopting items the journal does not list."""
        voices = {self.cfg.engine.voice}
        if self.router.active and row.voice is None and row.prompt_wav is None:
            try:
                pool, _ = self.router.pool_for(row.language)
            except LookupError:
                return []
            if pool is not None:
                voices = {e.voice or self.cfg.engine.voice for e in pool.entries}
        found = []
        for voice in sorted(voices, key=lambda v: v or ""):
            try:
                found.append(self.get(voice, from_row=False))
            except (RowRejected, CosybatchError):
                continue
        return found


@dataclass
class BatchPolicy:
    """How big batches are, from the engine's defaults, its GPU probe and the user's limits; the
    guard lowers a length range's budget after an out-of-memory error."""

    batch_size: int
    batch_budget: int
    workers: int
    guard: BudgetGuard

    @classmethod
    def for_engine(cls, cfg: RunConfig, engine: Engine, workers: Optional[int] = None) -> BatchPolicy:
        size, per_item = engine.batch_defaults()
        batch_size = cfg.batching.batch_size or size
        workers = workers or cfg.batching.workers or (cpu_count() if engine.device == "cpu" else 2)
        probed = engine.memory_plan().probed_budget  # sized to the GPU pool; workers share it
        budget = cfg.batching.batch_budget or (max(1, probed // workers) if probed else None) or batch_size * per_item
        return cls(batch_size, budget, workers, BudgetGuard(budget))

    def plan(self, units: list[Unit], first_seq: int = 0) -> list[Batch]:
        return plan_batches(units, self.batch_size, self.guard, first_seq=first_seq)


class RowAssembler:
    """Rows in flight: each cut into units for the planner, put back together as batches finish."""

    def __init__(self) -> None:
        self.rows: dict[int, PendingRow] = {}
        self.lock = threading.Lock()
        self._next_key = 0

    def add(self, row: Row, prepared: Prepared, group: str, entry: Optional[PoolEntry] = None,
            expected_s: Optional[float] = None) -> list[Unit]:
        key, self._next_key = self._next_key, self._next_key + 1
        with self.lock:
            self.rows[key] = PendingRow(row, prepared.text, group, [None] * len(prepared.pieces),
                                        len(prepared.pieces), label=prepared.voice, instruct=prepared.instruct,
                                        texts=[piece.text for piece in prepared.pieces], entry=entry,
                                        meta=prepared.meta, expected_s=expected_s)
        return [Unit(key, part, piece.cost, group, piece.payload) for part, piece in enumerate(prepared.pieces)]

    def take(self, outcome: Outcome) -> list[PendingRow]:
        """Put a finished batch's audio (or errors) into its rows; returns the rows now whole, in file order."""
        finished = []
        with self.lock:
            for i, (unit, audio) in enumerate(zip(outcome.batch.units, outcome.audio, strict=True)):
                pending = self.rows[unit.row_key]
                if isinstance(audio, str):
                    pending.error = pending.error or audio
                else:
                    pending.parts[unit.part] = audio
                if outcome.lm is not None and outcome.lm[i] is not None:
                    if pending.lm is None:
                        pending.lm = [None] * len(pending.parts)
                    pending.lm[unit.part] = outcome.lm[i]
                pending.remaining -= 1
                if pending.remaining == 0:
                    finished.append(self.rows.pop(unit.row_key))
        return sorted(finished, key=lambda p: p.row.index)
