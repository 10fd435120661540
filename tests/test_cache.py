"""cosybatch/cache.py: a cache build clears the temporaries of builders that died (issue 23, case 10)."""

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
