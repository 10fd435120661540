"""The runner contract: how a job's rows reach engines and how what comes back is committed.

The job (job.py) owns everything around a run: the output folder and its lock, the fingerprint,
the statistics, progress, limits, signals and the end. A runner only moves rows: it loads the
engines, says what the folder holds, dispatches the admitted rows through the row line
(line.py) and commits what comes back, reporting each commit to the job. It never writes the
job's state; the job never reads a runner's attributes.

Two runners are built in: `local.LocalRunner` (`cosybatch run`, threads on this machine) and
`ray.RayRunner` (`cosybatch ray-run`, a Ray actor pool).

For implementers: subclass `Runner` and implement every abstract method; the job calls them in
the order they are declared here (`check`, `device`, `start`, `resume`, `dispatch`, `end`), and
`close` in every case, also after a failure at any step.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..config import RunConfig
from ..corpus import Corpus
from ..errors import CorpusError
from ..qc.gate import QCCounts
from ..stats import BatchWork
from ..store.checkpoint import OutputDir, ResumeState
from .line import Admission


@dataclass
class Resumed:
    """What the output folder holds, after the runner checked (and repaired) it."""

    state: ResumeState
    committed: Optional[dict] = None  # after an accepted corpus change: committed id -> its row's source hash
    repairs: list[str] = field(default_factory=list)  # what a repair did, for stats.json
    quarantined: list[dict] = field(default_factory=list)  # {"file", "shard", "reason"}: set aside as not this job's


@dataclass
class Committed:
    """One commit, as the runner reports it to the job (which keeps the statistics)."""

    items: int = 0
    audio_s: float = 0.0
    failed: int = 0
    batches: list[BatchWork] = field(default_factory=list)  # every batch the engine ran for it
    qc: Optional[QCCounts] = None  # what the quality gate saw
    qc_s: float = 0.0
    shape_s: float = 0.0  # the clips' last stage: rate, ends, level, encoding
    write_s: float = 0.0


@dataclass
class Dispatch:
    """What the job hands the runner's `dispatch`."""

    cfg: RunConfig
    out: OutputDir
    corpus: Corpus
    admission: Admission  # which rows to make; fed in file order
    stop: threading.Event  # set on a signal, --max-runtime or --max-failures: finish what is in flight
    report: Callable[[Committed], None]  # call after every commit


@dataclass
class Dispatched:
    """How dispatching ended."""

    interrupted: bool  # a stop left work undone (a stop after the last commit interrupted nothing)
    corpus_error: Optional[CorpusError] = None  # a part of the corpus that could not be read
    read_s: float = 0.0
    prepare_s: float = 0.0


@dataclass
class Ended:
    problems: list[str] = field(default_factory=list)  # the folder changed under the run: never "complete"
    extra: dict = field(default_factory=dict)  # stats.json fields of this runner's own


class Runner(ABC):
    """See the module's docstring. A runner instance serves one job."""

    name: Optional[str] = None
    """Recorded in the job's fingerprint ("ray"), so a folder is resumed by the runner that made it;
    None for `run`."""
    stopping = "finishing the batches in flight, then stopping"
    """Logged when SIGINT or SIGTERM asks the job to stop."""

    @abstractmethod
    def check(self, cfg: RunConfig) -> RunConfig:
        """Refuse (UsageError) what this runner cannot do, before anything is written or loaded; return
        the config to run (a sharded worker's points at its own part folder)."""

    @abstractmethod
    def device(self, cfg: RunConfig) -> Optional[str]:
        """Where the engines will run, for the job's engine and voice checks (None: --device)."""

    @abstractmethod
    def start(self, cfg: RunConfig, asr_model: Optional[Path]) -> dict:
        """Load the engines (and the quality gate's ASR model, when given). Returns the default
        engine's `fingerprint()`: the job records it, and a resume must match it."""

    @abstractmethod
    def resume(self, out: OutputDir, corpus: Corpus, corpus_was: Optional[dict]) -> Resumed:
        """What the folder holds. `corpus_was` is the recorded corpus after an accepted corpus change."""

    @abstractmethod
    def dispatch(self, job: Dispatch) -> Dispatched:
        """Make and commit every row `job.admission` admits, until done or `job.stop`; call
        `job.report` after every commit. Raise on an error that must end the job."""

    @abstractmethod
    def end(self, out: OutputDir, interrupted: bool) -> Ended:
        """Close the writer; unless interrupted, write the manifest and failures file and check
        the folder."""

    @abstractmethod
    def describe(self) -> dict:
        """The engine and batching fields of stats.json (engine, voice, device, batch sizes...)."""

    def close(self) -> None:  # noqa: B027  (optional: only a runner that took something overrides it)
        """Release what `start` took (a Ray cluster). Called in every case."""
