"""Checkpoint and resume: a fingerprint of the job, an append-only journal, and the files derived
from it (manifest, failures).

Every committed batch is one fsynced journal line naming the shard, the shard's committed byte
offset and the items (or failures) it holds. A killed run therefore loses at most the batch in
flight; the rerun reads the journal, truncates the partial shard to the last committed offset and
skips every id the journal names, so nothing is lost and nothing is duplicated.

A rerun also checks what it resumes from (`repair.py`): shards the journal counts on must exist
and be long enough, and a journal that lost its tail must not forget audio a finished shard still
holds. `Ledger` is the journal replayed: which ids are committed, in which shard, and how long
each shard must be.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import BinaryIO, Optional

from ..cache import file_fingerprint, file_sha256  # noqa: F401  (re-exported: fingerprints of the job)
from ..errors import OutputError, ResumeMismatchError, UsageError
from .items import QC_COLUMNS
from .shards import fsync_dir, shard_name
from .tables import records_table

STATE_DIR = ".cosybatch"
JOB_FILE = "job.json"
JOURNAL_FILE = "journal.jsonl"
LOCK_FILE = "lock"
LEASE_FILE = "lease.json"  # under .cosybatch/ in a store: which run writes it now (objects.py)
MANIFEST_FILE = "manifest.parquet"
FAILURES_FILE = "failures.jsonl"
STATS_FILE = "stats.json"
RUN_FILE = "run.json"  # under .cosybatch/: pid, start time and row total of the latest run
RAY_FAILURES_DIR = "ray-failures"  # under .cosybatch/: ray-run failure records, one file per chunk
RAY_ITEMS_DIR = "ray-items"  # under .cosybatch/: a store's ray-run shards' item records, one file per chunk
DAMAGED_DIR = "damaged"  # under .cosybatch/: shards a rerun could not use, kept for inspection
QUARANTINE_DIR = "quarantine"  # under .cosybatch/: bytes that are not this job's (foreign shards), set aside
STORED_FILE = "stored.json"  # under .cosybatch/: shards committed to the job's object store, index -> size (objects.py)
CORPUS_CHANGES_FILE = "corpus_changes.jsonl"  # committed ids whose row changed or went (--allow-corpus-change)
JOB_FORMAT = 1


DUPLICATE_ID = "duplicate id; the first row with it was kept"


def keyed_by_row(failure: dict) -> bool:
    """A failure that must be skipped on resume by its row number, not its id: a row without an
    id, or a duplicate (its id belongs to the first row, which may not be committed yet)."""
    return failure["id"] is None or failure.get("reason") == DUPLICATE_ID


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name, fsync, rename: readers see the old file or the new, never half."""
    with atomic_file(path) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A new file written at `.NAME.tmp` beside `path`, fsynced and renamed over `path` when the
    block ends without an error (the temporary file is removed when it raises).

    Nothing found in the folder can redirect the write: whatever lies at the temporary name (a
    file left by a killed write, a symbolic link planted there) is unlinked, never opened, and the
    file is created with O_CREAT|O_EXCL|O_NOFOLLOW, so it is always a new regular file inside the
    folder. The rename replaces the final name itself, a link there included, never its target."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        os.unlink(tmp)  # a link is removed, not followed; a stale file of a killed write goes too
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise OutputError(f"{tmp} is a folder where cosybatch writes its temporary file for {path.name}; "
                          "remove it, then rerun") from None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    if not stat.S_ISREG(os.lstat(path).st_mode):  # a rename cannot leave one, unless the folder changed under us
        raise OutputError(f"{path} is not a regular file after it was written; something else writes this "
                          "folder: stop it, then rerun")


def jsonl_bytes(records) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


EOA_BYTES = 1024  # the two zero blocks that end a tar archive


@dataclass
class ShardState:
    """One shard as the journal describes it."""

    end: int = 0  # bytes of committed members: the last `items` (or `lost`) record's `end`
    closed: bool = False  # a `closed` record was written: the file is shard-NNNNNN.tar, end + EOA long


@dataclass
class Ledger:
    """The journal replayed: which ids are committed, where, and what each shard must hold.

    Record kinds: `items` (a committed batch: shard, its new end offset, item records), `failed`
    (failure records), `closed` (the shard was finished and renamed), `lost` (the shard now ends
    at `end`; the listed ids are no longer in it, a rerun synthesises them again), `retry_failures`
    (the corpus changed: the failures before it no longer count, their rows are tried again)."""

    shards: dict[int, ShardState] = field(default_factory=dict)
    live: dict = field(default_factory=dict)  # id -> (journal line, shard, duration_s)
    failed_ids: set = field(default_factory=set)  # failed by id: never redone
    failed_rows: set = field(default_factory=set)  # failures keyed by row: no id, or a duplicate id
    failures: int = 0

    @classmethod
    def replay(cls, journal_path: Path) -> Ledger:
        ledger = cls()
        for line, rec in enumerate(Journal.read(journal_path)):
            kind = rec.get("t")
            if kind == "items":
                shard = ledger.shards.setdefault(rec["shard"], ShardState())
                shard.end = rec["end"]
                for item in rec["items"]:
                    ledger.live[item["id"]] = (line, rec["shard"], item["duration_s"])
            elif kind == "failed":
                for item in rec["items"]:
                    if keyed_by_row(item):
                        ledger.failed_rows.add(item["row"])
                    else:
                        ledger.failed_ids.add(item["id"])
                    ledger.failures += 1
            elif kind == "closed":
                ledger.shards.setdefault(rec["shard"], ShardState()).closed = True
            elif kind == "retry_failures":
                ledger.failed_ids, ledger.failed_rows, ledger.failures = set(), set(), 0
            elif kind == "lost":
                ledger.shards.setdefault(rec["shard"], ShardState()).end = rec["end"]
                for item_id in rec["ids"]:
                    if ledger.live.get(item_id, (0, None))[1] == rec["shard"]:
                        del ledger.live[item_id]
        return ledger

    @cached_property
    def _counts(self) -> Counter:
        return Counter(s for _, s, _ in self.live.values())

    def items_in(self, shard: int) -> int:
        """Live items in one shard (counted once per replay: callers ask for every shard)."""
        return self._counts[shard]

    def audio_s(self) -> float:
        return sum(d for _, _, d in self.live.values())


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
    """Append-only JSON lines, each fsynced. A torn last line (killed mid-write) is cut off; so is
    anything after a damaged line, which `dropped` then describes (the repair that follows
    recovers what finished shards still hold)."""

    def __init__(self, path: Path):
        self.path = path
        records, good_bytes = self._scan(path)
        self.records_at_open = records
        self.dropped: Optional[str] = None
        if path.exists() and path.stat().st_size != good_bytes:
            with open(path, "r+b") as f:
                f.seek(good_bytes)
                tail = f.read()
                f.truncate(good_bytes)
            lines = tail.count(b"\n")
            if lines:  # more than the torn last line of a killed write
                self.dropped = (f"{path.name} line {records + 1} was damaged; it and the "
                                f"{lines - 1} lines after it ({len(tail)} B) were dropped")
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
                    if not _well_formed(json.loads(line)):
                        break
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
                    record = json.loads(line)
                except ValueError:
                    return
                if not _well_formed(record):
                    return
                yield record

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
        # Called with a shard's index once it is sealed (closed and journaled): a run to object
        # storage uploads it then (objects.ObjectSink). None for a folder.
        self.sealed_hook: Optional[Callable[[int], None]] = None

    def stored(self) -> dict[int, int]:
        """Shards that live in the job's object store, not here: index -> size in the store. Empty
        for a folder; a staging folder's (or a store's materialised view's) from objects.py."""
        try:
            found = json.loads((self.state / STORED_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return {int(k): int(v) for k, v in found.items()} if isinstance(found, dict) else {}

    def set_stored(self, stored: dict[int, int]) -> None:
        """Record which shards live in the job's object store (index -> size), for `stored`."""
        write_atomic(self.state / STORED_FILE, json_bytes({str(k): v for k, v in stored.items()}))

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
        self._lock_fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())

    def lock_held(self) -> bool:
        """Is a run writing this folder now? A shared, non-blocking probe released at once; it
        tells the truth across hosts and containers, where a pid in the file says nothing. For a
        local view of a job in object storage: is the store's lease fresh (`leased`)?"""
        if self.leased():
            return True
        try:
            fd = os.open(self.state / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing releases the probe lock
        return False

    def leased(self, now: Optional[float] = None) -> bool:
        """A view of a job in object storage (objects.py) whose lease a run renewed lately (within
        two of its terms): being written now. Judged by this machine's clock against the writer's."""
        try:
            lease = json.loads((self.state / LEASE_FILE).read_text())
        except (OSError, ValueError):
            return False
        written, seconds = (lease.get("written"), lease.get("seconds")) if isinstance(lease, dict) else (None, None)
        return isinstance(written, (int, float)) and isinstance(seconds, (int, float)) and \
            (time.time() if now is None else now) - written < 2 * seconds

    def unlock(self) -> None:
        if self._lock_fd is not None:
            try:
                os.ftruncate(self._lock_fd, 0)  # no pid: `cosybatch status` shows the job as not running
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    # -- the job fingerprint -----------------------------------------------------------------
    def recorded(self) -> Optional[dict]:
        """job.json as written when the job started, or None for a new folder."""
        return json.loads(self.job_file.read_text()) if self.job_file.exists() else None

    def check_or_start(self, fingerprint: dict, restart: bool, allow_corpus_change: bool = False) -> Optional[dict]:
        """Start a new job or check that this one continues the recorded one.

        Returns None for a new job, else the corpus fingerprint the job had before when the
        corpus changed (and `allow_corpus_change` accepts that), else {} when nothing changed.
        Other differences are refused with a list of them unless `restart`."""
        if restart:
            self.clear()
        recorded = self.recorded()
        if recorded is not None:
            old = recorded.get("fingerprint", {})
            diffs = differences(old, fingerprint)
            corpus_only = bool(diffs) and all(d.startswith("corpus.") for d in diffs)
            if corpus_only and allow_corpus_change:
                history = [*recorded.get("corpus_history", []), {"changed": time.time(), "was": old.get("corpus"),
                                                                 "now": fingerprint.get("corpus"), "reported": False}]
                write_atomic(self.job_file, json_bytes({**recorded, "fingerprint": fingerprint,
                                                        "corpus_history": history}))
                return old.get("corpus") or {}
            if diffs:
                raise ResumeMismatchError(mismatch_message(self.root, old, fingerprint, diffs, corpus_only))
            return {}
        if any(self.root.glob("shard-*.tar*")):
            raise ResumeMismatchError(f"{self.root} holds shards but no cosybatch job record "
                                      f"({STATE_DIR}/{JOB_FILE}); choose an empty --out folder (--restart would "
                                      "delete those shards)")
        write_atomic(self.job_file, json_bytes({"format": JOB_FORMAT, "created": time.time(),
                                                "fingerprint": fingerprint}))
        return None

    def unreported_corpus_change(self) -> Optional[dict]:
        """The corpus the job had before a change whose corpus_changes.jsonl was not written yet
        (the run that accepted the change was interrupted), else None."""
        history = (self.recorded() or {}).get("corpus_history") or []
        return (history[-1].get("was") or {}) if history and history[-1].get("reported") is False else None

    def corpus_change_reported(self) -> None:
        recorded = self.recorded()
        if recorded and recorded.get("corpus_history"):
            recorded["corpus_history"][-1]["reported"] = True
            write_atomic(self.job_file, json_bytes(recorded))

    def clear(self) -> None:
        """Delete only what cosybatch writes: shards, manifest, failures, stats, exports, job state."""
        import shutil

        for pattern in ("shard-*.tar", "shard-*.tar.partial", MANIFEST_FILE, FAILURES_FILE, STATS_FILE,
                        CORPUS_CHANGES_FILE):
            for path in self.root.glob(pattern):
                path.unlink()
        shutil.rmtree(self.root / "exports", ignore_errors=True)
        shutil.rmtree(self.state / RAY_FAILURES_DIR, ignore_errors=True)
        shutil.rmtree(self.state / RAY_ITEMS_DIR, ignore_errors=True)
        shutil.rmtree(self.state / DAMAGED_DIR, ignore_errors=True)
        shutil.rmtree(self.state / QUARANTINE_DIR, ignore_errors=True)
        for name in (JOB_FILE, JOURNAL_FILE, RUN_FILE, STORED_FILE):
            (self.state / name).unlink(missing_ok=True)

    # -- resume ------------------------------------------------------------------------------
    def resume_state(self, ledger: Optional[Ledger] = None) -> ResumeState:
        """Where to go on from. Run `repair.repair` first: this trusts the files to match the journal."""
        ledger = ledger or Ledger.replay(self.journal_path)
        state = ResumeState(done_ids=set(ledger.live) | ledger.failed_ids, failed_rows=ledger.failed_rows,
                            items=len(ledger.live), failures=ledger.failures, audio_s=ledger.audio_s())
        on_disk = shard_indices(self.root)
        state.next_shard = max([*ledger.shards, *on_disk, -1]) + 1
        for index in sorted(ledger.shards, reverse=True):
            shard = ledger.shards[index]
            if not shard.closed and not (self.root / shard_name(index)).exists():
                state.open_shard, state.open_offset = index, shard.end
                state.open_items = ledger.items_in(index)
                break
        # A partial shard the journal does not count on holds nothing committed.
        for partial in self.root.glob("shard-*.tar.partial"):
            index = _shard_index(partial.name)
            if index is not None and index != state.open_shard:
                partial.unlink()
        return state

    # -- derived files -----------------------------------------------------------------------
    def live_items(self, ledger: Optional[Ledger] = None) -> Iterator[dict]:
        """Every committed item record with its shard, in commit order."""
        ledger = ledger or Ledger.replay(self.journal_path)
        for line, rec in enumerate(Journal.read(self.journal_path)):
            if rec.get("t") == "items":
                for item in rec["items"]:
                    if ledger.live.get(item["id"], (None,))[0] == line:
                        yield {**item, "shard": shard_name(rec["shard"])}

    def write_manifest(self, ledger: Optional[Ledger] = None) -> int:
        """manifest.parquet: every committed item and its shard, in commit order."""
        return write_manifest_table(self.root, self.live_items(ledger))

    def write_failures(self) -> int:
        failures: list[dict] = []
        for rec in Journal.read(self.journal_path):
            if rec.get("t") == "failed":
                failures += rec["items"]
            elif rec.get("t") == "retry_failures":
                failures = []
        path = self.root / FAILURES_FILE
        if failures or path.exists():
            write_atomic(path, jsonl_bytes(failures))
        return len(failures)


_FIELDS = {"items": {"shard": int, "end": int, "items": list}, "failed": {"items": list},
           "closed": {"shard": int}, "lost": {"shard": int, "end": int, "ids": list}, "retry_failures": {}}
_ITEM_FIELDS = {"id": str, "duration_s": (int, float)}


def _well_formed(record) -> bool:
    """A journal line a replay can trust: a known kind with its fields of the right types. A line
    that parses as JSON but is not one (a flipped bit in a key) counts as damaged, like one that
    does not parse."""
    if not isinstance(record, dict) or record.get("t") not in _FIELDS:
        return False
    fields = _FIELDS[record["t"]]
    if not all(isinstance(record.get(k), kind) and not isinstance(record.get(k), bool) for k, kind in fields.items()):
        return False
    if record["t"] == "items":
        return all(isinstance(i, dict) and all(isinstance(i.get(k), kind) for k, kind in _ITEM_FIELDS.items())
                   for i in record["items"])
    if record["t"] == "failed":
        return all(isinstance(i, dict) and "id" in i and isinstance(i.get("row"), int) for i in record["items"])
    return True


def _shard_index(name: str) -> Optional[int]:
    """NNNNNN of shard-NNNNNN.tar(.partial); None for other names (ray-run's hashed shards)."""
    match = re.fullmatch(r"shard-(\d{6,})\.tar(?:\.partial)?", name)
    return int(match.group(1)) if match else None


def shard_indices(root: Path) -> dict[int, Path]:
    """Finished shards on disk by index."""
    found = {}
    for path in root.glob("shard-*.tar"):
        index = _shard_index(path.name)
        if index is not None:
            found[index] = path
    return found


MANIFEST_COLUMNS = (("key", "string"), ("id", "string"), ("shard", "string"), ("text", "string"),
                    ("voice", "string"), ("duration_s", "float64"), ("num_samples", "int64"),
                    ("sample_rate", "int32"), ("row", "int64"))
# Columns a manifest has only when some item has the field (so a job without them keeps the schema).
# wav_sha256: the sha256 of the item's audio member (hex; KEY.wav, or KEY.flac ... whatever its format: the name
# predates the other formats); items written before it was recorded have none.
# format: the audio member's format (store/audio.py) when not wav; loudness_lufs: with --loudness, as measured.
# qc_*: the quality gate's columns (cosybatch.store.items.QC_COLUMNS), for items measured by it.
# speaker, prompt: the voice pool's speaker or prompt a row was given; language: the row's language column.
OPTIONAL_MANIFEST_COLUMNS = (("instruct", "string"), ("wav_sha256", "string"), ("speaker", "string"),
                             ("prompt", "string"), ("language", "string"), ("format", "string"),
                             ("loudness_lufs", "float64"), *QC_COLUMNS)


def write_manifest_table(root: Path, records) -> int:
    """Write ROOT/manifest.parquet (atomically) from item records with MANIFEST_COLUMNS keys (and
    OPTIONAL_MANIFEST_COLUMNS where some record has them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = list(records)
    columns = MANIFEST_COLUMNS + tuple(c for c in OPTIONAL_MANIFEST_COLUMNS if any(c[0] in r for r in records))
    schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in columns])
    optional = columns[len(MANIFEST_COLUMNS):]
    rows = ({**{name: r[name] for name, _ in MANIFEST_COLUMNS}, **{name: r.get(name) for name, _ in optional}}
            for r in records)  # a record without a required column raises, as before
    table = records_table(schema, rows)
    with atomic_file(root / MANIFEST_FILE) as f:
        pq.write_table(table, f)
    return table.num_rows


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """'key was A, now B' for every (nested) key whose value differs."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(differences(a, b, f"{prefix}{key}."))
        elif a != b:
            diffs.append(f"{prefix}{key} was {a!r}, now {b!r}")
    return diffs


def mismatch_message(root: Path, old: dict, new: dict, diffs: list[str], corpus_only: bool) -> str:
    """Why a run is refused the folder: first one sentence in the terms a user chose (engine,
    voice, corpus, device), then every difference, then what to do. --restart is only ever named
    with what it deletes."""
    lines = [f"{root}: {_headline(old, new, diffs)}.", "Differences: " + "; ".join(diffs) + "."]
    if corpus_only:
        lines.append("To go on with this corpus and keep the committed audio, rerun with --allow-corpus-change: "
                     "committed ids are kept, new ids are synthesised, and committed ids whose row changed are "
                     "listed in corpus_changes.jsonl. Or choose another --out folder.")
    else:
        lines.append("Rerun with the job's settings to resume it, or choose another --out folder for this run.")
    lines.append(f"(--restart would DELETE the audio already in {root} and start that job over.)")
    return "\n".join(lines)


def _headline(old: dict, new: dict, diffs: list[str]) -> str:
    def at(fp: dict, *keys):
        for key in keys:
            fp = fp.get(key) if isinstance(fp, dict) else None
        return fp

    def job_kind(fp: dict) -> str:
        return "ray-run" if fp.get("runner") == "ray" else "run"

    for keys, say in (
        (("engine", "engine"), "this folder holds a {old} job; this run asks for {new}"),
        (("engine", "voice"), "this folder holds audio in voice {old}; this run asks for voice {new}"),
        (("corpus", "name"), "this folder was made from {old}; this run reads {new}"),
        (("shard",), "this folder holds shard {old} of a job; this run is shard {new}"),
        (("engine", "device"), "this folder's audio was made on {old}; this run would use {new}"),
    ):
        a, b = at(old, *keys), at(new, *keys)
        if a != b:
            return say.format(old=a if a is not None else "(none)", new=b if b is not None else "(none)")
    if job_kind(old) != job_kind(new):
        return f"this folder holds a `cosybatch {job_kind(old)}` job; this is `cosybatch {job_kind(new)}`"
    if all(d.startswith("corpus.") for d in diffs):
        parts = _parts_changed(at(old, "corpus", "parts"), at(new, "corpus", "parts"))
        if parts:
            return f"this folder was made from another version of the corpus {at(new, 'corpus', 'name')} ({parts})"
        return f"this folder was made from another version of the corpus ({at(new, 'corpus', 'name')} changed)"
    names = sorted({d.split(" was ", 1)[0].rsplit(".", 1)[-1] for d in diffs})
    return "this run's settings differ from the job in this folder: " + ", ".join(names)


def _parts_changed(old, new, shown: int = 5) -> Optional[str]:
    """Which parts of a corpus of parts were added, removed or changed ("part b.parquet changed,
    part d.parquet added"), at most `shown` of each named; None unless both are corpora of parts."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None
    said = []
    for what, names in (("changed", sorted(n for n in new if n in old and new[n] != old[n])),
                        ("added", sorted(n for n in new if n not in old)),
                        ("removed", sorted(n for n in old if n not in new))):
        if names:
            listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
            said.append(f"{'parts' if len(names) > 1 else 'part'} {listed} {what}")
    return "; ".join(said) or None
