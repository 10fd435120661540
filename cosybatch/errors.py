"""Error classes and the process exit codes they map to.

Every error the user can cause carries a message that says what to do next.
"""

from __future__ import annotations

# Exit codes, documented in docs/troubleshooting.md and in `cosybatch run --help`.
EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
EXIT_INTERRUPTED = 4
EXIT_TOO_MANY_FAILURES = 5


class CosybatchError(Exception):
    """Base class for errors that end a run with a clear message and no traceback."""

    exit_code = EXIT_INTERNAL


class UsageError(CosybatchError):
    """Bad options or a bad combination of options."""

    exit_code = EXIT_USAGE


class CorpusError(CosybatchError):
    """The corpus file as a whole cannot be used (missing column, unknown format, unreadable)."""

    exit_code = EXIT_BAD_INPUT


class ResumeMismatchError(CosybatchError):
    """The output folder holds a run made with a different corpus or output-changing settings."""

    exit_code = EXIT_USAGE


class VoiceError(CosybatchError):
    """A voice cannot be found or loaded."""

    exit_code = EXIT_USAGE


class EngineError(CosybatchError):
    """An engine broke its contract (a plugin's bug, not the user's): `check` or `describe` returned
    no dict or raised something other than a CosybatchError. The message names the engine."""

    exit_code = EXIT_INTERNAL


class DamagedOutputError(CosybatchError):
    """A finished output folder no longer holds what its journal says (a shard deleted, cut or
    unreadable). Rerunning the job's `cosybatch run` repairs it."""

    exit_code = EXIT_BAD_INPUT


class OutputError(CosybatchError):
    """Writing the output failed (disk full, folder gone). Committed work is intact: resumable."""

    exit_code = EXIT_INTERRUPTED


class PieceTooLong(Exception):
    """Raised by an engine's `synthesize` for a piece whose audio would run past the engine-level cap
    (`cosybatch.engines.base.MAX_PIECE_SECONDS`), before its audio is allocated: the row fails with
    the message, the job goes on."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM while no run is there to stop cleanly (start-up, a command other than a
    run). A BaseException, like KeyboardInterrupt, so no `except Exception` swallows it, but not a
    KeyboardInterrupt, so click's own Ctrl-C handling (exit 1 or 130, no JSON line) never sees it:
    it reaches `cosybatch.__main__`, which exits 4 with the JSON line."""
