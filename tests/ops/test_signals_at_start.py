"""Newcomer defect 6: Ctrl-C or SIGTERM at any moment of start-up, of any command, exits 4 with
the JSON line. Each test waits for a state, never a fixed time: the kernel's record that the
process catches SIGTERM (its first instruction), or a code point reached (a signal the process
sends itself from inside start-up)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def catches_sigterm(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    except OSError:
        pass
    return False


def check_exit_4(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, (proc.returncode, out, err)
    last = json.loads(out.splitlines()[-1])
    assert last["exit_code"] == 4 or last["status"] == "interrupted", last
    return last


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("command", ["run", "verify", "quantize"])
def test_a_signal_as_soon_as_the_process_handles_it(tmp_path, command, sig):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "cosybatch", *command_args(tmp_path, command)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while not catches_sigterm(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.001)
    proc.send_signal(sig)
    check_exit_4(proc)


SELF_SIGNAL = """
import importlib, os, signal, sys
owner = importlib.import_module({module!r})
*parents, attr = {path!r}.split(".")
for name in parents:
    owner = getattr(owner, name)
real = getattr(owner, attr)
def hook(*args, **kwargs):
    os.kill(os.getpid(), signal.{sig})
    return real(*args, **kwargs)
setattr(owner, attr, hook)
from cosybatch.__main__ import main
sys.argv[0] = "cosybatch"
main()
"""


def self_signal(tmp_path, module: str, path: str, sig: str, args: list[str]) -> subprocess.Popen:
    code = SELF_SIGNAL.format(module=module, path=path, sig=sig)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def command_args(tmp_path, command: str) -> list[str]:
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "One."}])
    return {"run": ["run", str(corpus), "--out", str(tmp_path / "out"), "--engine", "tone"],
            "verify": ["verify", str(tmp_path)], "quantize": ["quantize"]}[command]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("command", ["run", "verify", "quantize"])
def test_a_signal_as_the_command_starts(tmp_path, command, sig):
    """Once the options are parsed, before the command's own work: where the CLI framework's own
    Ctrl-C handling used to answer (exit 1 or 130, no JSON line)."""
    module, attr = {"run": ("cosybatch.cli", "_setup_logging"), "quantize": ("cosybatch.cli", "_setup_logging"),
                    "verify": ("cosybatch.store.verify", "verify")}[command]
    check_exit_4(self_signal(tmp_path, module, attr, sig, command_args(tmp_path, command)))


def test_a_signal_once_the_run_holds_its_folder(tmp_path):
    """Between taking the output folder's lock and the run's own handler."""
    args = command_args(tmp_path, "run")
    check_exit_4(self_signal(tmp_path, "cosybatch.store.checkpoint", "OutputDir.lock", "SIGINT", args))
