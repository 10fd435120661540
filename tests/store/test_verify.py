"""`cosybatch verify` writing into a pipe whose reader is gone (`| head`) still exits with its own
code, 0 or 3, and no traceback (issue 23, case 10). What verify reads and finds is in
tests/store/test_integrity.py and test_tampering.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, finished_tone_job


@pytest.mark.slow
def test_verify_into_a_closed_pipe_exits_with_its_own_code(tone, tmp_path):
    _, out = finished_tone_job(tone, tmp_path)
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    (damaged / "shard-000001.tar").write_bytes(b"\0" * (damaged / "shard-000001.tar").stat().st_size)
    for folder, code in ((out, 0), (damaged, 3)):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before a byte is written, as `| head` may be
        try:
            proc = subprocess.run([sys.executable, "-m", "cosybatch", "verify", str(folder)], stdout=write,
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
        finally:
            os.close(write)
        assert proc.returncode == code, proc.stderr
        assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
