"""The `cosybatch` command and `python -m cosybatch`.

The first thing it does is make SIGTERM behave like Ctrl-C, before anything heavy is imported, so
that a stop request at any moment of start-up ends with the documented exit 4 and a JSON line (a
run installs its own handler, which commits what is finished, once it starts).
"""

import signal

from .errors import EXIT_INTERRUPTED


def _stop(signum, frame):
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)
    try:
        from .cli import main as cli_main
    except KeyboardInterrupt:
        import json
        import sys

        message = "interrupted while starting; nothing was written; rerun to start"
        print(f"cosybatch: error: {message}", file=sys.stderr)
        print(json.dumps({"status": "error", "exit_code": EXIT_INTERRUPTED, "error": message}))
        raise SystemExit(EXIT_INTERRUPTED) from None
    cli_main()


if __name__ == "__main__":
    main()
