"""The output folder as a run claims it: created and locked before the job starts, unlocked
after, and left as it was when the job never started (no job.json). Errors writing it become
errors that say the job can resume."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import OutputError, UsageError
from ..store.checkpoint import LOCK_FILE, OutputDir


@contextmanager
def claimed(path: Path) -> Iterator[OutputDir]:
    """The folder, created if need be and locked for this run (UsageError: not usable). An I/O
    error about the folder inside the block (a full disk, a read-only mount) becomes an OutputError
    saying that what is committed is intact and a rerun resumes."""
    out = OutputDir(path)
    created = _missing_folders(path)  # removed again if the job never starts (no job.json)
    state_existed = out.state.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        out.lock()
    except OSError as exc:
        out.unlock()
        _remove_unstarted(out, created, state_existed)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk is resumable, whenever it strikes
            raise output_error(path, exc) from None
        raise UsageError(f"cannot use {path} as the output folder ({exc.strerror or exc}); "
                         "choose a writable --out") from None
    try:
        yield out
    except OSError as exc:
        if _about_output(path, exc):
            raise output_error(path, exc) from exc
        raise
    finally:
        _remove_unstarted(out, created, state_existed)
        out.unlock()


def output_error(path: Path, exc: OSError) -> OutputError:
    return OutputError(
        f"writing to {path} failed ({exc.strerror or exc}); everything committed before is "
        "intact: free space or fix the folder, then rerun the same command to resume"
    )


def _missing_folders(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first."""
    missing = []
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            break
        missing.append(folder)
    return missing


def _remove_unstarted(out: OutputDir, created: list[Path], state_existed: bool) -> None:
    """After a start that failed before the job was recorded (no job.json: a bad corpus, a model
    that does not load), remove what this call created, so that no half-made folder is left for
    `cosybatch status` to call "not started". Only the lock file, and then folders this call
    created, and only while empty: a folder that existed before, or holds anything else, stays.
    Called while the lock is held, so no other run can be starting in the folder."""
    if out.job_file.exists():
        return
    if not state_existed:
        try:
            (out.state / LOCK_FILE).unlink(missing_ok=True)
            out.state.rmdir()
        except OSError:
            return
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            return


def _about_output(path: Path, exc: OSError) -> bool:
    """Is this I/O error about writing the output (and so resumable once fixed)?"""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return True
    name = exc.filename
    return name is not None and Path(name).resolve().is_relative_to(path.resolve())
