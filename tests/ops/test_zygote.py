"""tests/zygote.py, which runs the tests' `cosybatch` commands: a forked child answers as a new
interpreter does (exit code, stdout, stderr), in the caller's folder, and ends as one does (threads
joined, atexit run, streams flushed; an uncaught exception or KeyboardInterrupt as the interpreter
reports it). (The caller's environment reaching the child is what every object-store test relies
on: the store's endpoint is only there.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import zygote
from helpers import cli, numbered_rows, read_output, write_jsonl


@pytest.mark.slow
def test_a_forked_command_answers_as_a_new_interpreter_does(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", numbered_rows(2))
    commands = [("run", "--no-such-option"),  # click's usage error: exit 2, its program name
                ("status", "out"),  # a relative path: the caller's folder
                ("run", "missing.jsonl", "--out", "o2"),  # an error: JSON on stdout, the message on stderr
                ("doctor", "--json"),  # imports torch and onnxruntime, which the zygote holds
                ("run", "c.jsonl", "--out", "out", "--engine", "tone", "--progress", "none", "--seed", "7")]
    for args in commands:
        forked = cli(*args, cwd=tmp_path)
        if "--engine" in args:  # a run: the same items in another folder
            fresh = cli(*args[:3], "fresh-out", *args[4:], cwd=tmp_path, fresh=True)
            assert forked.returncode == fresh.returncode == 0, forked.stderr
            assert (tmp_path / "out" / "manifest.parquet").read_bytes() != b""
            assert read_output(tmp_path / "out").keys() == read_output(tmp_path / "fresh-out").keys() == {"r0", "r1"}
            continue
        fresh = cli(*args, cwd=tmp_path, fresh=True)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert cli("--version").stdout == cli("--version", fresh=True).stdout


# A module that ends in each of the ways an interpreter has to handle on its way out.
PROBE = textwrap.dedent("""
    import atexit, sys, threading, time

    atexit.register(lambda: print("atexit ran"))
    def late():
        time.sleep(0.2)
        print("thread done")  # a non-daemon thread: the interpreter waits for it
    threading.Thread(target=late).start()
    print("main", end="")  # no newline: still in stdout's buffer at the end
    print("", file=sys.stderr, end="")
    how = sys.argv[1]
    if how == "raise":
        raise ValueError("boom")
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "message":
        sys.exit("a message")
    if how == "seven":
        sys.exit(7)
""")


@pytest.mark.parametrize("how", ["return", "raise", "interrupt", "message", "seven"])
def test_a_forked_child_ends_as_an_interpreter_does(tmp_path, how):
    (tmp_path / "probe.py").write_text(PROBE)
    forked = zygote.run([how], dict(os.environ), tmp_path, 60, module="probe")
    fresh = subprocess.run([sys.executable, "-m", "probe", how], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert forked.returncode == fresh.returncode
    assert forked.stdout == fresh.stdout
    assert forked.stdout.startswith("main") and forked.stdout.endswith("thread done\natexit ran\n")
    # The traceback's frames differ (runpy's entry point, the zygote's); its last line does not.
    assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]
    assert ("Traceback" in forked.stderr) == ("Traceback" in fresh.stderr) == (how in ("raise", "interrupt"))
