"""WebDataset-style tar shards written so that a crash never corrupts what was committed.

A shard is built as `shard-NNNNNN.tar.partial`: members are appended batch by batch, each batch
flushed and fsynced before the journal records it. Closing a shard appends the end-of-archive
blocks, fsyncs and renames it to `shard-NNNNNN.tar`, so a final name always holds a whole tar.
A resumed run truncates the partial file back to the last offset the journal recorded.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import tarfile
from pathlib import Path
from typing import Optional

import numpy as np

TAR_BLOCK = 512
MAX_KEY_CHARS = 64  # + "_" + 20 hex digits + ".json" stays within ustar's 100-character names
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
# The shape every hashed key ends with. No id with this shape passes through unchanged, so a
# passed-through key and a hashed key can never be equal.
_HASHED_SHAPE = re.compile(r"_[0-9a-f]{20}\Z")


def item_key(item_id: str) -> str:
    """A shard key for an id: letters, digits, '_' and '-' only (readers split the key from the
    extension at the first dot).

    Injective: an id passes through unchanged only when it is safe, at most MAX_KEY_CHARS long
    and does not end like a hashed key (`_` + 20 hex digits); every other id becomes its sanitised
    prefix + `_` + an 80-bit hash of the whole id. Passed-through keys are distinct because the
    ids are; hashed keys never equal a passed-through one (shape) and differ from each other
    unless two ids collide in 80-bit BLAKE2b."""
    clean = _UNSAFE.sub("_", item_id)[:MAX_KEY_CHARS]
    if clean == item_id and not _HASHED_SHAPE.search(item_id):
        return clean
    digest = hashlib.blake2b(item_id.encode("utf-8", "surrogatepass"), digest_size=10).hexdigest()
    return f"{clean}_{digest}"


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def pcm16(audio: np.ndarray) -> np.ndarray:
    """float audio in [-1, 1] -> the 16-bit samples a WAV member holds."""
    return np.clip(np.round(np.asarray(audio, dtype=np.float64) * 32767.0), -32768, 32767).astype(np.int16)


def as_committed(audio: np.ndarray) -> np.ndarray:
    """float audio -> the float32 a reader of its WAV member gets (soundfile scales PCM by 1/32768):
    what the quality gate judges, so that the run and `cosybatch qc` hear the same samples."""
    return pcm16(audio).astype(np.float32) / np.float32(32768.0)


def committed_pcm(committed: np.ndarray) -> np.ndarray:
    """`as_committed`'s float32 -> the very 16-bit samples it was made from."""
    return np.clip(np.round(np.asarray(committed, dtype=np.float64) * 32768.0), -32768, 32767).astype(np.int16)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardWriter:
    """Appends tar members to one partial shard; `commit` makes them durable, `close` finishes it."""

    def __init__(self, out_dir: Path, index: int, offset: int = 0, items: int = 0, name: Optional[str] = None):
        self.out_dir = Path(out_dir)
        self.index = index
        self.final_path = self.out_dir / (name or shard_name(index))
        self.partial_path = self.final_path.with_name(self.final_path.name + ".partial")
        if offset and not self.partial_path.exists():
            raise OSError(errno.ENOENT, f"{self.partial_path.name} is missing but the journal has "
                          f"{items} committed items in it; the output folder was changed by hand "
                          "(restore the file, or rerun with --restart)", str(self.partial_path))
        mode = "r+b" if offset else "wb"
        self._file = open(self.partial_path, mode)
        if mode == "wb":
            fsync_dir(self.out_dir)  # the new name must survive a power loss too
        if mode == "r+b":
            size = self._file.seek(0, os.SEEK_END)
            if size < offset:
                raise OSError(f"{self.partial_path} is shorter ({size} B) than its committed offset ({offset} B)")
            # Drop whatever a killed run wrote after its last commit.
            self._file.truncate(offset)
            self._file.seek(offset)
        self.offset = offset
        self.items = items

    def add(self, key: str, members: dict[str, bytes], mtime: int) -> None:
        """Append `key.ext` members (ext -> bytes). Not durable until `commit`."""
        for ext, data in members.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            info.mtime = mtime
            info.mode = 0o644
            header = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
            pad = (-len(data)) % TAR_BLOCK
            self._file.write(header)
            self._file.write(data)
            self._file.write(b"\0" * pad)
            self.offset += len(header) + len(data) + pad
        self.items += 1

    def commit(self) -> int:
        self._file.flush()
        os.fsync(self._file.fileno())
        return self.offset

    def close(self) -> Path:
        """End-of-archive blocks, fsync, rename to the final name."""
        self._file.write(b"\0" * (2 * TAR_BLOCK))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial_path, self.final_path)
        fsync_dir(self.out_dir)
        return self.final_path

    def abandon(self) -> None:
        """Close the file handle, leaving the partial shard for a later resume."""
        if not self._file.closed:
            self._file.close()
