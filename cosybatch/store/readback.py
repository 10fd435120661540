"""Reading back a file of the output folder without trusting what is at its name.

Files cosybatch reads back from OUT (the README.md it may rewrite, stats.json, job.json, run.json,
the journal, the manifest, shards) are normally its own, but the folder is the user's: a name can
hold a symbolic link (to /dev/zero, to a file elsewhere), a FIFO (reading one blocks until a writer
comes, which may be never) or a device. So each is opened with O_NOFOLLOW (a link at the name is
refused, not followed) and O_NONBLOCK (opening a FIFO does not wait for a writer), then fstat'ed:
only a regular file is read, and a whole-file read only under a cap of bytes (the cap is checked on
the size and again on what is read, in case the file grows meanwhile). Anything else raises
`NotReadable`, whose message says what was found; the callers leave such a file alone with a
warning. Only the last component of the name is protected: OUT itself and its sub-folders are
taken as they are.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import IO, Optional

CARD_CAP = 1 << 20  # OUT/README.md: cosybatch's cards are a few KB; a larger one is not cosybatch's
JSON_CAP = 16 << 20  # stats.json, job.json, run.json: KBs when cosybatch wrote them

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


class NotReadable(OSError):
    """A file of the output folder that is not read back: a link, not a regular file, or over its cap."""


def open_regular(path: Path, cap: Optional[int] = None) -> IO[bytes]:
    """PATH opened for reading in binary, when it is a regular file (not a link, FIFO, device,
    socket or folder) of at most `cap` bytes (no cap: None). Raises NotReadable (or the OSError of
    the open, FileNotFoundError included) otherwise."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) and path.is_symlink():  # EMLINK: the BSDs' word for it
            raise NotReadable(f"{path} is a symbolic link; it is not followed") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _KINDS if test(info.st_mode)), "not a regular file")
            raise NotReadable(f"{path} is {kind}, not a regular file")
        if cap is not None and info.st_size > cap:
            raise NotReadable(f"{path} is {info.st_size:,} bytes, more than the {cap:,} read back")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, cap: int) -> bytes:
    """The bytes of PATH, a regular file of at most `cap` bytes (see open_regular)."""
    with open_regular(path, cap) as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise NotReadable(f"{path} grew past the {cap:,} bytes read back while it was read")
    return data


def read_json(path: Path, cap: int = JSON_CAP) -> dict:
    """PATH's JSON object; {} when it is missing, unreadable, refused (see open_regular) or not an
    object. For files cosybatch reads only to describe the folder (the card, the audit page)."""
    try:
        value = json.loads(read_regular(path, cap))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
