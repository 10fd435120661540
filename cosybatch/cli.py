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

from .config import SECTION_TITLES, run_options
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
from .jobspec import config_from_spec

EXIT_CODES_HELP = (
    f"Exit codes: {EXIT_OK} complete; {EXIT_USAGE} usage error; {EXIT_BAD_INPUT} bad input data; "
    f"{EXIT_INTERRUPTED} interrupted, resumable (rerun the same command); "
    f"{EXIT_TOO_MANY_FAILURES} failure threshold exceeded; {EXIT_INTERNAL} internal error."
)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Turn text corpora into speech datasets: batched, resumable, sharded TTS.")


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


NOT_IN_SPECS = ("ctx", "job", "check", "plan_only", "rate")  # flags of the command, not of the job

# The job's options (cosybatch.config.run_options): each field of RunConfig's sections, the
# spellings that build the rest, and the installed engines' aliases; their types, defaults, help
# and panels come from the library, the flag names and metavars from here.
RUN_OPTIONS = run_options()
D = {name: option.help for name, option in RUN_OPTIONS.items()}
FLAG_DECLS = {"out": ("--out", "-o"), "restart": ("--restart",), "export_copy": ("--export-copy",),
              "allow_corpus_change": ("--allow-corpus-change",), "engine_opt": ("--engine-opt",)}
METAVARS = {"engine_opt": "KEY=VALUE", "voice_pool": "SPEC", "voice_map": "LANG=VOICE,..."}
HELP_SUFFIX = {"out": " [default: out/CORPUS-STEM]"}
OPERATIONS = SECTION_TITLES["ops"]
RAY = "Ray"  # ray-run's own flags


def _option(name: str, annotation, default, help: str, decls=(), metavar=None, panel=OPERATIONS) -> inspect.Parameter:
    from rich.markup import escape

    # Help is plain text: escaped, so `[engine_options]` or `[default: ...]` is shown, not read as markup.
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *decls, help=escape(help), metavar=metavar,
                                                  rich_help_panel=panel))


def _run_parameters() -> list[inspect.Parameter]:
    """The `run` command's parameters: the job's options, then the command's own flags."""
    params = [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        # A string, not a Path: a Path would fold a URI's "//" into one slash.
        inspect.Parameter("corpus", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[str],
                          default=typer.Argument(None, help=D["corpus"] + " (or `corpus` in --job)",
                                                 show_default=False)),
        _option("job", Optional[Path], None, "TOML or YAML file holding any of these options; flags given here "
                "override it.", ("--job",), panel=SECTION_TITLES["input"]),
    ]
    for name, option in RUN_OPTIONS.items():
        if name != "corpus":
            params.append(_option(name, option.hint, option.default, option.help + HELP_SUFFIX.get(name, ""),
                                  FLAG_DECLS.get(name, ()), METAVARS.get(name), SECTION_TITLES[option.section]))
    params += [
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
    order = [*SECTION_TITLES.values(), RAY]
    return sorted(options, key=lambda p: order.index(p.default.rich_help_panel))


def _given(ctx: typer.Context, values: dict) -> dict:
    """The options given on the command line (the rest come from the job spec or the defaults)."""
    given = {}
    for name, value in values.items():
        source = ctx.get_parameter_source(name)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            given[name] = value
    return given


def run(ctx: typer.Context, **values) -> None:
    """Synthesise every row of CORPUS into WebDataset shards of audio under --out; rerun to resume.

    The last line on stdout is a one-line JSON summary.
    """
    _setup_logging()
    job, check = values.pop("job"), values.pop("check")
    plan_only, rate = values.pop("plan_only"), values.pop("rate")
    try:
        cfg = config_from_spec(job, **_given(ctx, values))
        if rate is not None and (not plan_only or not 0 < rate < float("inf")):
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


# The `run` options ray-run takes on its command line (a job spec may hold any; ray-run refuses
# those it cannot honour), declared once: in cosybatch.config.
RAY_RUN_SHARED = ("corpus", "out", "voice", "voice_pool", "voice_map", "engine", "engine_opt", "batch_size", "seed",
                  "restart", "progress", "qc",
                  "qc_asr_rows", "qc_max_cer", "qc_retries", "qc_on_fail")
RAY_FLAGS = ("address", "actors", "num_gpus", "num_cpus", "rows_per_task")


def _ray_run_parameters() -> list[inspect.Parameter]:
    shared = {p.name: p for p in _run_parameters()}
    job = _option("job", Optional[Path], None, "A `cosybatch run` job spec; flags here override it.", ("--job",),
                  panel=SECTION_TITLES["input"])
    return [shared["ctx"], shared["corpus"], *_by_panel([job, *(shared[name] for name in RAY_RUN_SHARED[1:])]),
            _option("address", Optional[str], None, "Ray cluster: unset starts a local one of its own (even "
                    "where another runs here); 'auto' joins the running one; or ray://HOST:10001.", panel=RAY),
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

        result = run_on_ray(config_from_spec(job, **_given(ctx, given)), RayOptions(**ray_flags))
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


@app.command()
def status(
    out: str = typer.Argument(..., help="A job's output folder (or a sharded job's root), or its store URI."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a line of text."),
) -> None:
    """Show done/failed/total, rate and ETA of a running or finished job without disturbing it."""
    from .store.objects import job_view
    from .store.status import describe, job_status

    try:
        with job_view(out) as folder:
            result = job_status(folder)
            if folder != Path(out):  # a store's job, read in a local view
                result["root"] = out
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    _print(json.dumps(result) if as_json else describe(result))


@app.command("verify")
def verify_cmd(
    out: str = typer.Argument(..., help="A job's output folder (or a sharded job's root), or its store URI."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """Read every shard whole and check it against the manifest: each id in exactly one readable
    pair of audio member (KEY.wav, KEY.flac, ...) and KEY.json with the manifest's length. Exit 0
    when all is well, 3 listing each problem otherwise."""
    from .store.objects import job_view
    from .store.verify import describe, verify

    try:
        with job_view(out, shards=True) as folder:  # a store's shards are read in a local copy
            result = verify(folder)
            if folder != Path(out):
                result["root"] = out
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    _print(json.dumps(result) if as_json else describe(result))
    raise typer.Exit(EXIT_OK if result["ok"] else EXIT_BAD_INPUT)


@app.command("qc")
def qc_cmd(
    out: str = typer.Argument(..., help="A finished job's output folder, one part of a sharded job, or its root; "
                              "or its store URI."),
    asr: bool = typer.Option(False, "--asr", help="Also transcribe with Whisper and score CER/WER (the "
                             "cosybatch[qc] extra)."),
    asr_rows: str = typer.Option("all", "--asr-rows", help="With --asr: all, flagged or sample."),
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
    from .store.objects import job_view

    try:
        settings = QCSettings("asr" if asr else "gate", asr_rows, sample, 0, "drop", Limits(max_cer=max_cer))
        transcriber = None
        if asr:
            from .qc.asr import Transcriber, ready_model

            transcriber = Transcriber(ready_model(asr_model), device)
        with job_view(out, shards=True, upload=("qc.parquet", "report.html", "part-*/qc.parquet",
                                                "part-*/report.html")) as folder:
            summary = audit(folder, settings, transcriber, seed=seed, report=report)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    if as_json:
        _print(json.dumps(summary))
    else:
        _print(f"{summary['clips']} clips scored: {summary['flagged']} flagged, {summary['failed']} fail the gate"
               + (f", {summary['transcribed']} transcribed (mean CER {summary['cer_mean']})" if asr else "")
               + f"; wrote {out.rstrip('/')}/qc.parquet" + (f" and {out.rstrip('/')}/report.html" if report else ""))


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
    root: str = typer.Argument(..., help="The --out folder (or store URI) of a job run with --shard."),
    partial: bool = typer.Option(False, "--partial", help="Merge the finished parts even if some are not."),
) -> None:
    """Present the workers' outputs of a sharded job as one dataset: ROOT/manifest.parquet, and its
    card ROOT/README.md."""
    from .store.card import write_card
    from .store.distributed import merge as merge_parts
    from .store.objects import job_view

    try:  # a store's parts are merged from their records: no shard is downloaded
        with job_view(root, upload=("manifest.parquet", "failures.jsonl", "stats.json", "README.md")) as folder:
            result = merge_parts(folder, allow_partial=partial)
            write_card(folder)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    _print(json.dumps(result))


@app.command("export")
def export_cmd(
    out: str = typer.Argument(..., help="A finished output folder (or a sharded job's root), or its store URI."),
    to: str = typer.Option(..., "--to", help="Comma-separated formats: hf, nemo, lhotse, shar (Lhotse Shar)."),
    copy: bool = typer.Option(False, "--copy", help="NeMo and Lhotse: copy the audio out as loose files "
                              "(exports/wavs/KEY.wav, KEY.flac, ...: the shards' format) instead of pointing "
                              "into the tar shards."),
) -> None:
    """Write the dataset in other formats under OUT/exports/, and its card OUT/README.md."""
    from .store.card import write_card
    from .store.exports import export
    from .store.objects import job_view

    try:
        with job_view(out, shards=True, upload=("exports", "README.md")) as folder:
            written = {fmt: str(export(folder, fmt.strip(), copy=copy)).replace(str(folder), out.rstrip("/"), 1)
                       for fmt in to.split(",") if fmt.strip()}
            write_card(folder)
    except CosybatchError as exc:
        _fail(str(exc), exc.exit_code)
    _print(json.dumps(written))


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
