"""tests/zygote.py, which runs the tests' `cosybatch` commands: a forked child answers as a new
interpreter does (exit code, stdout, stderr), in the caller's folder. (The caller's environment
reaching the child is what every object-store test relies on: the store's endpoint is only there.)"""

from __future__ import annotations

import pytest
from helpers import cli, numbered_rows, read_output, write_jsonl


@pytest.mark.slow
def test_a_forked_command_answers_as_a_new_interpreter_does(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", numbered_rows(2))
    commands = [("run", "--no-such-option"),  # click's usage error: exit 2, its program name
                ("status", "out"),  # a relative path: the caller's folder
                ("run", "c.jsonl", "--out", "out", "--engine", "tone", "--progress", "none", "--seed", "7")]
    for args in commands:
        forked = cli(*args, cwd=tmp_path)
        if args[0] == "run" and len(args) > 2:
            fresh = cli(*args[:3], "fresh-out", *args[4:], cwd=tmp_path, fresh=True)
            assert forked.returncode == fresh.returncode == 0, forked.stderr
            assert (tmp_path / "out" / "manifest.parquet").read_bytes() != b""
            assert read_output(tmp_path / "out").keys() == read_output(tmp_path / "fresh-out").keys() == {"r0", "r1"}
            continue
        fresh = cli(*args, cwd=tmp_path, fresh=True)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert cli("--version").stdout == cli("--version", fresh=True).stdout

