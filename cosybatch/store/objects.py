"""Datasets in object storage (`--out s3://BUCKET/PREFIX`, `gs://...`), written exactly once.

A run to a store works in a local staging folder, an ordinary output folder (journal, open
shard, repair: everything `checkpoint.py` and `repair.py` say holds there too), and the store is
where the job lives. Under the prefix, laid out like a folder:

    shard-NNNNNN.tar                    sealed shards, each uploaded whole, then committed
    .cosybatch/job.json                 the job's record, as in a folder
    .cosybatch/commits/NNNNNNNN.jsonl   the journal, in segments (below)
    .cosybatch/commits/upto-N.jsonl     a checkpoint: segments 0..N-1 as one object
    .cosybatch/lease.json               which run writes the prefix now (below)
    manifest.parquet, failures.jsonl, stats.json, README.md, report.html, exports/...  at the end

**Exactly once.** A shard is sealed in staging (end-of-archive, fsync, rename, its `closed`
journal line), then uploaded as one object, its size checked, and only then committed: segment
K of the journal is written, holding the staging journal's lines from the end of segment K-1 to
that `closed` line. A store's journal is its segments read in order; a shard object that no
segment names (an upload killed before its commit) is never read as a shard, and the run that
makes that shard again overwrites it. Every CHECKPOINT_EVERY commits, and at the end of a
complete run, the journal so far is written as one object and the segments it holds are deleted,
so that a resume reads a checkpoint and a few segments, not one object per shard. An upload that
dies half way leaves no object at all (S3's multipart uploads are invisible until completed;
pyarrow aborts them on an error). So a
kill -9 at any moment loses at most the shards not yet committed: on this machine the staging
folder still holds them and the rerun uploads them; on a fresh machine the rerun rebuilds its
staging journal from the segments and makes their rows again.

**One writer.** `.cosybatch/lease.json` names the run writing the prefix (an owner id, host,
pid) and a counter it bumps every lease_s/3 seconds. A run that finds someone else's lease
watches it for lease_s: if the counter moves, the holder is alive and the run is refused; if it
does not, the holder is gone and the lease is taken over. After writing its lease a run reads it
back, and it reads it again before every commit, so a run that lost its lease (paused past
lease_s while another took over) stops before it commits anything. pyarrow's S3 client has no
conditional write (If-None-Match), so two runs starting within one read-back of each other are
not excluded by the store itself; the read-back and the check before each commit make that
window small, and the commit check makes the loser stop before committing.

Credentials and endpoints are the usual ones (`sources.store_for`); nothing about them is
recorded.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

from ..cache import cache_root
from ..errors import OutputError, UsageError
from ..sources import check_bucket, is_uri, redacted, store_error, store_for
from .checkpoint import (
    JOB_FILE,
    LEASE_FILE,
    MANIFEST_FILE,
    RAY_FAILURES_DIR,
    RAY_ITEMS_DIR,
    RUN_FILE,
    STATE_DIR,
    Journal,
    Ledger,
    OutputDir,
    json_bytes,
    shard_indices,
    write_atomic,
)
from .shards import shard_name
from .tables import read_parquet

log = logging.getLogger("cosybatch")

COMMITS = f"{STATE_DIR}/commits"
LEASE = f"{STATE_DIR}/{LEASE_FILE}"
CHUNK = 8 << 20  # bytes a transfer moves at a time
CLIP_RANGE = 64 << 20  # the most bytes the report reads from a store for one clip (its batch's span)
READERS = 32  # small objects (commit segments, the end's files) sent or read at once
READ_BACK_S = 0.5  # after writing its lease, a run reads it back no sooner than this
_SEGMENT = re.compile(r"(\d{8})\.jsonl")
_CHECKPOINT = re.compile(r"upto-(\d{8})\.jsonl")
CHECKPOINT_EVERY = 256  # commit segments between checkpoints of the whole journal: a resume reads at most this many
_SHARD = re.compile(r"shard-(\d{6,}|[0-9a-f]{20})\.tar")  # run's numbered shards, ray-run's hashed ones
# What the end of a run uploads besides the shards (when present in staging), and the folder of exports.
DERIVED = ("manifest.parquet", "failures.jsonl", "stats.json", "README.md", "report.html",
           "corpus_changes.jsonl", f"{STATE_DIR}/run.json")


def default_staging(uri: str) -> Path:
    """Where a run to `uri` stages its work unless --staging says: under the user's cache, one
    folder per store prefix (its last name and a hash of the whole URI)."""
    import hashlib

    from ..sources import endpoint_url

    clean = uri.rstrip("/")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", clean.rsplit("/", 1)[-1])[:40] or "store"
    where = f"{endpoint_url() or ''} {clean}"  # one bucket name in two stores is two datasets
    return cache_root() / "staging" / f"{name}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"


class Store:
    """One prefix of an object store, through pyarrow.fs: names are relative to the prefix."""

    def __init__(self, uri: str):
        if not is_uri(uri):
            raise UsageError(f"{uri!r} is not a store URI (s3://BUCKET/PREFIX, gs://BUCKET/PREFIX)")
        self.uri = uri.rstrip("/")
        self.shown = redacted(self.uri)
        self.fs, self.base = store_for(self.uri)
        self.bucket = self.base.split("/", 1)[0]
        if not self.bucket or "/" not in self.base:
            raise UsageError(f"{self.shown}: name a bucket and a prefix in it (s3://BUCKET/PREFIX): the "
                             "dataset's objects go under the prefix")

    def key(self, name: str) -> str:
        return f"{self.base}/{name}"

    def check(self) -> None:
        """The bucket exists and these credentials can list it (UsageError, exit 2, before any work)."""
        check_bucket(self.fs, self.uri, self.bucket, "reach the dataset")
        try:
            self.fs.get_file_info(self.key(f"{STATE_DIR}/{JOB_FILE}"))  # a request under the prefix itself
        except OSError as exc:
            raise store_error(self.uri, self.bucket, exc, "reach the dataset") from None

    def read(self, name: str) -> Optional[bytes]:
        try:
            with self.fs.open_input_stream(self.key(name), compression=None) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        with self._output(name) as f:
            f.write(data)

    def upload(self, path: Path, name: str) -> int:
        """A local file as one object (a multipart upload for a large one); its size."""
        with open(path, "rb") as src, self._output(name) as dst:
            while chunk := src.read(CHUNK):
                dst.write(chunk)
        return os.path.getsize(path)

    @contextlib.contextmanager
    def _output(self, name: str):
        stream = self.fs.open_output_stream(self.key(name), compression=None)  # never gzipped by a .gz name
        try:
            yield stream
        except BaseException:
            with contextlib.suppress(Exception):
                stream.abort()  # a multipart upload is dropped, never completed half-written
            raise
        stream.close()

    def download(self, name: str, path: Path) -> None:
        """An object to a local file (written beside it, then renamed: never half a file)."""
        tmp = path.with_name(f".{path.name}.download")
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.fs.open_input_stream(self.key(name), compression=None) as src, open(tmp, "wb") as dst:
            while chunk := src.read(CHUNK):
                dst.write(chunk)
        os.replace(tmp, path)

    def list(self, under: str = "") -> dict[str, int]:
        """name -> size of every object under `under` (recursively)."""
        return {name: size for name, (size, _) in self.listing(under).items()}

    def listing(self, under: str = "") -> dict[str, tuple[int, Optional[float]]]:
        """name -> (size, last modified as a Unix time, or None) of every object under `under`."""
        from pyarrow import fs as pafs

        root = self.key(under).rstrip("/") if under else self.base
        infos = self.fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        # S3 gives whole seconds: the object was written by the end of that second.
        return {i.path[len(self.base) + 1:]: (i.size, i.mtime.timestamp() + (0.999 if i.mtime.microsecond == 0 else 0)
                                              if i.mtime else None)
                for i in infos if i.type == pafs.FileType.File}

    def size(self, name: str) -> Optional[int]:
        from pyarrow import fs as pafs

        info = self.fs.get_file_info(self.key(name))
        return info.size if info.type == pafs.FileType.File else None

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.key(name))


# -- the store's journal -------------------------------------------------------------------------


def journal_objects(store: Store, listed: Optional[dict[str, int]] = None) -> tuple[list[str], int]:
    """(the objects that hold the store's journal, in order; the next segment's number): the
    newest checkpoint (`upto-N.jsonl`: segments 0..N-1 in one object), then the segments from N
    on. A gap ends the journal: what follows it was never committed in sequence. `listed`: the
    prefix's listing, when the caller has it."""
    listed = store.list(COMMITS) if listed is None else listed
    names = [n.rsplit("/", 1)[-1] for n in listed if n.startswith(f"{COMMITS}/")]
    checkpoints = sorted(int(m.group(1)) for n in names if (m := _CHECKPOINT.fullmatch(n)))
    start = checkpoints[-1] if checkpoints else 0
    found = sorted(seq for n in names if (m := _SEGMENT.fullmatch(n)) and (seq := int(m.group(1))) >= start)
    objects = [f"{COMMITS}/upto-{start:08d}.jsonl"] if checkpoints else []
    seq = start
    for seq_found in found:
        if seq_found != seq:
            log.warning("%s: commit segment %08d is missing; the segments after it are ignored", store.shown, seq)
            break
        objects.append(f"{COMMITS}/{seq:08d}.jsonl")
        seq += 1
    return objects, seq


def store_journal(store: Store, listed: Optional[dict[str, int]] = None) -> tuple[bytes, int]:
    """(the store's journal, the next segment's number), its objects read READERS at a time."""
    from concurrent.futures import ThreadPoolExecutor

    names, seq = journal_objects(store, listed)
    with ThreadPoolExecutor(READERS) as pool:
        return b"".join(data or b"" for data in pool.map(store.read, names)), seq


def stored_shards(journal: bytes, listed: dict[str, int]) -> dict[int, int]:
    """index -> size in the store of every shard the journal closed (the size as listed; 0 when
    the object is missing, which `check_sizes` and `verify` then report)."""
    closed = {rec["shard"] for rec in _records(journal) if rec.get("t") == "closed"}
    return {index: listed.get(shard_name(index), 0) for index in sorted(closed)}


def _records(journal: bytes) -> Iterator[dict]:
    for line in journal.splitlines():
        with contextlib.suppress(ValueError):
            yield json.loads(line)


def materialise(store: Store, folder: Path, shards: bool = False) -> OutputDir:
    """The job in `store` as a local output folder: job.json, the journal rebuilt from the
    segments, the files written at the end, the stored shards' sizes (`.cosybatch/stored.json`),
    and with `shards` the shards themselves. For the commands that read a job (status, verify,
    merge, export, qc); a file already there with the object's size and time is not fetched again."""
    folder.mkdir(parents=True, exist_ok=True)
    out = OutputDir(folder)
    out.state.mkdir(exist_ok=True)
    info = store.listing()
    listed = {name: size for name, (size, _) in info.items()}
    journal, _ = store_journal(store, listed)
    write_atomic(out.journal_path, journal)
    stored = stored_shards(journal, listed)
    out.set_stored(stored)
    (folder / LEASE).unlink(missing_ok=True)
    wanted = [n for n in listed if n in (f"{STATE_DIR}/{JOB_FILE}", LEASE) or n in DERIVED or n.startswith("exports/")
              or n.startswith((f"{STATE_DIR}/{RAY_FAILURES_DIR}/", f"{STATE_DIR}/{RAY_ITEMS_DIR}/"))]
    if shards:  # the journal's shards, or a ray-run job's (it has no journal: its shards are its record)
        wanted += [n for n in listed if (m := _SHARD.fullmatch(n)) and (not m[1].isdigit() or int(m[1]) in stored)]
    for path in folder.glob("shard-*.tar"):  # left from an earlier view: not the store's now
        if path.name not in wanted:
            path.unlink()
    for name in wanted:
        path = folder / name
        size, mtime = info[name]
        if path.exists() and path.stat().st_size == size and mtime is not None and path.stat().st_mtime == mtime:
            continue  # fetched before, and not written since
        store.download(name, path)
        if mtime is not None:  # the store's time: `status` compares stats.json's with run.json's start
            os.utime(path, (mtime, mtime))
    if (out.recorded() or {}).get("fingerprint", {}).get("runner") == "ray":
        (out.state / RAY_FAILURES_DIR).mkdir(exist_ok=True)  # how a ray-run folder is told (a store has no folders)
    return out


def upload_tree(store: Store, folder: Path, names: list[str]) -> None:
    """Files of `folder` (relative names or glob patterns; a folder's files recursively) to the
    same names in the store. A store has no links: a link to a file of the folder (the NeMo
    export's audio_N.tar -> a shard) becomes a copy made by the store from the object of that
    file (no upload); any other link is skipped, never followed."""
    from concurrent.futures import ThreadPoolExecutor

    root = folder.resolve()
    work = []
    for name in names:
        for path in sorted(folder.glob(name)):
            files = sorted(p for p in path.rglob("*") if p.is_file() or p.is_symlink()) \
                if path.is_dir() and not path.is_symlink() else [path]
            for file in files:
                target = file.relative_to(folder).as_posix()
                if file.is_symlink():
                    real = file.resolve()
                    if real.is_relative_to(root):
                        work.append(lambda r=real, t=target: store.fs.copy_file(
                            store.key(r.relative_to(root).as_posix()), store.key(t)))
                elif file.is_file():
                    work.append(lambda f=file, t=target: store.upload(f, t))
    with ThreadPoolExecutor(READERS) as pool:  # small files: their requests' latency, not their bytes, is the cost
        for done in [pool.submit(w) for w in work]:
            done.result()


# -- the lease -------------------------------------------------------------------------------------


class Lease:
    """The store's one-writer lease (see the module's docstring)."""

    def __init__(self, store: Store, seconds: float):
        self.store, self.seconds = store, seconds
        self.owner = uuid.uuid4().hex
        self.beats = 0
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._written = 0.0
        self._confirmed = False

    def _read(self) -> Optional[dict]:
        data = self.store.read(LEASE)
        try:
            found = json.loads(data) if data else None
        except ValueError:
            return None  # a damaged lease holds nothing
        return found if isinstance(found, dict) else None

    def _write(self) -> None:
        self.store.write(LEASE, json_bytes({"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                                             "beats": self.beats, "seconds": self.seconds,
                                             "written": round(time.time(), 3)}))

    def acquire(self) -> None:
        found = self._read()
        if found and found.get("owner") != self.owner:
            log.info("%s: run %s on %s holds the lease; waiting up to %.0f s for it to renew it", self.store.shown,
                     found.get("pid"), found.get("host"), self.seconds)
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline:
                time.sleep(min(1.0, self.seconds / 10))
                now = self._read()
                if now is None:
                    break
                if now.get("owner") != found.get("owner") or now.get("beats") != found.get("beats"):
                    raise UsageError(f"{self.store.shown} is being written by another cosybatch run (pid "
                                     f"{now.get('pid')} on {now.get('host')}; it renewed its lease "
                                     f"{LEASE} just now). Wait for it to finish, or write to another --out")
        self._write()
        self._written = time.monotonic()
        self._thread = threading.Thread(target=self._renew, daemon=True, name="lease")
        self._thread.start()

    def confirm(self) -> None:
        """Read the lease back, at least READ_BACK_S after `acquire` wrote it (the caller's work
        in between counts): a rival that wrote it in the same moment shows now, and one of the
        two is refused before either commits anything. Once is enough."""
        if self._confirmed:
            return
        time.sleep(max(0.0, self._written + min(READ_BACK_S, self.seconds / 20) - time.monotonic()))
        back = self._read()
        if not back or back.get("owner") != self.owner:
            raise UsageError(f"{self.store.shown}: another cosybatch run took the lease at the same moment "
                             f"(pid {back and back.get('pid')} on {back and back.get('host')}); rerun later, or "
                             "write to another --out")
        self._confirmed = True

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                self.check()
                self.beats += 1
                self._write()
            except OutputError as exc:
                self.lost = str(exc)
                return
            except Exception as exc:  # a store that does not answer for a while: try again next beat
                log.warning("%s: could not renew the lease (%s)", self.store.shown, exc)

    def check(self) -> None:
        """Raise OutputError unless this run still holds the lease (read from the store)."""
        if self.lost:
            raise OutputError(self.lost)
        found = self._read()
        if not found or found.get("owner") != self.owner:
            self.lost = (f"{self.store.shown}: this run lost its lease to another run (pid "
                         f"{found and found.get('pid')} on {found and found.get('host')}); it stops without "
                         "committing more. What it committed is kept")
            raise OutputError(self.lost)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with contextlib.suppress(Exception):
            found = self._read()
            if found and found.get("owner") == self.owner:
                self.store.delete(LEASE)


# -- the run's sink --------------------------------------------------------------------------------


class ObjectSink:
    """A run's store: syncs the staging folder with it at the start, uploads and commits each
    sealed shard while the next batches run, and writes the job's files there at the end."""

    def __init__(self, store: Store, out: OutputDir, lease_s: float):
        self.store, self.out = store, out
        self.lease = Lease(store, lease_s)
        self.segments = 0  # the next commit segment's number
        self._checkpoint = 0  # the newest checkpoint's: segments from it on are objects of their own
        self.committed_bytes = 0  # of the staging journal, in segments already
        self.stored: dict[int, int] = {}
        self._job_uploaded: Optional[bytes] = None
        self._run_uploaded: Optional[bytes] = None
        self._queue: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.upload_s = 0.0
        self._fetched: list[Path] = []

    # -- start ---------------------------------------------------------------------------------
    def open(self, restart: bool) -> None:
        """Check the store, take the lease, and make the staging folder this job's state in the
        store plus whatever staging holds beyond it."""
        store, out = self.store, self.out
        store.check()
        try:
            self.lease.acquire()
        except OSError as exc:
            raise store_error(store.uri, store.bucket, exc, "write the dataset's lease") from None
        if restart:
            self.lease.confirm()  # nothing of the store is deleted before the lease is surely this run's
            self._clear_store()
            out.clear()
        remote_job = store.read(f"{STATE_DIR}/{JOB_FILE}")
        listed = store.list()
        journal, self.segments = store_journal(store, listed)
        self._checkpoint = self.segments
        if remote_job is None:
            if self.segments or any(_SHARD.fullmatch(n) for n in listed):
                raise UsageError(f"{store.shown} holds shards or commits but no cosybatch job record "
                                 f"({STATE_DIR}/{JOB_FILE}); choose an empty prefix (--restart would delete them)")
            if out.stored():  # staging of a job whose store was emptied since: nothing of it is left to resume
                log.info("%s holds no job any more; the staging folder %s starts over", store.shown, out.root)
                out.clear()
            # else: a run killed before its first commit, or a new job: staging is all there is
        else:
            local_job = out.job_file.read_bytes() if out.job_file.exists() else None
            if local_job != remote_job:  # staging is empty, or from another incarnation of the job
                if local_job is not None:
                    log.info("%s: the staging folder %s holds another job's state; starting it from the store",
                             store.shown, out.root)
                out.clear()
                out.state.mkdir(parents=True, exist_ok=True)
                write_atomic(out.job_file, remote_job)
            self._job_uploaded = remote_job
        local = out.journal_path.read_bytes() if out.journal_path.exists() else b""
        if not local.startswith(journal):
            if local:
                log.info("%s: the staging journal differs from the store's; the store's is kept", store.shown)
            write_atomic(out.journal_path, journal)
        self.committed_bytes = len(journal)
        self.stored = stored_shards(journal, listed)
        out.set_stored(self.stored)
        for index in self.stored:  # a copy in staging is not needed any more
            (out.root / shard_name(index)).unlink(missing_ok=True)
        ledger = Ledger.replay(out.journal_path)
        for index in list(shard_indices(out.root)):
            if index not in ledger.shards:  # staging's own shard the journal no longer names
                (out.root / shard_name(index)).unlink()
        self._thread = threading.Thread(target=self._upload_loop, daemon=True, name="upload")
        self._thread.start()
        out.sealed_hook = self.sealed

    def resumed(self) -> None:
        """After the run's repair of staging: the shards a run killed before their upload sealed
        there are uploaded first (those the repair found whole; a lost one's rows are made again).
        The lease is read back first: by now the engines have loaded, so its wait is long past."""
        self.lease.confirm()
        ledger = Ledger.replay(self.out.journal_path)
        for index, shard in sorted(ledger.shards.items()):
            if shard.closed and index not in self.stored and (self.out.root / shard_name(index)).exists():
                self.sealed(index)

    def _clear_store(self) -> None:
        for name in self.store.list():
            if name != LEASE and (name.startswith(f"{STATE_DIR}/") or _SHARD.fullmatch(name) or name in DERIVED
                                  or name.startswith("exports/")):
                self.store.delete(name)

    # -- during the run ------------------------------------------------------------------------
    def sealed(self, index: int) -> None:
        """A shard was sealed in staging (its `closed` line is in the journal): upload and commit it.
        Raises what stopped an earlier upload, so that the run stops instead of filling staging."""
        if self.error is not None:
            raise self._failed(self.error)
        self._queue.put(index)

    def _failed(self, error: BaseException) -> OutputError:
        return OutputError(f"uploading to {self.store.shown} failed ({error}); every committed shard is safe in "
                           "the store and the rest in the staging folder: rerun the same command to resume")

    def _upload_loop(self) -> None:
        while True:
            index = self._queue.get()
            if index is None:
                return
            if self.error is not None:
                continue
            try:
                self._commit(index)
            except BaseException as exc:
                self.error = exc
                log.error("%s: uploading %s failed: %s", self.store.shown, shard_name(index), exc)

    def _commit(self, index: int) -> None:
        t = time.monotonic()
        self.lease.confirm()  # (done at `resumed`; a caller that skipped it still never commits unconfirmed)
        name = shard_name(index)
        path = self.out.root / name
        size = self.store.upload(path, name)
        listed = self.store.size(name)
        if listed != size:
            raise OutputError(f"{self.store.shown}/{name}: the store holds {listed} B after an upload of {size} B")
        self._upload_job()
        self.lease.check()
        self._write_segment(through=index)
        self.stored[index] = size
        self.out.set_stored(self.stored)  # before the staging copy goes: a reader never finds neither
        path.unlink()
        self.upload_s += time.monotonic() - t

    def _upload_job(self) -> None:
        """job.json, and this run's run.json (its start and row total, for `status`), when changed."""
        job = self.out.job_file.read_bytes()
        if job != self._job_uploaded:
            self.store.write(f"{STATE_DIR}/{JOB_FILE}", job)
            self._job_uploaded = job
        run = self.out.state / RUN_FILE
        if run.exists() and run.read_bytes() != self._run_uploaded:
            self._run_uploaded = run.read_bytes()
            self.store.write(f"{STATE_DIR}/{RUN_FILE}", self._run_uploaded)

    def _write_segment(self, through: Optional[int]) -> None:
        """Segment K: the staging journal from the last segment's end to the `closed` line of
        shard `through` (None: to the end of the journal). A ray-run job keeps no journal."""
        if through is None and not self.out.journal_path.exists():
            return
        with open(self.out.journal_path, "rb") as f:
            f.seek(self.committed_bytes)
            lines = []
            for line in f:
                if not line.endswith(b"\n"):
                    break
                lines.append(line)
                if through is not None:
                    record = json.loads(line)
                    if record.get("t") == "closed" and record.get("shard") == through:
                        break
            else:
                if through is not None:
                    raise OutputError(f"{self.out.journal_path}: no `closed` line for {shard_name(through)} after "
                                      "the last commit; the staging folder changed under the run")
        if not lines:
            return
        data = b"".join(lines)
        self.store.write(f"{COMMITS}/{self.segments:08d}.jsonl", data)
        self.segments += 1
        self.committed_bytes += len(data)
        if self.segments - self._checkpoint >= CHECKPOINT_EVERY:
            self.checkpoint()

    def checkpoint(self) -> None:
        """The journal so far as one object (`upto-N.jsonl`, N the next segment's number), then the
        segments and checkpoints it replaces are deleted: a resume reads one object and the
        segments after it, not one object per shard. A kill between the two leaves objects a
        reader skips (they precede the newest checkpoint)."""
        from concurrent.futures import ThreadPoolExecutor

        if self.segments == self._checkpoint:
            return
        with open(self.out.journal_path, "rb") as f:
            self.store.write(f"{COMMITS}/upto-{self.segments:08d}.jsonl", f.read(self.committed_bytes))
        stale = []
        for name in self.store.list(COMMITS):
            base = name.rsplit("/", 1)[-1]
            m = _SEGMENT.fullmatch(base) or _CHECKPOINT.fullmatch(base)
            if m and int(m.group(1)) < self.segments:
                stale.append(name)
        with ThreadPoolExecutor(READERS) as pool:
            list(pool.map(self.store.delete, stale))
        self._checkpoint = self.segments

    def drain(self) -> None:
        """Wait for the uploads queued so far (the uploader stops: no shard is sealed after this);
        raise what stopped them."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self.error is not None:
            error, self.error = self.error, None
            if isinstance(error, OSError):
                raise self._failed(error) from error
            raise error

    # -- the end -------------------------------------------------------------------------------
    def fetch_shards(self) -> None:
        """Every shard the manifest lists back into staging, for the steps at the end that read
        the audio (exports, the report). Call after `drain`, once the manifest is written."""
        manifest = self.out.root / MANIFEST_FILE
        if not manifest.exists():
            return
        for name in sorted(set(read_parquet(manifest, columns=["shard"]).column("shard").to_pylist())):
            path = self.out.root / name
            if _SHARD.fullmatch(name) and not path.exists():
                self.store.download(name, path)
                self._fetched.append(path)

    def clip_reader(self) -> Callable[[str], bytes]:
        """id -> its audio member's bytes, read from the store without the shard: one ranged GET of
        the bytes its batch's journal line spans (the report embeds a few dozen clips; fetching
        their shards would fetch most of the dataset). An item the journal does not place (a
        ray-run job keeps no journal) is read from its whole shard, fetched once."""
        import io
        import tarfile

        from .audio import audio_member

        where: dict[str, tuple[str, int, int, str]] = {}  # id -> (shard, start, end, key)
        ends: dict[int, int] = {}
        for rec in Journal.read(self.out.journal_path):
            if rec["t"] == "items":
                start = ends.get(rec["shard"], 0)
                for item in rec["items"]:
                    where[item["id"]] = (shard_name(rec["shard"]), start, rec["end"], item.get("key", ""))
                ends[rec["shard"]] = rec["end"]
            elif rec["t"] == "lost":
                ends[rec["shard"]] = rec["end"]
        manifest = self.out.root / MANIFEST_FILE
        listed = {r["id"]: (r["shard"], r["key"]) for r in read_parquet(manifest, columns=["id", "shard", "key"])
                  .to_pylist()} if manifest.exists() else {}

        def clip(item_id: str) -> bytes:
            if item_id in where:
                shard, start, end, key = where[item_id]
                if end - start > CLIP_RANGE:
                    raise ValueError(f"the batch of {key} spans {end - start:,} bytes of {shard}, more than the "
                                     f"{CLIP_RANGE:,} read for one clip")
                with self.store.fs.open_input_file(self.store.key(shard)) as f:
                    tar = tarfile.open(fileobj=io.BytesIO(f.read_at(end - start, start)))
            else:
                shard, key = listed[item_id]
                path = self.out.root / shard
                if not path.exists():
                    self.store.download(shard, path)
                    self._fetched.append(path)
                tar = tarfile.open(path)
            with tar:
                member = audio_member(tar, key)
                if member is None or not member.isfile():
                    raise ValueError(f"{shard} holds no audio member of {key} where the journal says")
                return tar.extractfile(member).read()

        return clip

    def finish(self, status: str) -> None:
        """After the job: wait for the uploads, commit the journal's rest (failures after the
        last shard) when the job is complete, and write the job's files to the store."""
        self.drain()
        complete = status == "complete"
        if complete:
            self._upload_job()
            self.lease.check()
            self._write_segment(through=None)
            self.checkpoint()  # the next run reads the journal as one object
        upload_tree(self.store, self.out.root, [*(DERIVED if complete else ("stats.json",)),
                                                *(["exports"] if complete else [])])
        for path in [*(self.out.root / shard_name(i) for i in self.stored), *self._fetched]:
            path.unlink(missing_ok=True)  # staging keeps no copy of what the store holds

    def close(self) -> None:
        """In every case: stop the uploader (what it has not uploaded stays in staging) and give
        the lease back."""
        self.out.sealed_hook = None
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self.lease.release()


def open_sink(cfg, out: OutputDir) -> Optional[ObjectSink]:
    """The run's store sink when --out is a store URI (None for a folder), opened."""
    if cfg.output.store is None:
        return None
    sink = ObjectSink(Store(cfg.output.store), out, cfg.output.lease_s)
    try:
        sink.open(cfg.output.restart)
    except BaseException:
        sink.close()
        raise
    return sink


@contextlib.contextmanager
def job_view(target: str, folder: Optional[Path] = None, shards: bool = False,
             upload: tuple = ()) -> Iterator[Path]:
    """A job folder for a command that reads one: `target` itself when it is a path; for a store
    URI, the job (or a sharded job's root, every part-*-of-* prefix) materialised in a local
    folder (`folder`, else a cache folder per URI), and afterwards the files named in `upload`
    (relative to the root; a folder's files recursively) written back to the store."""
    if not is_uri(str(target)):
        yield Path(target)
        return
    store = Store(str(target))
    store.check()
    root = folder or default_staging(store.uri).with_name(default_staging(store.uri).name + "-view")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".view.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two commands reading one store here take turns with its view
        yield _fill_view(store, root, shards)
        upload_tree(store, root, list(upload))


def _fill_view(store: Store, root: Path, shards: bool) -> Path:
    listed = store.list()
    parts = sorted({n.split("/", 1)[0] for n in listed if re.fullmatch(r"part-\d+-of-\d+/.*", n)})
    if f"{STATE_DIR}/{JOB_FILE}" in listed:
        materialise(store, root, shards)
    elif parts:
        for part in parts:
            materialise(Store(f"{store.uri}/{part}"), root / part, shards)
        for name in ("manifest.parquet", "failures.jsonl", "stats.json", "README.md"):
            if name in listed:
                store.download(name, root / name)
    else:
        raise UsageError(f"{store.shown} holds no cosybatch job ({STATE_DIR}/{JOB_FILE}) and no part-*-of-* "
                         "prefixes of a sharded job")
    return root

