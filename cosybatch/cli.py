"""The `cosybatch` command. It only parses options, builds a RunConfig and calls the library;
it imports no engine (so no onnxruntime, torch or CUDA) until a run starts."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from .config import RunConfig
from .errors import (EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK,
                     EXIT_TOO_MANY_FAILURES, EXIT_USAGE, CosybatchError, UsageError)

EXIT_CODES_HELP = (
    f"Exit codes: {EXIT_OK} complete; {EXIT_USAGE} usage error; {EXIT_BAD_INPUT} bad input data; "
    f"{EXIT_INTERRUPTED} interrupted, resumable (rerun the same command); "
    f"{EXIT_TOO_MANY_FAILURES} failure threshold exceeded; {EXIT_INTERNAL} internal error."
)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Turn text corpora into speech datasets: batched, resumable, sharded TTS.")
D = RunConfig.field_docs()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    if version:
        from . import __version__

        print(__version__)
        raise typer.Exit(0)


@app.command(epilog=EXIT_CODES_HELP)
def run(
    corpus: Path = typer.Argument(..., help=D["corpus"], show_default=False),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help=D["out"] + " [default: out/CORPUS-STEM]"),
    format: Optional[str] = typer.Option(None, "--format", help=D["format"]),
    id_col: Optional[str] = typer.Option(None, help=D["id_col"]),
    text_col: str = typer.Option("text", help=D["text_col"]),
    voice_col: Optional[str] = typer.Option(None, help=D["voice_col"]),
    engine: str = typer.Option("piper", help=D["engine"]),
    voice: Optional[str] = typer.Option(None, help=D["voice"]),
    voice_dir: Optional[Path] = typer.Option(None, help=D["voice_dir"]),
    speaker: Optional[str] = typer.Option(None, help=D["speaker"]),
    device: str = typer.Option("auto", help=D["device"]),
    batch_size: Optional[int] = typer.Option(None, help=D["batch_size"]),
    batch_budget: Optional[int] = typer.Option(None, help=D["batch_budget"]),
    workers: Optional[int] = typer.Option(None, help=D["workers"]),
    threads: int = typer.Option(1, help=D["threads"]),
    window: int = typer.Option(20000, help=D["window"]),
    seed: int = typer.Option(0, help=D["seed"]),
    noise_scale: Optional[float] = typer.Option(None, help=D["noise_scale"]),
    length_scale: Optional[float] = typer.Option(None, help=D["length_scale"]),
    noise_w: Optional[float] = typer.Option(None, help=D["noise_w"]),
    sentence_silence: float = typer.Option(0.0, help=D["sentence_silence"]),
    normalize: bool = typer.Option(True, "--normalize/--no-normalize", help=D["normalize"]),
    shard_max_items: int = typer.Option(1000, help=D["shard_max_items"]),
    shard_max_mb: float = typer.Option(256.0, help="Close a shard once it reaches this many MiB."),
    limit: Optional[int] = typer.Option(None, help=D["limit"]),
    max_chars: int = typer.Option(20000, help=D["max_chars"]),
    max_runtime: Optional[str] = typer.Option(None, help=D["max_runtime"] + " Accepts 90, 90s, 30m, 2h."),
    max_failures: Optional[str] = typer.Option(None, help=D["max_failures"]),
    restart: bool = typer.Option(False, "--restart", help=D["restart"]),
    progress: str = typer.Option("auto", help=D["progress"]),
    log_every: float = typer.Option(30.0, help=D["log_every"]),
) -> None:
    """Synthesise every row of CORPUS into WAV shards under --out; rerun to resume.

    The last line on stdout is a one-line JSON summary.
    """
    _setup_logging()
    try:
        cfg = RunConfig(
            corpus=corpus, out=out or Path("out") / _stem(corpus), format=format, id_col=id_col,
            text_col=text_col, voice_col=voice_col, engine=engine, voice=voice, voice_dir=voice_dir,
            speaker=speaker, device=device, batch_size=batch_size, batch_budget=batch_budget,
            workers=workers, threads=threads, window=window, seed=seed, noise_scale=noise_scale,
            length_scale=length_scale, noise_w=noise_w, sentence_silence=sentence_silence,
            normalize=normalize, shard_max_items=shard_max_items,
            shard_max_bytes=max(1, int(shard_max_mb * 1024 * 1024)), limit=limit, max_chars=max_chars,
            max_runtime=_seconds(max_runtime, '--max-runtime'), max_failures=max_failures, restart=restart,
            progress=progress, log_every=log_every,
        )
        from .job import run as run_job

        result = run_job(cfg)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted before any work was committed; rerun to start", EXIT_INTERRUPTED)
    s = result.stats
    print(
        f"cosybatch: {result.status}: {s['items_done']} items ({s['audio_seconds']:.1f} audio-s) in "
        f"{s['wall_seconds']:.1f} s, {s['audio_seconds_per_wall_second'] or 0:.1f} audio-s/s, "
        f"{s['items_failed']} failed; padding {s['padding_ratio']:.1%}; output in {cfg.out}",
        file=sys.stderr,
    )
    print(result.summary_line())
    raise typer.Exit(result.exit_code)


def _seconds(text: Optional[str], option: str) -> Optional[float]:
    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    value = text.strip().lower()
    scale = units.get(value[-1:], None)
    try:
        return float(value[:-1]) * scale if scale else float(value)
    except ValueError:
        raise UsageError(f"{option} {text!r}: give seconds (90), or 90s, 30m, 2h") from None


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".ndjson", ".parquet", ".pq"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name or "corpus"


def _setup_logging() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s cosybatch %(levelname)s %(message)s")


def _fail(message: str, code: int) -> None:
    print(f"cosybatch: error: {message}", file=sys.stderr)
    import json

    print(json.dumps({"status": "error", "exit_code": code, "error": message}))
    raise typer.Exit(code)


def main() -> None:
    try:
        app()
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - last resort: say what happened, exit "internal"
        logging.getLogger("cosybatch").exception("internal error: %s", exc)
        raise SystemExit(EXIT_INTERNAL) from None
