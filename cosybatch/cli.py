"""The `cosybatch` command. It only parses options, builds a RunConfig and calls the library;
it imports no engine (so no onnxruntime, torch or CUDA) until a run starts."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from .config import RunConfig
from .engines import DEFAULT_ENGINE
from .errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TOO_MANY_FAILURES,
    EXIT_USAGE,
    CosybatchError,
    UsageError,
)

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


NOT_IN_SPECS = ("ctx", "job", "check")
# Flags kept from before --engine-opt: each sets the engine option of the same name (after
# --engine-opt, which they override); an engine without that option refuses it, naming the key.
ENGINE_OPTION_ALIASES = ("voice_dir", "speaker", "model", "prompt_wav", "prompt_text", "prompt_dir", "precision",
                         "noise_scale", "length_scale", "noise_w")


@app.command(epilog=EXIT_CODES_HELP)
def run(
    ctx: typer.Context,
    corpus: Optional[Path] = typer.Argument(None, help=D["corpus"] + " (or `corpus` in --job)", show_default=False),
    job: Optional[Path] = typer.Option(None, "--job", help="TOML or YAML file holding any of these options; "
                                       "flags given here override it."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help=D["out"] + " [default: out/CORPUS-STEM]"),
    format: Optional[str] = typer.Option(None, "--format", help=D["format"]),
    id_col: Optional[str] = typer.Option(None, help=D["id_col"]),
    text_col: str = typer.Option("text", help=D["text_col"]),
    voice_col: Optional[str] = typer.Option(None, help=D["voice_col"]),
    engine: str = typer.Option(DEFAULT_ENGINE, help=D["engine"]),
    voice: Optional[str] = typer.Option(None, help=D["voice"]),
    engine_opt: Optional[list[str]] = typer.Option(None, "--engine-opt", help="An engine setting KEY=VALUE "
                                                   "(repeatable); `[engine_options]` in a job spec."),
    voice_dir: Optional[Path] = typer.Option(None, help="Alias of --engine-opt voice_dir=DIR: voices "
                                             "NAME.onnx + NAME.onnx.json that corpus rows may name."),
    speaker: Optional[str] = typer.Option(None, help="Alias of --engine-opt speaker=NAME: a speaker of a "
                                          "multi-speaker voice."),
    model: Optional[Path] = typer.Option(None, help="Alias of --engine-opt model=DIR: the model "
                                         "folder as downloaded."),
    prompt_wav: Optional[Path] = typer.Option(None, help="Alias of --engine-opt prompt_wav=PATH: "
                                              "default zero-shot prompt audio."),
    prompt_text: Optional[str] = typer.Option(None, help="Alias of --engine-opt prompt_text=TEXT: "
                                              "what the prompt audio says."),
    prompt_dir: Optional[Path] = typer.Option(None, help="Alias of --engine-opt prompt_dir=DIR: a "
                                              "folder rows' prompt_wav paths may point into."),
    precision: Optional[str] = typer.Option(None, help="Alias of --engine-opt precision=fp32|bf16|fp16."),
    memory_fraction: float = typer.Option(0.9, help=D["memory_fraction"]),
    device: str = typer.Option("auto", help=D["device"]),
    batch_size: Optional[int] = typer.Option(None, help=D["batch_size"]),
    batch_budget: Optional[int] = typer.Option(None, help=D["batch_budget"]),
    workers: Optional[int] = typer.Option(None, help=D["workers"]),
    threads: int = typer.Option(1, help=D["threads"]),
    window: int = typer.Option(20000, help=D["window"]),
    seed: int = typer.Option(0, help=D["seed"]),
    noise_scale: Optional[float] = typer.Option(None, help="Alias of --engine-opt noise_scale=X."),
    length_scale: Optional[float] = typer.Option(None, help="Alias of --engine-opt length_scale=X."),
    noise_w: Optional[float] = typer.Option(None, help="Alias of --engine-opt noise_w=X."),
    sentence_silence: float = typer.Option(0.0, help=D["sentence_silence"]),
    normalize: bool = typer.Option(True, "--normalize/--no-normalize", help=D["normalize"]),
    shard_max_items: int = typer.Option(1000, help=D["shard_max_items"]),
    shard_max_mb: float = typer.Option(256.0, help="Close a shard once it reaches this many MiB."),
    limit: Optional[int] = typer.Option(None, help=D["limit"]),
    max_chars: int = typer.Option(20000, help=D["max_chars"]),
    max_runtime: Optional[str] = typer.Option(None, help=D["max_runtime"] + " Accepts 90, 90s, 30m, 2h."),
    max_failures: Optional[str] = typer.Option(None, help=D["max_failures"]),
    shard: Optional[str] = typer.Option(None, help="Run worker I of N (I/N), writing OUT/part-IIIII-of-NNNNN. "
                                        "N alone takes I from JOB_COMPLETION_INDEX or SLURM_ARRAY_TASK_ID."),
    metrics_file: Optional[Path] = typer.Option(None, help=D["metrics_file"]),
    pushgateway: Optional[str] = typer.Option(None, help=D["pushgateway"]),
    export: Optional[str] = typer.Option(None, help="Comma-separated dataset formats to write at the end: "
                                         "hf, nemo, lhotse."),
    restart: bool = typer.Option(False, "--restart", help=D["restart"]),
    allow_corpus_change: bool = typer.Option(False, "--allow-corpus-change", help=D["allow_corpus_change"]),
    progress: str = typer.Option("auto", help=D["progress"]),
    log_every: float = typer.Option(30.0, help=D["log_every"]),
    check: bool = typer.Option(False, "--check", help="Check the options, job spec, corpus columns and voice, "
                               "print the resolved settings as JSON, and exit without synthesising."),
) -> None:
    """Synthesise every row of CORPUS into WAV shards under --out; rerun to resume.

    The last line on stdout is a one-line JSON summary.
    """
    _setup_logging()
    values = {k: v for k, v in locals().items() if k not in NOT_IN_SPECS}
    try:
        if job is not None:
            values.update(_spec_values(ctx, job))
        cfg = _build_config(values)
        if check:
            from .job import check as check_job

            print(json.dumps(check_job(cfg), default=str))
            raise typer.Exit(EXIT_OK)
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
        f"{s['items_failed']} failed; padding {s['padding_ratio']:.1%}; output in {s['out']}",
        file=sys.stderr,
    )
    print(result.summary_line())
    raise typer.Exit(result.exit_code)


def _spec_values(ctx: typer.Context, job: Path) -> dict:
    """Spec values for every option not given on the command line, checked against the type of
    the matching flag."""
    import difflib
    import typing

    from .jobspec import load_job_spec

    hints = {k: v for k, v in typing.get_type_hints(run).items() if k not in NOT_IN_SPECS and k != "return"}
    values = {}
    for key, value in load_job_spec(job).items():
        if key == "engine_options":  # the engine's own table; its keys are checked by the engine
            if not isinstance(value, dict):
                raise UsageError(f"--job {job}: engine_options must be a table of KEY = value")
            values[key] = value
            continue
        if key not in hints:
            close = difflib.get_close_matches(key, hints, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; options are: {', '.join(sorted(hints))}"
            raise UsageError(f"--job {job}: unknown key {key!r}{hint}")
        source = ctx.get_parameter_source(key)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            continue  # a flag on the command line overrides the spec
        if key == "export" and isinstance(value, list):
            value = ",".join(map(str, value))
        values[key] = _typed(job, key, value, hints[key])
    return values


def _typed(job: Path, key: str, value, hint):
    """A spec value as the flag's type: int, float, bool, str or Path (each maybe Optional)."""
    import typing

    from .jobspec import quote

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    target = args[0] if args else hint
    if value is None and args:
        return None
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, (str, int, float)) and not isinstance(value, bool),
        Path: isinstance(value, str),
    }.get(target, False)
    if not ok:
        raise UsageError(f"--job {job}: {key} = {quote(value)} should be a {getattr(target, '__name__', target)}")
    return target(value)


def _build_config(v: dict) -> RunConfig:
    from .distributed import parse_shard

    if v["corpus"] is None:
        raise UsageError("no corpus: give CORPUS or `corpus` in the --job spec")
    options = dict(v.pop("engine_options", None) or {})
    for item in v.pop("engine_opt", None) or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--engine-opt {item!r}: give KEY=VALUE")
        options[key.strip()] = value
    for name in ENGINE_OPTION_ALIASES:
        value = v.pop(name, None)
        if value is not None:
            options[name] = value
    shard_index, shard_count = parse_shard(v.pop("shard"))
    max_runtime = _seconds(v.pop("max_runtime"), "--max-runtime")
    export = tuple(x.strip() for x in (v.pop("export") or "").split(",") if x.strip())
    shard_max_bytes = max(1, int(v.pop("shard_max_mb") * 1024 * 1024))
    out = v.pop("out") or Path("out") / _stem(v["corpus"])
    return RunConfig(**v, out=out, shard_index=shard_index, shard_count=shard_count, max_runtime=max_runtime,
                     export=export, shard_max_bytes=shard_max_bytes, engine_options=options)


@app.command("ray-run", epilog=EXIT_CODES_HELP)
def ray_run_cmd(
    ctx: typer.Context,
    corpus: Optional[Path] = typer.Argument(None, help=D["corpus"] + " (or `corpus` in --job)", show_default=False),
    job: Optional[Path] = typer.Option(None, "--job", help="A `cosybatch run` job spec; flags here override it."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help=D["out"] + " [default: out/CORPUS-STEM]"),
    voice: Optional[str] = typer.Option(None, help=D["voice"]),
    batch_size: Optional[int] = typer.Option(None, help=D["batch_size"]),
    seed: int = typer.Option(0, help=D["seed"]),
    restart: bool = typer.Option(False, "--restart", help=D["restart"]),
    progress: str = typer.Option("auto", help=D["progress"]),
    address: Optional[str] = typer.Option(None, help="Ray cluster: unset starts a local one; 'auto' joins the "
                                          "running one; or ray://HOST:10001."),
    actors: int = typer.Option(2, help="Actors in the pool, each holding one engine."),
    num_gpus: float = typer.Option(0.0, help="GPUs per actor."),
    num_cpus: float = typer.Option(1.0, help="CPUs per actor."),
    rows_per_task: int = typer.Option(64, help="Rows per actor call; each call writes one tar shard."),
) -> None:
    """Run the job on a Ray cluster: Ray Data reads the corpus, an actor pool synthesises it.

    Same engines, shard format, manifest and stats as `cosybatch run`; rerun to resume.
    """
    _setup_logging()
    ray_flags = {"address": address, "actors": actors, "num_gpus": num_gpus, "num_cpus": num_cpus,
                 "rows_per_task": rows_per_task}
    given = {k: v for k, v in locals().items() if k in ("corpus", "out", "voice", "batch_size", "seed", "restart",
                                                        "progress")}
    try:
        from .ray_run import RayOptions
        from .ray_run import ray_run as run_on_ray

        values = _run_defaults()
        if job is not None:
            values.update(_spec_values(ctx, job))
        for key, value in given.items():
            source = ctx.get_parameter_source(key)
            if job is None or (source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")):
                values[key] = value
        result = run_on_ray(_build_config(values), RayOptions(**ray_flags))
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
        _fail("ray-run needs Ray: pip install 'cosybatch[ray]'", EXIT_USAGE)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted while the Ray cluster was starting; rerun to resume", EXIT_INTERRUPTED)
    print(result.summary_line())
    raise typer.Exit(result.exit_code)


def _run_defaults() -> dict:
    import inspect

    return {name: p.default.default if hasattr(p.default, "default") else p.default
            for name, p in inspect.signature(run).parameters.items() if name not in NOT_IN_SPECS}


@app.command()
def status(
    out: Path = typer.Argument(..., help="A job's output folder (or a sharded job's root)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a line of text."),
) -> None:
    """Show done/failed/total, rate and ETA of a running or finished job without disturbing it."""
    from .status import describe, job_status

    try:
        result = job_status(out)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    print(json.dumps(result) if as_json else describe(result))


@app.command("verify")
def verify_cmd(
    out: Path = typer.Argument(..., help="A job's output folder (or a sharded job's root)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """Read every shard whole and check it against the manifest: each id in exactly one readable
    KEY.wav + KEY.json pair with the manifest's length. Exit 0 when all is well, 3 listing each
    problem otherwise."""
    from .verify import describe, verify

    try:
        result = verify(out)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    print(json.dumps(result) if as_json else describe(result))
    raise typer.Exit(EXIT_OK if result["ok"] else EXIT_BAD_INPUT)


@app.command("engines")
def engines_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """List the installed engines (built-in and plugins) and the options each takes (--engine-opt)."""
    import dataclasses

    from .config import field_docs
    from .engines import engine_class, engine_names

    listing = {}
    for name in engine_names():
        try:
            cls = engine_class(name)
        except CosybatchError as exc:
            listing[name] = {"error": str(exc)}
            continue
        docs = field_docs(cls.Options) if dataclasses.fields(cls.Options) else {}
        listing[name] = {"class": f"{cls.__module__}.{cls.__qualname__}", "multi_voice": cls.multi_voice,
                         "zero_shot": cls.zero_shot,
                         "options": {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls.Options)}}
    if as_json:
        print(json.dumps(listing))
        return
    for name, info in listing.items():
        print(f"{name}: {info.get('class', info.get('error'))}")
        for key, doc in info.get("options", {}).items():
            print(f"  --engine-opt {key}=...  {doc}")


@app.command()
def merge(
    root: Path = typer.Argument(..., help="The --out folder of a job run with --shard."),
    partial: bool = typer.Option(False, "--partial", help="Merge the finished parts even if some are not."),
) -> None:
    """Present the workers' outputs of a sharded job as one dataset: ROOT/manifest.parquet."""
    from .distributed import merge as merge_parts

    try:
        result = merge_parts(root, allow_partial=partial)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    print(json.dumps(result))


@app.command("export")
def export_cmd(
    out: Path = typer.Argument(..., help="A finished output folder (or a sharded job's root)."),
    to: str = typer.Option(..., "--to", help="Comma-separated formats: hf, nemo, lhotse."),
) -> None:
    """Write the dataset in other formats under OUT/exports/."""
    from .exports import export

    try:
        written = {fmt: str(export(out, fmt.strip())) for fmt in to.split(",") if fmt.strip()}
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    print(json.dumps(written))


def _seconds(text: Optional[str], option: str) -> Optional[float]:
    """'90', '90s', '30m', '2h', '7h50m' -> seconds."""
    import re

    if text is None:
        return None
    value = text.strip().lower()
    try:
        return float(value)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise UsageError(f"{option} {text!r}: give seconds (90), or 90s, 30m, 2h, 7h50m")
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(float(n) * units[u] for n, u in parts)


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
    print(json.dumps({"status": "error", "exit_code": code, "error": message}))
    raise typer.Exit(code)


def main() -> None:
    """Every way out after the options are parsed ends with one JSON line on stdout, even an
    internal error (exit 1), so Airflow's XCom always gets a summary."""
    try:
        app()
    except SystemExit:
        raise
    except KeyboardInterrupt:  # SIGINT, or SIGTERM before a run installed its own handler
        _exit_with("interrupted before any work was committed; rerun to start", EXIT_INTERRUPTED)
    except Exception as exc:
        logging.getLogger("cosybatch").exception("internal error: %s", exc)
        _exit_with(f"internal error: {exc!r}; please report it with the log above", EXIT_INTERNAL)


def _exit_with(message: str, code: int) -> None:
    print(f"cosybatch: error: {message}", file=sys.stderr)
    print(json.dumps({"status": "error", "exit_code": code, "error": message}))
    raise SystemExit(code)
