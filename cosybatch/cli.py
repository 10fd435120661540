"""The `cosybatch` command. It only parses options, builds a RunConfig and calls the library;
it imports no engine (so no onnxruntime, torch or CUDA) until a run starts."""

from __future__ import annotations

import inspect
import json
import logging
import os
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
    Interrupted,
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


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        print(__version__)
        raise typer.Exit(0)


@app.callback()
def _root(
    # Eager: handled while parsing, so `cosybatch --version` needs no command after it.
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                 callback=_print_version),
) -> None:
    pass


NOT_IN_SPECS = ("ctx", "job", "check", "plan_only", "rate")


def _engine_aliases() -> dict:
    """The installed engines' flags that each set the engine option of the same name (after
    --engine-opt, which they override; an engine without that option refuses it, naming the key):
    option -> (type, help). Declared by each engine (`Engine.aliases`); imports engine classes,
    never their runtimes."""
    from .engines import engine_aliases

    found = {}
    for option, declared in engine_aliases().items():
        helps: dict[str, list[str]] = {}  # one help -> the engines that give it
        for engine, alias in declared:
            helps.setdefault(alias.help, []).append(engine)
        said = "; ".join(text.rstrip(".") if len(helps) == 1 else f"{', '.join(names)}: {text.rstrip('.')}"
                         for text, names in helps.items())
        found[option] = (declared[0][1].kind, f"Alias of --engine-opt {option}=...: {said}.")
    return found


ENGINE_OPTION_ALIASES = _engine_aliases()
# RunConfig fields the command line spells differently; every other field is `--field-name`,
# with its type, default and docstring taken from RunConfig itself.
FROM_OTHER_FLAGS = ("corpus", "shard_index", "shard_count", "max_runtime", "shard_max_bytes", "export",
                    "engine_options", "qc_limits", "voice_pool", "voice_map")
# Options a job spec may give as a list or a table, handed to RunConfig as they are (it parses them).
SPEC_STRUCTURES = ("voice_pool", "voice_map")
FLAG_DECLS = {"out": ("--out", "-o"), "restart": ("--restart",), "export_copy": ("--export-copy",),
              "allow_corpus_change": ("--allow-corpus-change",)}
HELP_SUFFIX = {"out": " [default: out/CORPUS-STEM]"}
# `run --help` in panels; an option named in none (a new RunConfig field) shows under "Operations".
INPUT, ENGINE, BATCHING, OUTPUT, QUALITY, OPERATIONS = "Input", "Engine", "Batching", "Output", "Quality", "Operations"
PANELS = {
    INPUT: ("job", "format", "id_col", "text_col", "voice_col", "limit", "max_chars", "allow_corpus_change"),
    ENGINE: ("engine", "voice", "voice_pool", "voice_pool_mode", "voice_map", "engine_opt", "device",
             "memory_fraction", "threads", "seed"),
    BATCHING: ("batch_size", "batch_budget", "workers", "window"),
    OUTPUT: ("out", "sentence_silence", "normalize", "shard_max_items", "shard_max_mb", "export", "export_copy",
             "restart"),
    QUALITY: ("qc", "qc_asr_rows", "qc_sample", "qc_asr_model", "qc_max_cer", "qc_max_wer", "qc_retries",
              "qc_on_fail"),
    OPERATIONS: ("max_runtime", "max_failures", "shard", "metrics_file", "pushgateway", "metrics_job", "progress",
                 "log_every", "check", "plan_only", "rate"),
}
PANEL_OF = {name: panel for panel, names in PANELS.items() for name in names}
RAY = "Ray"  # ray-run's own flags


def _option(name: str, annotation, default, help: str, decls=(), metavar=None, panel=None) -> inspect.Parameter:
    from rich.markup import escape

    # Help is plain text: escaped, so `[engine_options]` or `[default: ...]` is shown, not read as markup.
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *decls, help=escape(help), metavar=metavar,
                                                  rich_help_panel=panel or PANEL_OF.get(name, OPERATIONS)))


def _run_parameters() -> list[inspect.Parameter]:
    """The `run` command's parameters: RunConfig's fields, then the flags that build the rest."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(RunConfig)
    params = [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        inspect.Parameter("corpus", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[Path],
                          default=typer.Argument(None, help=D["corpus"] + " (or `corpus` in --job)",
                                                 show_default=False)),
        _option("job", Optional[Path], None, "TOML or YAML file holding any of these options; flags given here "
                "override it.", ("--job",)),
    ]
    for f in dataclasses.fields(RunConfig):
        if f.name in FROM_OTHER_FLAGS:
            continue
        annotation = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name == "out":
            annotation, default = Optional[Path], None  # from the corpus name when unset
        params.append(_option(f.name, annotation, default, D[f.name] + HELP_SUFFIX.get(f.name, ""),
                              FLAG_DECLS.get(f.name, ())))
    params += [
        _option("engine_opt", Optional[list[str]], None, "An engine setting KEY=VALUE (repeatable); "
                "`[engine_options]` in a job spec. `cosybatch engines` lists each engine's.", ("--engine-opt",),
                "KEY=VALUE"),
        *(_option(name, Optional[kind], None, help, panel=ENGINE)
          for name, (kind, help) in ENGINE_OPTION_ALIASES.items()),
        _option("shard", Optional[str], None, "Run worker I of N (I/N), writing OUT/part-IIIII-of-NNNNN. N alone "
                "takes I from JOB_COMPLETION_INDEX or SLURM_ARRAY_TASK_ID."),
        _option("max_runtime", Optional[str], None, D["max_runtime"] + " Accepts 90, 90s, 30m, 2h."),
        _option("shard_max_mb", float, 256.0, "Close a shard once it reaches this many MiB."),
        _option("export", Optional[str], None, "Comma-separated dataset formats to write at the end: hf, nemo, "
                "lhotse."),
        _option("voice_pool", Optional[str], None, D["voice_pool"] + " A job spec may give a list (of strings or "
                "tables {voice, speaker, prompt_wav, prompt_text, weight}).", metavar="SPEC"),
        _option("voice_map", Optional[str], None, D["voice_map"] + " Example: en=VOICE,de=VOICE|VOICE; a job spec's "
                "[voice_map] table.", metavar="LANG=VOICE,..."),
        _option("check", bool, False, "Check the options, job spec, corpus columns and voice, print the resolved "
                "settings as JSON, and exit without synthesising.", ("--check",)),
        _option("plan_only", bool, False, "As --check, then read the whole corpus, prepare every row as the run "
                "would (the engine is opened) and plan the batches; print the rows, the predicted hours of audio, "
                "the batches, and with a known rate the wall time and disk size, as JSON under \"plan\". "
                "Synthesises and writes nothing.", ("--plan-only",)),
        _option("rate", Optional[float], None, "With --plan-only: the audio-seconds per wall-second to predict "
                "the wall time with (default: that of a complete earlier run of the same engine, voice and "
                "device in the output root).", ("--rate",), "AUDIO_S_PER_S"),
    ]
    return params[:2] + _by_panel(params[2:])


def _by_panel(options: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """Options in the order of their panels (an option's place only orders --help)."""
    order = list(PANELS)
    return sorted(options, key=lambda p: order.index(p.default.rich_help_panel))


def run(ctx: typer.Context, **values) -> None:
    """Synthesise every row of CORPUS into WAV shards under --out; rerun to resume.

    The last line on stdout is a one-line JSON summary.
    """
    _setup_logging()
    job, check = values.pop("job"), values.pop("check")
    plan_only, rate = values.pop("plan_only"), values.pop("rate")
    try:
        if job is not None:
            values.update(_spec_values(ctx, job))
        cfg = _build_config(values)
        if rate is not None and (not plan_only or not rate > 0):
            raise UsageError("--rate is for --plan-only, and must be > 0 (audio-seconds per wall-second)")
        if plan_only:
            from .run.forecast import plan_only as plan_job

            result = plan_job(cfg, rate)
            print(_plan_line(result["plan"]), file=sys.stderr)
            print(json.dumps(result, default=str))
            raise typer.Exit(EXIT_OK)
        if check:
            from .run.preflight import check as check_job

            print(json.dumps(check_job(cfg), default=str))
            raise typer.Exit(EXIT_OK)
        from .run.local import run as run_job

        result = run_job(cfg)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    except (KeyboardInterrupt, Interrupted):
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


def _plan_line(plan: dict) -> str:
    """`run --plan-only`'s one human line on stderr."""
    audio = plan["audio_seconds"]
    line = (f"cosybatch: plan: {plan['rows']} rows ({plan['rows_failing']} would fail before synthesis), "
            f"{plan['pieces']} pieces in {plan['batches']} batches, "
            + (f"about {_span(audio)} of audio" if isinstance(audio, float) else "audio length unknown"))
    if isinstance(plan.get("wall_seconds"), float):
        rate = plan["rate"]["audio_seconds_per_wall_second"]
        line += f", about {_span(plan['wall_seconds'])} of wall time at {rate:g} audio-s/s"
    if isinstance(plan.get("disk_bytes"), int):
        size = plan["disk_bytes"]
        line += f", about {size / 2**30:.1f} GiB" if size >= 2**30 else f", about {size / 2**20:.1f} MiB"
        line += " of shards"
    return line


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


run.__signature__ = inspect.Signature(_run_parameters())
app.command(epilog=EXIT_CODES_HELP)(run)


def _spec_values(ctx: typer.Context, job: Path) -> dict:
    """Spec values for every option not given on the command line, checked against the type of
    the matching flag."""
    import difflib

    from .jobspec import load_job_spec

    hints = {name: p.annotation for name, p in inspect.signature(run).parameters.items() if name not in NOT_IN_SPECS}
    values = {}
    spec_options: dict = {}
    for key, value in load_job_spec(job).items():
        if key == "engine_options":  # the engine's own table; its keys are checked by the engine
            if not isinstance(value, dict):
                raise UsageError(f"--job {job}: engine_options must be a table of KEY = value")
            spec_options.update(value)
            continue
        if key == "qc" and isinstance(value, dict):  # the [qc] table: mode, the qc_* options, thresholds
            qc_values, limits = _qc_table(job, value, hints)
            for name, given in qc_values.items():
                source = ctx.get_parameter_source(name)
                if source is None or source.name not in ("COMMANDLINE", "ENVIRONMENT"):
                    values[name] = given
            if limits:
                values["qc_limits"] = limits
            continue
        if key in ENGINE_OPTION_ALIASES:  # a spec's alias keys are its engine options; flags override both
            spec_options.setdefault(key, value)
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
        if key in SPEC_STRUCTURES and isinstance(value, (list, dict)):
            values[key] = value  # RunConfig parses and checks it
            continue
        values[key] = _typed(job, key, value, hints[key])
    if spec_options:
        values["engine_options"] = spec_options
    return values


def _qc_table(job: Path, table: dict, hints: dict) -> tuple[dict, dict]:
    """A job spec's [qc] table -> (qc_* option values, signal thresholds). `mode` is --qc; a key
    named like a --qc-* flag without its prefix sets that flag; the rest are thresholds, checked by
    RunConfig against the known names."""
    values, limits = {}, {}
    for key, value in table.items():
        key = str(key).replace("-", "_")
        name = "qc" if key == "mode" else f"qc_{key}"
        if name in hints and name != "qc_limits":
            values[name] = _typed(job, f"qc.{key}", value, hints[name])
        else:
            limits[key] = value
    return values, limits


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
    from .store.distributed import parse_shard

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
    shard_max_mb = v.pop("shard_max_mb")
    if not 0 < shard_max_mb < float("inf"):
        raise UsageError(f"--shard-max-mb must be a finite number > 0 (got {shard_max_mb})")
    shard_max_bytes = max(1, int(shard_max_mb * 1024 * 1024))
    out = v.pop("out") or Path("out") / _stem(v["corpus"])
    voices = {name: v.pop(name) for name in SPEC_STRUCTURES if name in v}
    voices = {name: value for name, value in voices.items() if value is not None}
    return RunConfig(**v, **voices, out=out, shard_index=shard_index, shard_count=shard_count, max_runtime=max_runtime,
                     export=export, shard_max_bytes=shard_max_bytes, engine_options=options)


# The `run` options ray-run takes on its command line (a job spec may hold any; ray-run refuses
# those it cannot honour), declared once: in RunConfig.
RAY_RUN_SHARED = ("corpus", "out", "voice", "voice_pool", "voice_map", "engine", "engine_opt", "batch_size", "seed",
                  "restart", "progress", "qc",
                  "qc_asr_rows", "qc_max_cer", "qc_retries", "qc_on_fail")
RAY_FLAGS = ("address", "actors", "num_gpus", "num_cpus", "rows_per_task")


def _ray_run_parameters() -> list[inspect.Parameter]:
    shared = {p.name: p for p in _run_parameters()}
    job = _option("job", Optional[Path], None, "A `cosybatch run` job spec; flags here override it.", ("--job",))
    return [shared["ctx"], shared["corpus"], *_by_panel([job, *(shared[name] for name in RAY_RUN_SHARED[1:])]),
            _option("address", Optional[str], None, "Ray cluster: unset starts a local one; 'auto' joins the "
                    "running one; or ray://HOST:10001.", panel=RAY),
            _option("actors", int, 2, "Actors in the pool, each holding one engine.", panel=RAY),
            _option("num_gpus", float, 0.0, "GPUs per actor.", panel=RAY),
            _option("num_cpus", float, 1.0, "CPUs per actor.", panel=RAY),
            _option("rows_per_task", int, 64, "Rows per actor call; each call writes one tar shard.", panel=RAY)]


def ray_run_cmd(ctx: typer.Context, **given) -> None:
    """Run the job on a Ray cluster: Ray Data reads the corpus, an actor pool synthesises it.

    Same engines, shard format, manifest and stats as `cosybatch run`; rerun to resume.
    """
    _setup_logging()
    ray_flags = {name: given.pop(name) for name in RAY_FLAGS}
    job = given.pop("job")
    try:
        from .run.ray import RayOptions
        from .run.ray import ray_run as run_on_ray

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
    except (KeyboardInterrupt, Interrupted):
        _fail("interrupted while the Ray cluster was starting; rerun to resume", EXIT_INTERRUPTED)
    print(result.summary_line())
    raise typer.Exit(result.exit_code)


ray_run_cmd.__signature__ = inspect.Signature(_ray_run_parameters())
app.command("ray-run", epilog=EXIT_CODES_HELP)(ray_run_cmd)


def _run_defaults() -> dict:
    return {name: p.default.default if hasattr(p.default, "default") else p.default
            for name, p in inspect.signature(run).parameters.items() if name not in NOT_IN_SPECS}


@app.command()
def status(
    out: Path = typer.Argument(..., help="A job's output folder (or a sharded job's root)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a line of text."),
) -> None:
    """Show done/failed/total, rate and ETA of a running or finished job without disturbing it."""
    from .store.status import describe, job_status

    try:
        result = job_status(out)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    _print(json.dumps(result) if as_json else describe(result))


@app.command("verify")
def verify_cmd(
    out: Path = typer.Argument(..., help="A job's output folder (or a sharded job's root)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """Read every shard whole and check it against the manifest: each id in exactly one readable
    KEY.wav + KEY.json pair with the manifest's length. Exit 0 when all is well, 3 listing each
    problem otherwise."""
    from .store.verify import describe, verify

    try:
        result = verify(out)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    _print(json.dumps(result) if as_json else describe(result))
    raise typer.Exit(EXIT_OK if result["ok"] else EXIT_BAD_INPUT)


@app.command("qc")
def qc_cmd(
    out: Path = typer.Argument(..., help="A finished job's output folder, one part of a sharded job, or its root."),
    asr: bool = typer.Option(False, "--asr", help="Also transcribe with Whisper and score CER/WER (the "
                             "cosybatch[qc] extra)."),
    asr_rows: str = typer.Option("flagged", "--asr-rows", help="With --asr: flagged, all or sample."),
    asr_model: Optional[Path] = typer.Option(None, "--asr-model", help="CTranslate2 Whisper folder; unset: "
                                             "Whisper tiny.en from the cosybatch[qc] extra."),
    sample: float = typer.Option(0.1, "--sample", help="With --asr-rows sample: the share of unflagged clips."),
    max_cer: float = typer.Option(0.2, "--max-cer", help="A transcribed clip fails above this CER."),
    seed: int = typer.Option(0, "--seed", help="Seeds the sample and the page's random clips."),
    device: str = typer.Option("cpu", "--device", help="Where the ASR runs: cpu or cuda."),
    report: bool = typer.Option(True, "--report/--no-report", help="Write OUT/report.html."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Score a finished folder with the quality signals (and the ASR round trip): writes
    OUT/qc.parquet (one row per clip) and OUT/report.html, and never touches the shards."""
    from .qc.audit import audit
    from .qc.gate import Limits, QCSettings

    try:
        settings = QCSettings("asr" if asr else "gate", asr_rows, sample, 0, "drop", Limits(max_cer=max_cer))
        transcriber = None
        if asr:
            from .qc.asr import Transcriber, ready_model

            transcriber = Transcriber(ready_model(asr_model), device)
        summary = audit(out, settings, transcriber, seed=seed, report=report)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    if as_json:
        _print(json.dumps(summary))
    else:
        _print(f"{summary['clips']} clips scored: {summary['flagged']} flagged, {summary['failed']} fail the gate"
               + (f", {summary['transcribed']} transcribed (mean CER {summary['cer_mean']})" if asr else "")
               + f"; wrote {Path(out) / 'qc.parquet'}" + (f" and {Path(out) / 'report.html'}" if report else ""))


@app.command("doctor")
def doctor_cmd(
    device: Optional[str] = typer.Option(None, "--device", help="cuda: exit 2 unless every engine checked can run "
                                         "on CUDA here."),
    engine: Optional[str] = typer.Option(None, "--engine", help="Check this engine only (default: each installed "
                                         "engine whose GPU runtime, torch or onnxruntime, is installed)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """Report the install: cosybatch, Python, torch and its CUDA build, the GPUs and their free memory,
    the GPU allocator backend, which onnxruntime builds are installed and their providers, and
    whether each engine could run with --device cuda."""
    from .doctor import describe, diagnose

    try:
        report = diagnose(device=device, engine=engine)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    _print(json.dumps(report) if as_json else describe(report))
    if not report["ok"]:
        if as_json:  # the report is the last line, with its exit_code and error
            raise typer.Exit(report["exit_code"])
        _fail(report["error"], report["exit_code"])


@app.command("quantize")
def quantize_cmd(
    voice: Optional[str] = typer.Option(None, "--voice", help="A voice name found in --voice-dir, or a path to "
                                        "NAME.onnx (NAME.onnx.json beside it); default: the bundled voice."),
    voice_dir: Optional[Path] = typer.Option(None, "--voice-dir", help="Folder holding NAME.onnx + NAME.onnx.json."),
    engine: str = typer.Option(DEFAULT_ENGINE, "--engine", help="The engine whose quantize step runs (an engine "
                               "without one refuses)."),
) -> None:
    """Build an engine's quantised model ahead of a run. Piper: the calibrated INT8 copy of a voice,
    into the cache ($XDG_CACHE_HOME/cosybatch), as `run --precision int8` does on first use; run it
    once ahead of sharded workers. Prints JSON."""
    _setup_logging()
    from .engines import quantize

    try:
        result = quantize(engine, voice, {} if voice_dir is None else {"voice_dir": voice_dir})
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    print(json.dumps(result))


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
    """Present the workers' outputs of a sharded job as one dataset: ROOT/manifest.parquet, and its
    card ROOT/README.md."""
    from .store.card import write_card
    from .store.distributed import merge as merge_parts

    try:
        result = merge_parts(root, allow_partial=partial)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    write_card(root)
    _print(json.dumps(result))


@app.command("export")
def export_cmd(
    out: Path = typer.Argument(..., help="A finished output folder (or a sharded job's root)."),
    to: str = typer.Option(..., "--to", help="Comma-separated formats: hf, nemo, lhotse."),
    copy: bool = typer.Option(False, "--copy", help="NeMo and Lhotse: copy the audio out as loose WAV files "
                              "(exports/wavs) instead of pointing into the tar shards."),
) -> None:
    """Write the dataset in other formats under OUT/exports/, and its card OUT/README.md."""
    from .store.card import write_card
    from .store.exports import export

    try:
        written = {fmt: str(export(out, fmt.strip(), copy=copy)) for fmt in to.split(",") if fmt.strip()}
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    write_card(out)
    _print(json.dumps(written))


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
    for suffix in (".gz", ".jsonl", ".ndjson", ".parquet", ".pq", ".csv", ".tsv", ".tab", ".txt"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name or "corpus"


def _setup_logging() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s cosybatch %(levelname)s %(message)s")


def _print(text: str) -> None:
    """print() for a report read through a pipe (`cosybatch verify OUT | head`): when the reader
    has gone, the rest of the report has nowhere to go, but the exit code must still say what the
    command found, so stdout is pointed at /dev/null (as the Python docs advise for SIGPIPE) instead
    of click turning the BrokenPipeError into exit 1."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _report(message: str, code: int) -> None:
    """The error on stderr and, as the last stdout line, the JSON summary Airflow's XCom reads."""
    print(f"cosybatch: error: {message}", file=sys.stderr)
    print(json.dumps({"status": "error", "exit_code": code, "error": message}))


def _fail(message: str, code: int) -> None:
    _report(message, code)
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
    _report(message, code)
    raise SystemExit(code)
