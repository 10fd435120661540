"""The user's cache folder for files cosybatch builds from a model (ONNX exports, INT8 voices).

Each cached file is ``KEY-DIGEST.SUFFIX``: KEY hashes what the file is built from, DIGEST is the
start of the sha256 of the file's own bytes, so a damaged file is found, removed and rebuilt. A
builder writes a temporary file in the same folder and renames it into place while holding
``KEY.lock``, so concurrent jobs and sharded workers on one machine build it once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple, Optional

log = logging.getLogger("cosybatch")


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/cosybatch`` (an absolute XDG_CACHE_HOME only, as the spec says), else
    ``~/.cache/cosybatch``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "cosybatch"


def sha256_hex(path: Path) -> str:
    """The sha256 of every byte of ``path``, hashed now (not remembered, unlike file_sha256)."""
    return _file_sha256(path)["sha256"]


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


_HASHED: dict[_Stat, dict] = {}  # _stat_key -> file_sha256's answer, this process
DIGESTS_FOLDER = "digests"  # under cache_root(): file_sha256's answers, remembered across processes
REMEMBER_FROM_BYTES = 1 << 20  # smaller files are hashed faster than a remembered answer is read
SETTLED_S = 2.0  # a file changed more recently than this is not remembered (coarse timestamps)


class _Stat(NamedTuple):
    """What identifies a version of a file without reading it (file_sha256's memo key)."""
    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def _stat_key(path: Path) -> _Stat:
    st = os.stat(path)
    return _Stat(os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_sha256(path: Path) -> dict:
    """Identifies a file exactly: its size and the sha256 of every byte (about 1 s per GB).

    Hashed once per process, and for a file of a MiB or more remembered across processes in
    ``cache_root()/digests`` while the file's path, device, inode, size, mtime and ctime stay the
    same: a job's processes, reruns and sharded workers open the same voice and corpus again and
    again (0.15 s a process for the bundled 63 MB voice, whose graph and its cached derivatives are
    hashed three times; a 10 GB corpus took 10 s at every resume). Any write to the file moves its
    ctime, which no program sets back (unlike the mtime), so a changed file is hashed again; a
    file changed in the last SETTLED_S is not remembered, for filesystems whose timestamps are
    coarser than a write. An unusable cache folder only means hashing every time."""
    key = _stat_key(path)
    if key not in _HASHED:
        _HASHED[key] = _remembered(key) or _remember(key, _file_sha256(path))
    return dict(_HASHED[key])


def _digest_file(key: _Stat) -> Path:
    name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    return cache_root() / DIGESTS_FOLDER / f"{name}.json"


def _remembered(key: _Stat) -> Optional[dict]:
    if key.size < REMEMBER_FROM_BYTES:
        return None
    try:
        found = json.loads(_digest_file(key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or found.get("key") != list(key):
        return None  # another file's whose name collided, or a damaged record: hash it
    size, sha = found.get("size"), found.get("sha256")
    if size != key.size or not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        return None
    return {"size": size, "sha256": sha}


def _remember(key: _Stat, answer: dict) -> dict:
    settled = time.time() - max(key.mtime_ns, key.ctime_ns) / 1e9 > SETTLED_S
    if key.size >= REMEMBER_FROM_BYTES and answer["size"] == key.size and settled:
        target = _digest_file(key)
        with contextlib.suppress(OSError):
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=target.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"key": list(key), **answer}, f)
                os.replace(tmp, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
    return answer


def _file_sha256(path: Path) -> dict:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (POSIX flock) while the block runs; none where flock is missing."""
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent builds may both run, and the rename keeps files whole
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def find_cached(folder: Path, key: str, suffix: str = ".onnx") -> Optional[Path]:
    """A cached file of ``key`` whose bytes match the digest in its name; damaged ones are removed."""
    for path in sorted(folder.glob(f"{key}-*{suffix}")):
        digest = path.name[: -len(suffix)].rsplit("-", 1)[-1]
        try:
            if len(digest) == 32 and file_sha256(path)["sha256"].startswith(digest):
                return path
        except OSError:
            continue
        log.warning("cache: %s is damaged (its bytes do not match its name); rebuilding it", path)
        with contextlib.suppress(OSError):
            path.unlink()
    return None


def remove_dead_temporaries(folder: Path, key: str) -> None:
    """Delete ``.KEY-*.tmp`` files: with ``KEY.lock`` held by the caller, no live builder can own
    one (a builder holds the lock until its temporary is renamed or removed), so they are left by a
    builder that was killed (kill -9, OOM, power) and would otherwise stay, GBs each, forever."""
    name = re.compile(rf"\.{re.escape(key)}-[a-z0-9_]+\.tmp")  # mkstemp's names; not another key's
    for path in folder.glob(f".{key}-*.tmp"):
        if name.fullmatch(path.name):
            log.warning("cache: removing %s, left by a build that did not finish", path)
            with contextlib.suppress(OSError):
                path.unlink()


def cached_file(folder: Path, key: str, build: Callable[[Path], None], suffix: str = ".onnx") -> Path:
    """The cached file of ``key`` in ``folder``: found (its bytes checked against its name), or made
    once under ``KEY.lock`` by ``build(tmp)`` writing a temporary file that is then named after its
    sha256 and renamed into place. OSError propagates: the caller says which cache is unusable."""
    folder.mkdir(parents=True, exist_ok=True)
    with locked(folder / f"{key}.lock"):
        remove_dead_temporaries(folder, key)
        found = find_cached(folder, key, suffix)
        if found is not None:
            return found
        fd, tmp = tempfile.mkstemp(prefix=f".{key}-", suffix=".tmp", dir=folder)
        os.close(fd)
        try:
            build(Path(tmp))
            os.chmod(tmp, 0o644)  # mkstemp makes it private; a cache file is as readable as any other
            path = folder / f"{key}-{sha256_hex(Path(tmp))[:32]}{suffix}"
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return path
