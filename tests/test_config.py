"""The run configuration: every numeric setting bounded (NaN and infinities refused, naming the
option), the library routes from flat options and job specs, and the CLI building the same config."""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import typing

import pytest
from helpers import write_jsonl
from typer.testing import CliRunner

from cosybatch.config import LIMIT_BOUNDS, SECTIONS, EngineConfig, RunConfig
from cosybatch.errors import UsageError
from cosybatch.jobspec import config_from_spec
from cosybatch.qc.gate import Limits


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "One."}, {"id": "b", "text": "Two."}])


def cli_check(*args: str):
    from cosybatch.cli import app

    result = CliRunner().invoke(app, ["run", *map(str, args), "--engine", "tone", "--check"],
                                env={"COLUMNS": "200", "NO_COLOR": "1"})
    return result.exit_code, result.output


@pytest.mark.parametrize(("flag", "value", "allowed"), [
    ("--qc-max-wer", "nan", "[0, 10]"),
    ("--qc-max-cer", "inf", "[0, 10]"),
    ("--qc-retries", "1000000", "[0, 10]"),
    ("--qc-sample", "nan", "(0, 1]"),
    ("--memory-fraction", "1.5", "(0, 1]"),
    ("--batch-size", "0", "[1, 4096]"),
    ("--threads", "100000", "[1, 1024]"),
    ("--seed", "-1", "[0, 4_294_967_295]"),
    ("--sentence-silence", "-5", "[0, 60]"),
    ("--log-every", "nan", "(0, 86400]"),
    ("--max-runtime", "nan", "(0, 31_622_400]"),
    ("--max-chars", "0", "[1, 1_000_000]"),
    ("--shard-max-mb", "nan", "1048576"),
])
def test_a_flag_out_of_bounds_is_refused_naming_it(corpus, tmp_path, flag, value, allowed):
    code, output = cli_check(corpus, "--out", tmp_path / "o", flag, value)
    assert code == 2, output
    assert flag in output and allowed in output, output


@pytest.mark.parametrize(("spec", "named", "allowed"), [
    ("[qc]\nmax_z = nan\n", "[qc] max_z", "(0, 100]"),
    ("[qc]\nmin_speech_share = -5\n", "[qc] min_speech_share", "[0, 1]"),
    ("[qc]\nmax_token_run = 2.5\n", "[qc] max_token_run", "whole number"),
    ("[qc]\nretries = 11\n", "--qc-retries", "[0, 10]"),
    ("qc_max_wer = nan\n", "--qc-max-wer", "[0, 10]"),
    ("batch_size = -3\n", "--batch-size", "[1, 4096]"),
])
def test_a_spec_value_out_of_bounds_is_refused_naming_it(corpus, tmp_path, spec, named, allowed):
    job = tmp_path / "job.toml"
    job.write_text(f'corpus = "{corpus}"\nout = "{tmp_path / "o"}"\n{spec}')
    code, output = cli_check("--job", job)
    assert code == 2, output
    assert named in output and allowed in output, output
    with pytest.raises(UsageError, match=named.replace("[", r"\[")):
        config_from_spec(job, engine="tone")


def test_every_numeric_field_has_documented_bounds():
    for section in SECTIONS.values():
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
            if not kinds & {int, float} or f.name == "shard_index":  # the index is checked against the count
                continue
            bounds = f.metadata.get("bounds")
            assert bounds is not None, f"{section.__name__}.{f.name} has no bounds"
            if f.default is not dataclasses.MISSING and f.default is not None:
                bounds.check(f.name, f.default)  # the default lies inside
    # Every threshold of the quality gate has a range, and its default lies in it.
    assert set(LIMIT_BOUNDS) == set(Limits.names())
    for name in Limits.names():
        default = getattr(Limits(), name)
        if default is not None:
            LIMIT_BOUNDS[name].check(name, default)


def test_from_options_round_trips_and_with_options_checks_again(corpus, tmp_path):
    cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "o", engine="tone", batch_size=8, qc="gate",
                                 qc_limits={"max_gap_s": 2.5}, export="hf,nemo", max_runtime="2h", shard="1/4")
    assert (cfg.batching.batch_size, cfg.quality.mode, cfg.output.exports, cfg.ops.max_runtime_s) == (
        8, "gate", ("hf", "nemo"), 7200.0)
    assert (cfg.output.shard_index, cfg.output.shard_count, cfg.engine.name) == (1, 4, "tone")
    assert RunConfig.from_options(**cfg.options()) == cfg
    assert cfg.option("qc_limits") == {"max_gap_s": 2.5}
    assert cfg.with_options(seed=5).engine.seed == 5
    with pytest.raises(UsageError, match=r"--qc-retries must be a whole number in \[0, 10\]"):
        cfg.with_options(qc_retries=11)
    with pytest.raises(UsageError, match="unknown option 'batch_sise'; did you mean 'batch_size'"):
        RunConfig.from_options(corpus=corpus, batch_sise=4)
    with pytest.raises(AttributeError, match=r"cfg\.batching\.batch_size"):
        operator.attrgetter("batch_size")(cfg)  # code from before the sections
    # The default output folder comes from the corpus name, as on the command line.
    assert RunConfig.from_options(corpus=corpus, engine="tone").output.folder.as_posix() == "out/c"
    assert EngineConfig().name  # every section but input and output has a default


def test_config_from_spec_is_what_the_cli_builds(corpus, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"corpus: {corpus}\nout: {tmp_path / 'o'}\nengine: tone\nbatch-size: 4\nseed: 7\n"
                   "export: [hf]\nqc:\n  mode: gate\n  max_cer: 0.3\n  max_gap_s: 2.0\n"
                   "engine_options:\n  base_hz: 300\n")
    code, output = cli_check("--job", job, "--seed", "9", "--qc-max-cer", "0.1", "--engine-opt", "base_hz=200")
    assert code == 0, output
    from_cli = json.loads(output.strip().splitlines()[-1])["config"]
    cfg = config_from_spec(job, seed=9, qc_max_cer=0.1, engine_opt=["base_hz=200"])
    assert from_cli == json.loads(json.dumps(cfg.to_dict(), default=str))
    assert (cfg.engine.seed, cfg.batching.batch_size, cfg.quality.max_cer, cfg.quality.limits) == (
        9, 4, 0.1, {"max_gap_s": 2.0})
    assert cfg.engine.options == {"base_hz": "200"} and cfg.output.exports == ("hf",)
    # Without overrides the spec's own values stand.
    spec_only = config_from_spec(job)
    assert (spec_only.engine.seed, spec_only.quality.max_cer) == (7, 0.3)
    assert math.isclose(spec_only.quality.settings().limits.max_gap_s, 2.0)
