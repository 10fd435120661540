"""Checkpoint and resume: a fingerprint of the job, an append-only journal, and the files derived
from it (manifest, failures).

Every committed batch is one fsynced journal line naming the shard, the shard's committed byte
offset and the items (or failures) it holds. A killed run therefore loses at most the batch in
flight; the rerun reads the journal, truncates the partial shard to the last committed offset and
skips every id the journal names, so nothing is lost and nothing is duplicated.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .errors import ResumeMismatchError, UsageError
from .shards import fsync_dir, shard_name


def file_fingerprint(path: Path) -> dict:
    """Identifies a (possibly multi-GB) file cheaply: its size and a hash of its first and last MiB."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read())
    return {"size": size, "sha256_head_tail": h.hexdigest()[:32]}

STATE_DIR = ".cosybatch"
JOB_FILE = "job.json"
JOURNAL_FILE = "journal.jsonl"
LOCK_FILE = "lock"
MANIFEST_FILE = "manifest.parquet"
FAILURES_FILE = "failures.jsonl"
STATS_FILE = "stats.json"
RUN_FILE = "run.json"  # under .cosybatch/: pid, start time and row total of the latest run
RAY_FAILURES_DIR = "ray-failures"  # under .cosybatch/: ray-run failure records, one file per chunk
JOB_FORMAT = 1


DUPLICATE_ID = "duplicate id; the first row with it was kept"


def keyed_by_row(failure: dict) -> bool:
    """A failure that must be skipped on resume by its row number, not its id: a row without an
    id, or a duplicate (its id belongs to the first row, which may not be committed yet)."""
    return failure["id"] is None or failure.get("reason") == DUPLICATE_ID


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name, fsync, rename: readers see the old file or the new, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def jsonl_bytes(records) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


@dataclass
class ResumeState:
    """What the journal says is already done."""

    done_ids: set = field(default_factory=set)  # written or failed; never redone
    failed_rows: set = field(default_factory=set)  # failures keyed by row: no id, or a duplicate id
    items: int = 0
    failures: int = 0
    audio_s: float = 0.0
    open_shard: Optional[int] = None  # shard with committed items that is not closed yet
    open_offset: int = 0
    open_items: int = 0
    next_shard: int = 0


class Journal:
    """Append-only JSON lines, each fsynced. A torn last line (killed mid-write) is cut off."""

    def __init__(self, path: Path):
        self.path = path
        records, good_bytes = self._scan(path)
        self.records_at_open = records
        if path.exists() and path.stat().st_size != good_bytes:
            with open(path, "r+b") as f:
                f.truncate(good_bytes)
        created = not path.exists()
        self._file = open(path, "ab")
        if created:
            fsync_dir(path.parent)

    @staticmethod
    def _scan(path: Path) -> tuple[int, int]:
        records = good = 0
        if not path.exists():
            return 0, 0
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                try:
                    json.loads(line)
                except ValueError:
                    break
                records += 1
                good += len(line)
        return records, good

    @staticmethod
    def read(path: Path) -> Iterator[dict]:
        if not path.exists():
            return
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    return
                try:
                    yield json.loads(line)
                except ValueError:
                    return

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class OutputDir:
    """The output folder of one job: shards at the top, bookkeeping under `.cosybatch/`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.state = self.root / STATE_DIR
        self.job_file = self.state / JOB_FILE
        self.journal_path = self.state / JOURNAL_FILE
        self._lock_fd: Optional[int] = None

    # -- ownership ---------------------------------------------------------------------------
    def lock(self) -> None:
        """One writer per folder. flock dies with its process, so a killed run leaves no stale lock."""
        self.state.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"{self.root} is in use by another cosybatch run; wait for it, "
                             "or write to another --out folder") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)  # no pid: `cosybatch status` shows the job as not running
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- the job fingerprint -----------------------------------------------------------------
    def check_or_start(self, fingerprint: dict, restart: bool) -> bool:
        """Start a new job or check that this one continues the recorded one. Returns True when
        resuming. Refuses with a list of differences unless `restart`."""
        if restart:
            self.clear()
        if self.job_file.exists():
            recorded = json.loads(self.job_file.read_text())
            old = recorded.get("fingerprint", {})
            diffs = _differences(old, fingerprint)
            if diffs:
                raise ResumeMismatchError(
                    f"{self.root} holds a run with different settings: " + "; ".join(diffs)
                    + ". Rerun with the same settings to resume, pass --restart to delete that "
                    "output and start over, or choose another --out folder."
                )
            return True
        if any(self.root.glob("shard-*.tar*")):
            raise ResumeMismatchError(f"{self.root} holds shards but no cosybatch job record; "
                                      "choose an empty --out folder or pass --restart")
        write_atomic(self.job_file, json_bytes({"format": JOB_FORMAT, "created": time.time(),
                                                "fingerprint": fingerprint}))
        return False

    def clear(self) -> None:
        """Delete only what cosybatch writes: shards, manifest, failures, stats, exports, job state."""
        import shutil

        for pattern in ("shard-*.tar", "shard-*.tar.partial", MANIFEST_FILE, FAILURES_FILE, STATS_FILE):
            for path in self.root.glob(pattern):
                path.unlink()
        shutil.rmtree(self.root / "exports", ignore_errors=True)
        shutil.rmtree(self.state / RAY_FAILURES_DIR, ignore_errors=True)
        for name in (JOB_FILE, JOURNAL_FILE, RUN_FILE):
            (self.state / name).unlink(missing_ok=True)

    # -- resume ------------------------------------------------------------------------------
    def resume_state(self) -> ResumeState:
        state = ResumeState()
        open_shards: dict[int, tuple[int, int]] = {}  # shard -> (committed offset, items)
        closed: set[int] = set()
        for rec in Journal.read(self.journal_path):
            kind = rec.get("t")
            if kind == "items":
                shard = rec["shard"]
                prev = open_shards.get(shard, (0, 0))
                open_shards[shard] = (rec["end"], prev[1] + len(rec["items"]))
                for item in rec["items"]:
                    state.done_ids.add(item["id"])
                    state.items += 1
                    state.audio_s += item["duration_s"]
                state.next_shard = max(state.next_shard, shard + 1)
            elif kind == "failed":
                for item in rec["items"]:
                    if keyed_by_row(item):
                        state.failed_rows.add(item["row"])
                    else:
                        state.done_ids.add(item["id"])
                    state.failures += 1
            elif kind == "closed":
                closed.add(rec["shard"])
                state.next_shard = max(state.next_shard, rec["shard"] + 1)
        for shard, (offset, items) in sorted(open_shards.items()):
            if shard in closed:
                continue
            final = self.root / shard_name(shard)
            if final.exists():
                # Killed between the rename and its journal line: the shard is whole.
                closed.add(shard)
                continue
            state.open_shard, state.open_offset, state.open_items = shard, offset, items
        # A partial shard the journal never mentions holds nothing committed.
        for partial in self.root.glob("shard-*.tar.partial"):
            idx = int(partial.name[len("shard-"):].split(".")[0])
            if idx != state.open_shard and idx not in closed:
                partial.unlink()
        return state

    # -- derived files -----------------------------------------------------------------------
    def write_manifest(self) -> int:
        """manifest.parquet: every committed item and its shard, in commit order."""
        records = ({**item, "shard": shard_name(rec["shard"])}
                   for rec in Journal.read(self.journal_path) if rec.get("t") == "items" for item in rec["items"])
        return write_manifest_table(self.root, records)

    def write_failures(self) -> int:
        failures = [item for rec in Journal.read(self.journal_path) if rec.get("t") == "failed"
                    for item in rec["items"]]
        path = self.root / FAILURES_FILE
        if failures or path.exists():
            write_atomic(path, jsonl_bytes(failures))
        return len(failures)


MANIFEST_COLUMNS = (("key", "string"), ("id", "string"), ("shard", "string"), ("text", "string"),
                    ("voice", "string"), ("duration_s", "float64"), ("num_samples", "int64"),
                    ("sample_rate", "int32"), ("row", "int64"))


def write_manifest_table(root: Path, records) -> int:
    """Write ROOT/manifest.parquet (atomically) from item records with MANIFEST_COLUMNS keys."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols: dict[str, list] = {name: [] for name, _ in MANIFEST_COLUMNS}
    for record in records:
        for name in cols:
            cols[name].append(record[name])
    schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in MANIFEST_COLUMNS])
    table = pa.table(cols, schema=schema)
    tmp = root / f".{MANIFEST_FILE}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, root / MANIFEST_FILE)
    return table.num_rows


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            diffs.append(f"{prefix}{key} was {a!r}, now {b!r}")
    return diffs
