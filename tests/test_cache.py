"""cosybatch/cache.py: a cache build clears the temporaries of builders that died (issue 23, case 10);
file hashes are remembered across processes until the file is written."""

from __future__ import annotations

import pytest

from cosybatch.cache import cached_file


def test_a_cache_build_removes_temporaries_of_builders_that_died(tmp_path):
    stale = tmp_path / ".k123-abc_x9yz.tmp"
    stale.write_bytes(b"half an ONNX file")  # as a builder killed with -9 leaves it
    others = [tmp_path / ".k123-other-abc_x9yz.tmp", tmp_path / ".k1234-abcdefgh.tmp"]  # other keys' files
    for path in others:
        path.write_bytes(b"not ours")
    path = cached_file(tmp_path, "k123", lambda tmp: tmp.write_bytes(b"built"))
    assert path.read_bytes() == b"built" and not stale.exists()
    assert all(p.exists() for p in others)
    stale.write_bytes(b"again")
    assert cached_file(tmp_path, "k123", lambda tmp: pytest.fail("rebuilt")) == path  # found: still cleaned
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".k123-")) == [others[0].name]


def test_a_files_hash_is_remembered_until_the_file_changes(tmp_path):
    """file_sha256 hashes a file once per process while its inode, size and mtime stay; a changed
    file is hashed again, and find_cached (which checks a cached file's bytes by it) sees damage."""
    import hashlib
    import os

    from cosybatch.cache import file_sha256, find_cached

    path = cached_file(tmp_path, "k1", lambda tmp: tmp.write_bytes(b"built"))
    assert file_sha256(path)["sha256"] == hashlib.sha256(b"built").hexdigest()
    assert find_cached(tmp_path, "k1") == path
    stat = path.stat()
    path.write_bytes(b"BUILT")  # damaged in place: same size; the mtime moves
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert file_sha256(path)["sha256"] == hashlib.sha256(b"BUILT").hexdigest()
    assert find_cached(tmp_path, "k1") is None and not path.exists()  # removed, to be rebuilt


def _settled_file(path, data: bytes):
    """PATH holding DATA, its mtime and ctime older than SETTLED_S (the ctime by waiting it out:
    no call sets it back)."""
    import os
    import time

    from cosybatch.cache import SETTLED_S

    path.write_bytes(data)
    while time.time() - os.stat(path).st_ctime_ns / 1e9 <= SETTLED_S:
        time.sleep(0.1)
    return path


def test_a_hash_is_remembered_across_processes_until_the_file_is_written(tmp_path, monkeypatch):
    """A MiB-plus file's sha256 is kept in the cache folder: a new process (here: the per-process
    memo emptied) reads it back instead of the file's bytes, until any write moves the file's ctime,
    even one that restores size and mtime. A file written just now is not remembered."""
    import hashlib
    import os
    import subprocess
    import sys

    from cosybatch import cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    big = _settled_file(tmp_path / "voice.onnx", b"v" * (2 << 20))
    hashed = []
    real = cache._file_sha256
    monkeypatch.setattr(cache, "_file_sha256", lambda path: hashed.append(path) or real(path))
    monkeypatch.setattr(cache, "_HASHED", {})
    want = {"size": 2 << 20, "sha256": hashlib.sha256(b"v" * (2 << 20)).hexdigest()}
    assert cache.file_sha256(big) == want and len(hashed) == 1
    assert len(list((tmp_path / "xdg" / "cosybatch" / "digests").glob("*.json"))) == 1
    # Another process, with no memo of its own: the same answer without reading the file.
    code = ("import sys; from pathlib import Path; from cosybatch import cache; "
            "cache._file_sha256 = None; print(cache.file_sha256(Path(sys.argv[1]))['sha256'])")
    other = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True, text=True,
                           env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert other.stdout.strip() == want["sha256"], other.stderr
    monkeypatch.setattr(cache, "_HASHED", {})
    assert cache.file_sha256(big) == want and len(hashed) == 1  # read back, not hashed
    # Changed in place with its size and mtime put back: the ctime moved, so it is hashed again.
    stat = big.stat()
    big.write_bytes(b"w" * (2 << 20))
    os.utime(big, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    monkeypatch.setattr(cache, "_HASHED", {})
    assert cache.file_sha256(big)["sha256"] == hashlib.sha256(b"w" * (2 << 20)).hexdigest() and len(hashed) == 2
    monkeypatch.setattr(cache, "_HASHED", {})
    cache.file_sha256(big)  # written under SETTLED_S ago when hashed: not remembered, hashed again
    assert len(hashed) == 3


def test_a_remembered_hash_that_does_not_fit_is_ignored_and_an_unusable_folder_only_costs_time(tmp_path,
                                                                                               monkeypatch):
    import hashlib
    import json

    from cosybatch import cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    big = _settled_file(tmp_path / "corpus.parquet", b"c" * (1 << 20))
    want = hashlib.sha256(b"c" * (1 << 20)).hexdigest()
    monkeypatch.setattr(cache, "_HASHED", {})
    cache.file_sha256(big)
    record = next((tmp_path / "xdg" / "cosybatch" / "digests").glob("*.json"))
    for planted in ({**json.loads(record.read_text()), "sha256": "0" * 63}, [1, 2], "not json"):
        record.write_text(planted if isinstance(planted, str) else json.dumps(planted))
        monkeypatch.setattr(cache, "_HASHED", {})
        assert cache.file_sha256(big)["sha256"] == want
    # Small files are never written down (hashing them is quicker than reading a record).
    small = _settled_file(tmp_path / "small.txt", b"s" * 100)
    before = sorted((tmp_path / "xdg" / "cosybatch" / "digests").iterdir())
    cache.file_sha256(small)
    assert sorted((tmp_path / "xdg" / "cosybatch" / "digests").iterdir()) == before
    # A cache folder that cannot be written: the hash is still right.
    (tmp_path / "blocked").write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "blocked"))
    monkeypatch.setattr(cache, "_HASHED", {})
    assert cache.file_sha256(big)["sha256"] == want
