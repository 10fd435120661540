"""The user's cache folder for files cosybatch builds from a model (ONNX exports, INT8 voices).

Each cached file is ``KEY-DIGEST.SUFFIX``: KEY hashes what the file is built from, DIGEST is the
start of the sha256 of the file's own bytes, so a damaged file is found, removed and rebuilt. A
builder writes a temporary file in the same folder and renames it into place while holding
``KEY.lock``, so concurrent jobs and sharded workers on one machine build it once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

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


_HASHED: dict[tuple, dict] = {}  # (path, device, inode, size, mtime) -> file_sha256's answer, this process


def _stat_key(path: Path) -> tuple:
    st = os.stat(path)
    return (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_sha256(path: Path) -> dict:
    """Identifies a file exactly: its size and the sha256 of every byte (about 1 s per GB). Hashed
    once per process while the file's inode, size and mtime stay the same (a job's processes open
    the same voice again and again: 0.1 s each for a 63 MB one)."""
    key = _stat_key(path)
    if key not in _HASHED:
        _HASHED[key] = _file_sha256(path)
    return dict(_HASHED[key])


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
