"""Hostile or broken files, text and environments: each must end in a short, named error (a usage
error is exit 2; a corpus error exit 3) or a recorded row failure, never a hang, a runaway message or
a traceback."""

from __future__ import annotations

import functools
import gzip
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, read_output, write_jsonl, write_parquet
from helpers import cli as run_cli

from cosybatch.config import RunConfig
from cosybatch.errors import CorpusError, CosybatchError, UsageError
from cosybatch.jobspec import load_job_spec
from cosybatch.run.local import run
from cosybatch.store.distributed import parse_shard

# Without the fixes these inputs hang or blow up memory; a fixed build answers in about a second.
CLI_TIMEOUT = 60


cli = functools.partial(run_cli, timeout=CLI_TIMEOUT)


def assert_clean_usage_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr) < 2000, proc.stderr[:3000]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_parquet(tmp_path / "c.parquet", [{"id": "a", "text": "Hello there."}])


# -- 1. job specs ------------------------------------------------------------------------------
def alias_bomb(levels: int) -> str:
    """'Billion laughs' inside a valid key: 9 ** levels strings from a file of a few hundred bytes."""
    lines = ["voice:", "  - &a0 [" + ", ".join(["lol"] * 9) + "]"]
    for level in range(1, levels):
        lines.append(f"  - &a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_job_spec_alias_bomb_is_refused_fast(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(alias_bomb(9))
    start = time.monotonic()
    with pytest.raises(UsageError) as err:
        load_job_spec(spec)
    assert time.monotonic() - start < 2
    message = str(err.value)
    assert str(spec) in message and "aliases" in message and len(message) < 500


def test_job_spec_single_alias_is_refused(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("voice: &v en_US-lessac-medium\nspeaker: *v\n")
    with pytest.raises(UsageError, match=r"aliases \(\*name\) are not allowed"):
        load_job_spec(spec)
    spec.write_text("voice: en_US-lessac-medium\nbatch-size: 4\n")  # plain specs still load
    assert load_job_spec(spec) == {"voice": "en_US-lessac-medium", "batch_size": 4}


@pytest.mark.slow
def test_job_spec_alias_bomb_via_cli(tmp_path, corpus):
    spec = tmp_path / "spec.yaml"
    spec.write_text(alias_bomb(9))
    proc = cli("run", "--check", "--job", str(spec), str(corpus))
    assert_clean_usage_error(proc, "aliases", str(spec))


def test_job_spec_errors_quote_values_briefly(tmp_path):
    from cosybatch.jobspec import quote

    assert quote("x" * 10_000).endswith("…") and len(quote("x" * 10_000)) <= 200
    assert quote("en_US-lessac-medium") == repr("en_US-lessac-medium")
    assert quote([1, [2, 3]]) == "[1, [2, 3]]"
    # Keys that are no option name are refused here, quoted briefly, before anything quotes them whole.
    toml = tmp_path / "spec.toml"
    toml.write_text(f'"{"k" * 100_000}" = 1\n')
    yml = tmp_path / "spec.yaml"
    yml.write_text("1: x\n")
    for spec in (toml, yml):
        with pytest.raises(UsageError) as err:
            load_job_spec(spec)
        assert "not an option name" in str(err.value) and len(str(err.value)) < 500


# -- 2. arithmetic in a CosyVoice model's yaml --------------------------------------------------
@pytest.fixture
def model_copy(cosyvoice_dir, tmp_path) -> Path:
    """A private copy of the tiny model folder, free to break."""
    return Path(shutil.copytree(cosyvoice_dir, tmp_path / "CosyVoice2-copy"))


@pytest.mark.parametrize("expr, reason", [
    ("<token_mel_ratio> / 0", "division by zero"),
    ("1 // 0", "division by zero"),
    ("<chunk_size> % 0.0", "division by zero"),
    ("1" + "0" * 320 + " / 1", "too large"),
    ("-" * 2000 + "1", "nested too deeply"),
])
def test_model_yaml_arithmetic_errors_are_usage_errors(model_copy, expr, reason):
    from cosybatch.engines.cosyvoice import check_setup

    config = model_copy / "cosyvoice2.yaml"
    config.write_text(config.read_text() + f"\nbroken: !ref {expr}\n")
    with pytest.raises(UsageError) as err:
        check_setup(model_copy, None, None, None)
    message = str(err.value)
    assert str(config) in message and expr[:400] in message and reason in message and len(message) < 1000


@pytest.mark.slow
def test_model_yaml_division_by_zero_via_cli(model_copy, corpus):
    config = model_copy / "cosyvoice2.yaml"
    config.write_text(config.read_text() + "\nbroken: !ref 1 / 0\n")
    proc = cli("run", "--check", "--engine", "cosyvoice", "--model", str(model_copy), str(corpus))
    assert_clean_usage_error(proc, str(config), "1 / 0", "division by zero")


# -- 3. spk2info.pt that is not a weights-only checkpoint ---------------------------------------
class Harmless:
    """Stands in for a malicious pickle: unpickling it would call a global (print)."""

    def __reduce__(self):
        return (print, ("unpickled: this must never run",))


class Custom:
    """An object of a class of our own, which only a full unpickler could rebuild."""

    def __init__(self):
        self.embedding = torch.zeros(192)


def write_reduce(path: Path) -> None:
    torch.save({"alice": Harmless()}, path)


def write_custom(path: Path) -> None:
    torch.save({"alice": Custom()}, path)


def write_garbage(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(4096))


def write_empty(path: Path) -> None:
    path.write_bytes(b"")


def write_not_a_dict(path: Path) -> None:
    torch.save(torch.zeros(3, 192), path)


BAD_SPK2INFO = [write_reduce, write_custom, write_garbage, write_empty, write_not_a_dict]


@pytest.mark.parametrize("write", BAD_SPK2INFO, ids=lambda f: f.__name__)
def test_bad_spk2info_is_a_usage_error(model_copy, write, capsys):
    from cosybatch.cosyvoice.frontend.features import VoiceBank
    from cosybatch.engines.cosyvoice import check_setup

    path = model_copy / "spk2info.pt"
    write(path)
    with pytest.raises(UsageError) as err:
        VoiceBank(model_copy)
    assert str(path) in str(err.value) and len(str(err.value)) < 600
    with pytest.raises(UsageError, match=r"spk2info\.pt"):
        check_setup(model_copy, "alice", None, None)
    assert "must never run" not in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("write", [write_reduce, write_garbage], ids=lambda f: f.__name__)
def test_bad_spk2info_via_cli(model_copy, corpus, write):
    path = model_copy / "spk2info.pt"
    write(path)
    proc = cli("run", "--check", "--engine", "cosyvoice", "--model", str(model_copy), str(corpus))
    assert_clean_usage_error(proc, str(path), "weights-only")
    assert "must never run" not in proc.stdout


@pytest.mark.parametrize("name", ["flow.pt", "hift.pt", "llm.pt"])
def test_non_weights_only_model_checkpoints_are_model_dir_errors(model_copy, name):
    """Already clean before the spk2info fix: pinned so it stays that way."""
    from cosybatch.cosyvoice.model import ModelDirError, load_state

    path = model_copy / name
    write_reduce(path)
    with pytest.raises(ModelDirError, match="cannot be loaded as weights"):
        load_state(path)


def test_non_weights_only_flow_pt_when_opening_the_engine(model_copy):
    from cosybatch.engines import EngineOptions, open_engine
    from cosybatch.engines.cosyvoice import CosyVoiceOptions

    write_reduce(model_copy / "flow.pt")
    with pytest.raises(CosybatchError) as err:
        open_engine("cosyvoice", None, EngineOptions(device="cpu", engine=CosyVoiceOptions(model=model_copy)))
    assert err.value.exit_code == 2 and "flow.pt" in str(err.value)


# -- 4. the scheduler's worker index ------------------------------------------------------------
@pytest.mark.parametrize("env, name", [
    ({"JOB_COMPLETION_INDEX": "abc"}, "JOB_COMPLETION_INDEX"),
    ({"SLURM_ARRAY_TASK_ID": "3.5"}, "SLURM_ARRAY_TASK_ID"),
    ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "one"}, "SLURM_ARRAY_TASK_MIN"),
    ({"COSYBATCH_SHARD_INDEX": "0x1"}, "COSYBATCH_SHARD_INDEX"),
])
def test_non_numeric_worker_index_is_a_usage_error(env, name):
    with pytest.raises(UsageError) as err:
        parse_shard("4", env=env)
    assert f"{name}={env[name]!r} is not a worker index" in str(err.value)


def test_worker_index_from_the_environment():
    assert parse_shard("4", env={"JOB_COMPLETION_INDEX": " 2 "}) == (2, 4)
    assert parse_shard("4", env={"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "3"}) == (2, 4)
    assert parse_shard("8", env={"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": ""}) == (5, 8)


@pytest.mark.parametrize("env, source", [
    ({"JOB_COMPLETION_INDEX": "4"}, "JOB_COMPLETION_INDEX=4"),
    ({"COSYBATCH_SHARD_INDEX": "-1"}, "COSYBATCH_SHARD_INDEX=-1"),
    ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MIN": "2"}, "SLURM_ARRAY_TASK_ID=1 minus SLURM_ARRAY_TASK_MIN=2"),
])
def test_worker_index_out_of_range_names_its_variable(env, source):
    with pytest.raises(UsageError, match=r"0\.\.3") as err:
        parse_shard("4", env=env)
    assert source in str(err.value)


@pytest.mark.parametrize("spec", ["4/4", "-1/4", "0/0", "0"])
def test_shard_out_of_range_is_reported(spec, tmp_path):
    with pytest.raises(UsageError, match=r"--shard"):
        index, count = parse_shard(spec, env={"JOB_COMPLETION_INDEX": "0"})
        RunConfig.from_options(corpus=tmp_path / "c.parquet", out=tmp_path / "out", shard_index=index,
                               shard_count=count)


@pytest.mark.slow
def test_non_numeric_worker_index_via_cli(corpus, tmp_path):
    proc = cli("run", "--check", "--shard", "4", str(corpus), "--out", str(tmp_path / "out"),
               env={"JOB_COMPLETION_INDEX": "abc"})
    assert_clean_usage_error(proc, "JOB_COMPLETION_INDEX='abc'")


def test_a_byte_order_mark_before_the_first_jsonl_line_is_accepted(tmp_path):
    from cosybatch.run.local import run

    path = tmp_path / "c.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "first", "text": "Hello."}\n{"id": "second", "text": "Bye."}\n')
    result = run(RunConfig.from_options(corpus=path, out=tmp_path / "out", progress="none"))
    assert result.stats["items_failed"] == 0
    assert sorted(read_output(tmp_path / "out")) == ["first", "second"]


def test_a_bad_pushgateway_only_warns(corpus, tmp_path, caplog):
    from cosybatch.run.local import run

    result = run(RunConfig.from_options(corpus=corpus, out=tmp_path / "out", pushgateway="not a url", progress="none"))
    assert result.status == "complete" and result.exit_code == 0
    assert "could not push metrics to not a url" in caplog.text
    again = run(RunConfig.from_options(corpus=corpus, out=tmp_path / "out", pushgateway="not a url", progress="none"))
    assert again.exit_code == 0  # a rerun (an Airflow retry) does not fail either


def test_an_internal_error_still_ends_with_a_json_line(corpus, tmp_path, monkeypatch, capsys):
    import json

    from cosybatch import cli as cli_module
    from cosybatch.run import local

    def broken(cfg):
        raise RuntimeError("a bug")

    monkeypatch.setattr(local, "run", broken)
    monkeypatch.setattr(sys, "argv", ["cosybatch", "run", str(corpus), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main()
    assert exit_info.value.code == 1
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert last == {"status": "error", "exit_code": 1, "error": "internal error: RuntimeError('a bug'); "
                                                                "please report it with the log above"}


# -- hostile text, broken and truncated corpora --------------------------------------------------
def test_hostile_text(tmp_path):
    rows = [
        {"id": "emoji", "text": "Good news \U0001F389\U0001F44D\U0001F3FD everyone!"},
        {"id": "chinese", "text": "This has 中文 in it."},
        {"id": "only-emoji", "text": "\U0001F600\U0001F600"},
        {"id": "huge", "text": "word " * 5000},
        {"id": "ctrl", "text": "Bell\x07 and\x1b[0m escape."},
        {"id": "../../etc/passwd", "text": "Path-like id."},
        {"id": "fine", "text": "Nothing odd here."},
    ]
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "out"
    result = run(RunConfig.from_options(corpus=corpus, out=out, max_chars=10000, progress="none"))
    items = read_output(out)
    assert set(items) == {"emoji", "ctrl", "../../etc/passwd", "fine"}
    assert items["emoji"]["meta"]["text"] == "Good news everyone!"
    assert items["emoji"]["meta"]["source_text"] == rows[0]["text"]
    assert items["ctrl"]["meta"]["text"] == "Bell and [0m escape."
    assert "/" not in items["../../etc/passwd"]["key"] and not list(tmp_path.rglob("passwd*"))
    reasons = {json.loads(x)["id"]: json.loads(x)["reason"] for x in (out / "failures.jsonl").read_text().splitlines()}
    assert "cannot speak: '中文'" in reasons["chinese"]
    assert "nothing pronounceable" in reasons["only-emoji"]
    assert "over --max-chars 10000" in reasons["huge"]
    assert result.stats["items_failed"] == 3


@pytest.mark.slow
def test_truncated_corpus_is_a_bad_input_error(tmp_path):
    from cosybatch.corpus import Corpus

    data = gzip.compress("".join(json.dumps({"id": i, "text": f"row {i}"}) + "\n" for i in range(3000)).encode())
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(data[: len(data) * 2 // 3])
    corpus = Corpus(path)  # the first rows read fine
    with pytest.raises(CorpusError, match=r"c.jsonl.gz: reading failed after line \d+ .*truncated or corrupt"):
        list(corpus)
    tiny = tmp_path / "tiny.jsonl.gz"
    tiny.write_bytes(data[:200])  # 19 whole lines, then the cut
    proc = cli("run", tiny, "--out", tmp_path / "out", "--engine", "tone")
    assert proc.returncode == 3, proc.stderr
    assert "tiny.jsonl.gz: reading failed after line 19" in proc.stderr
    assert len(read_output(tmp_path / "out")) == 19  # the readable rows were synthesised
    garbage = tmp_path / "garbage.jsonl.gz"
    garbage.write_bytes(data[:20])  # not even one line
    proc = cli("run", garbage, "--out", tmp_path / "g", "--engine", "tone")
    assert proc.returncode == 3 and "garbage.jsonl.gz: cannot read the file" in proc.stderr


def test_ids_that_are_not_unicode_fail_alone(tmp_path, tone):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "ok-1", "text": "Fine."}\n{"id": "bad\\ud800", "text": "Surrogate id."}\n'
                      '{"id": "ok-2", "text": "Also fine.", "voice": "v\\udfff"}\n{"id": "ok-3", "text": "Last."}\n')
    out = tmp_path / "out"
    result = run(tone(corpus, out))
    assert set(read_output(out)) == {"ok-1", "ok-3"}
    reasons = [json.loads(line)["reason"] for line in (out / "failures.jsonl").read_text().splitlines()]
    assert "not valid Unicode" in reasons[0] and "voice is not valid Unicode" in reasons[1]
    assert result.stats["items_failed"] == 2


@pytest.mark.slow
def test_usage_errors_exit_2():
    cases = [["run", "nope.parquet", "--batch-size", "0"], ["run", "x.parquet", "--max-runtime", "soon"],
             ["run", "--no-such-option"], ["run", "x.parquet", "--max-runtime", "nan"],
             ["run", "x.parquet", "--shard-max-mb", "nan"]]
    for args in cases:
        proc = cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
    missing = cli("run", ROOT / "nope.parquet")
    assert missing.returncode == 3 and "no such corpus file" in missing.stderr
