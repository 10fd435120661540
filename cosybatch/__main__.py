"""The `cosybatch` command and `python -m cosybatch`.

Its first instruction makes SIGINT and SIGTERM raise `errors.Interrupted`, before anything heavy
is imported, so that a stop request at any moment of any command ends with the documented exit 4
and a JSON line on stdout. A run installs its own handler, which commits what is finished, once
it starts, and puts this one back when it ends.
"""

import signal

from .errors import EXIT_INTERRUPTED, Interrupted


def _stop(signum, frame):
    for s in (signal.SIGINT, signal.SIGTERM):  # one stop request is enough: the exit is under way
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def main() -> None:
    try:
        # Inside the try: a signal handled right after its handler is set (between two bytecodes of
        # this loop, before a `try` after it had begun) escaped as a traceback with exit 1.
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _stop)
        from .cli import main as cli_main

        cli_main()
    except Interrupted as exc:
        import json
        import sys

        message = f"interrupted by {exc} before any work was committed; rerun the same command"
        print(f"cosybatch: error: {message}", file=sys.stderr)
        print(json.dumps({"status": "error", "exit_code": EXIT_INTERRUPTED, "error": message}))
        sys.stdout.flush()
        raise SystemExit(EXIT_INTERRUPTED) from None


if __name__ == "__main__":
    main()
