"""`python -m cosybatch` for the tests without paying its imports every time.

Each `helpers.cli()` call used to start a new interpreter, which spends 0.4-0.5 CPU-s importing
cosybatch's CLI, numpy and pyarrow before doing what the test asks (a two-row Piper run: 1.6 s
fresh, 1.2 s forked; ~180 calls in the suite), and 1.2 s more where a command imports torch. Here
one process per test process imports them once (the zygote) and forks a child per call. The child
is a process of its own, as `subprocess.run` would start: its own pid, environment (replaced with
the caller's), working folder, stdin on /dev/null, stdout and stderr in files, Python's default
SIGINT and SIGTERM handling, and `cosybatch/__main__.py` run with runpy as `python -m` runs it (so
sys.argv[0], `__main__`, sys.path[0] and click's program name are the same). It ends as an
interpreter ends up to the point where Python code stops running: an uncaught exception printed
with its traceback (exit 1), SystemExit's code, non-daemon threads joined, atexit functions run
(logging's flush and close among them), stdout and stderr flushed; then `os._exit` with that
status (see below for why), and its exit status is reported back.

What differs from a new interpreter, and how the suite keeps it honest:
- The imports ran once, under the zygote's environment: a variable read at import time (by numpy or
  pyarrow) takes the value the zygote had. No test's `cli()` sets one; a test that needs
  a fresh interpreter says `cli(..., fresh=True)`.
- Every child shares the zygote's string-hash seed, where fresh interpreters would each draw one.
  Output compared across processes (resume after a kill, `ray-run` against `run`) still comes from
  fresh interpreters in the tests that start runs with `start_run`, the Ray tests and the docs pages.
- The child skips what an interpreter does after that: tearing down its modules (objects still
  referenced from a module are not finalized; a file left open and unflushed there would lose its
  buffer where a new interpreter would flush it) and the C library's exit handlers. Those are why:
  onnxruntime's exit handlers wait forever in a forked child for a thread pool it does not have,
  and tearing down torch's modules cost a forked child 0.8 s. Ended this way, a child of a zygote
  holding both forks and exits in 0.05 CPU-s, so they are preloaded too.
- COSYBATCH_TEST_FRESH=1 makes every `cli()` call a new interpreter again (as before), to compare.

Protocol, one JSON line each way: the client sends {module, argv, env, cwd, stdout, stderr} on the
zygote's stdin; the zygote answers {"pid"} as soon as the child runs, then {"code"} when it ends.
"""

from __future__ import annotations

import atexit
import io
import json
import locale
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What the zygote imports before it forks anything: what every command imports, and onnxruntime
# (0.2 s; every Piper command) and torch (1.2 s; CosyVoice commands and `doctor`). Importing these
# starts no Python threads and runs no torch op (so no OpenMP pool exists to be lost in a fork);
# numpy's OpenBLAS and pyarrow's allocator start native threads, whose libraries handle fork (as
# multiprocessing relies on).
PRELOAD = ("cosybatch.cli", "cosybatch.run.local", "cosybatch.engines.piper", "pyarrow.parquet", "soundfile",
           "onnxruntime", "torch")


def serve() -> None:
    """The zygote's loop (run as `python tests/zygote.py`): requests on stdin, answers on stdout."""
    import importlib

    sys.path.pop(0)  # this script's folder (tests/); a child puts its working folder first, as -m does
    for name in PRELOAD:
        importlib.import_module(name)
    control = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # nothing of the zygote's own reaches the control channel
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            control.close()
            _child(request, devnull)  # never returns: the child exits as an interpreter does
        control.write(json.dumps({"pid": pid}) + "\n")
        control.flush()
        _, status = os.waitpid(pid, 0)
        control.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        control.flush()


def _child(request: dict, devnull: int) -> None:
    import runpy
    import signal

    os.dup2(devnull, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.close(devnull)
    # As a new interpreter whose streams are files: stdout block-buffered, stderr line-buffered.
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1,
                                      closefd=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(request["cwd"])
    sys.path.insert(0, request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["argv"]]  # runpy puts the module's file in argv[0], as -m does
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException as exc:  # as the interpreter reports an uncaught one: traceback, exit 1
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
        if isinstance(exc, KeyboardInterrupt):  # the interpreter ends by SIGINT then, not with a status
            code = -signal.SIGINT
    _end(code)


def _exit_code(code) -> int:
    """SystemExit(code) as the interpreter turns it into a status: None is 0, an int is itself,
    anything else is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _end(code: int) -> None:
    """What an interpreter does on its way out while Python code still runs, then _exit (see the
    module docstring): join non-daemon threads, run atexit functions, flush the std streams. A
    negative code is a signal to end by, as an uncaught KeyboardInterrupt ends by SIGINT."""
    import atexit
    import signal
    import threading

    threading._shutdown()  # as Py_FinalizeEx does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: the interpreter exits 120
            code = code or 120
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


class Zygote:
    """The client: one zygote per test process, started at the first call."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     cwd=Path(__file__).parent)
        self._read = b""  # answers read from the pipe, not yet returned
        atexit.register(self.close)

    def run(self, argv: list[str], env: dict, cwd: Path | None, timeout: float,
            module: str = "cosybatch") -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            out.touch()
            err.touch()
            request = {"module": module, "argv": argv, "env": env, "cwd": str(cwd or os.getcwd()), "stdout": str(out),
                       "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            pid = self._answer(60)["pid"]
            try:
                code = self._answer(timeout)["code"]
            except subprocess.TimeoutExpired:
                os.kill(pid, 9)
                self._answer(60)  # the zygote reaps it
                raise subprocess.TimeoutExpired([module, *argv], timeout, _text(out), _text(err)) from None
            return subprocess.CompletedProcess([sys.executable, "-m", module, *argv], code, _text(out), _text(err))

    def _answer(self, timeout: float) -> dict:
        """The next answer line (read straight from the pipe's descriptor, so that select sees
        everything not yet read: both answers of a short child may arrive in one read)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._read:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise subprocess.TimeoutExpired("zygote", timeout)
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the test zygote ended (exit {self.proc.wait()})")
            self._read += chunk
        line, self._read = self._read.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def _text(path: Path) -> str:
    """The bytes as subprocess.run(text=True) reads them: the locale's encoding, universal newlines."""
    return io.TextIOWrapper(io.BytesIO(path.read_bytes()), encoding=locale.getpreferredencoding(False)).read()


_zygote: dict[int, Zygote] = {}


def run(argv: list[str], env: dict, cwd: Path | None, timeout: float,
        module: str = "cosybatch") -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV` (cosybatch's CLI unless told) in a child of this process's zygote (see
    the module docstring)."""
    zygote = _zygote.get(os.getpid())
    if zygote is None or zygote.proc.poll() is not None:
        zygote = _zygote[os.getpid()] = Zygote()
    return zygote.run(argv, env, cwd, timeout, module)


if __name__ == "__main__":
    serve()
