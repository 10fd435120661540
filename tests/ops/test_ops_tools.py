"""What a data engineer meets first: --version, Pushgateway grouping, the cron script under dash,
the Airflow DAG, the Kubernetes manifest, the HF export's documented snippet, status of a sharded
job, and ray-run stopped after its last chunk (issue 14)."""

from __future__ import annotations

import base64
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import ROOT, cli, corpus_rows, write_parquet

from cosybatch.config import RunConfig
from cosybatch.job import run


# -- 1. --version ------------------------------------------------------------------------------
def test_version_needs_no_command():
    from cosybatch import __version__

    proc = cli("--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, __version__), proc.stderr


# -- 2. Prometheus: Pushgateway grouping, last success, textfile labels ------------------------
class Pushgateway:
    """A recording stand-in for a Pushgateway: every request's method, path and body."""

    def __init__(self):
        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.command, self.path, body.decode()))
                self.send_response(200)
                self.end_headers()

            do_PUT = do_POST = _record

            def log_message(self, *args):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gateway():
    gw = Pushgateway()
    yield gw
    gw.close()


def samples(text: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(text: str, name: str, **labels) -> float | None:
    found = [s.value for s in samples(text) if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) <= 1, (name, found)
    return found[0] if found else None


def test_two_sharded_jobs_with_the_same_folder_name_push_to_their_own_groups(tmp_path, gateway):
    from cosybatch.metrics import default_job_name

    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(2))
    for team in ("a", "b"):  # two jobs, both .../english/part-00000-of-00002
        result = run(RunConfig(corpus=corpus, out=tmp_path / team / "english", shard_index=0, shard_count=2,
                               pushgateway=gateway.url, progress="none"))
        assert result.status == "complete"
    names = [default_job_name(tmp_path / team / "english") for team in ("a", "b")]
    assert names[0] != names[1] and all(n.startswith("english-") for n in names)
    shard = "shard@base64/" + base64.urlsafe_b64encode(b"0/2").decode()  # prometheus_client's escaping of "/"
    assert [(m, p) for m, p, _ in gateway.received] == [("PUT", f"/metrics/job/{n}/{shard}") for n in names]
    for name, (_, _, body) in zip(names, gateway.received, strict=True):
        assert all("job" not in s.labels for s in samples(body))  # the URL's job is the only one
        assert value(body, "cosybatch_items_total", status="done", cosybatch_job=name, shard="0/2") is not None
        assert time.time() - 600 < value(body, "cosybatch_last_success_timestamp_seconds") <= time.time()


def test_metrics_job_names_the_group_and_last_success_outlives_a_failed_run(tmp_path, gateway):
    rows = [*corpus_rows(2), {"id": "empty", "text": ""}]  # one row that fails
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    prom = tmp_path / "english.prom"
    cfg = RunConfig(corpus=corpus, out=tmp_path / "out", metrics_file=prom, pushgateway=gateway.url,
                    metrics_job="english-nightly", progress="none")
    assert run(cfg).status == "complete"
    textfile = prom.read_text()
    assert all("job" not in s.labels for s in samples(textfile))
    first = value(textfile, "cosybatch_last_success_timestamp_seconds", cosybatch_job="english-nightly")
    assert first == json.loads((cfg.out / "stats.json").read_text())["last_success_timestamp_seconds"]

    # The next night fails its failure threshold: the job's last success is still the first run's.
    again = run(RunConfig(**{**cfg.__dict__, "max_failures": "0"}))
    assert again.status == "too_many_failures"
    textfile = prom.read_text()
    assert value(textfile, "cosybatch_run_complete") == 0
    assert value(textfile, "cosybatch_last_success_timestamp_seconds") == first
    assert [p for _, p, _ in gateway.received] == ["/metrics/job/english-nightly"] * 2
    assert value(gateway.received[1][2], "cosybatch_last_success_timestamp_seconds") == first


def test_metrics_job_is_a_run_flag_and_a_spec_key(tmp_path):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(1))
    spec = tmp_path / "job.toml"
    spec.write_text(f'corpus = "{corpus}"\nmetrics-job = "from-spec"\n')
    proc = cli("run", "--job", str(spec), "--check")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["config"]["metrics_job"] == "from-spec"
    proc = cli("run", "--job", str(spec), "--metrics-job", "from-flag", "--check")
    assert json.loads(proc.stdout.splitlines()[-1])["config"]["metrics_job"] == "from-flag"


# -- 9. status of a sharded job, --shard 0/0 ---------------------------------------------------
def test_a_finished_part_reports_its_real_total(tmp_path):
    from cosybatch.distributed import shard_of

    ids = [f"id-{i}" for i in range(40)]
    part0 = [i for i in ids if shard_of(i, 2) == 0][:3]
    part1 = [i for i in ids if shard_of(i, 2) == 1][:1]
    lines = (ROOT / "examples" / "sentences.txt").read_text().splitlines()
    corpus = write_parquet(tmp_path / "c.parquet", [{"id": i, "text": lines[n]} for n, i in enumerate(part0 + part1)])
    out = tmp_path / "out"
    for index in (0, 1):  # 4 rows over 2 workers: each was estimated at 2
        assert run(RunConfig(corpus=corpus, out=out, shard_index=index, shard_count=2, progress="none")).exit_code == 0
    status = json.loads(cli("status", str(out), "--json").stdout)
    assert [(p["done"], p["total"], p["total_is_estimate"]) for p in status["parts"]] == [(3, 3, False), (1, 1, False)]
    assert (status["status"], status["done"], status["total"], status["total_is_estimate"]) == ("complete", 4, 4, False)
    assert "complete, 4/4 done" in cli("status", str(out)).stdout


@pytest.mark.parametrize(("spec", "message"), [
    ("0/0", "the worker count N must be at least 1"),
    ("3/0", "the worker count N must be at least 1"),
    ("0", "the worker count N must be at least 1"),
    ("2/2", "the worker index I must be in 0..1"),
    ("-1/4", "the worker index I must be in 0..3"),
])
def test_a_shard_out_of_range_says_what_is_wrong(spec, message):
    from cosybatch.distributed import parse_shard
    from cosybatch.errors import UsageError

    with pytest.raises(UsageError, match=message):
        parse_shard(spec, env={})


def test_shard_zero_of_zero_on_the_command_line():
    proc = cli("run", "examples/corpus.parquet", "--shard", "0/0", "--check")
    assert proc.returncode == 2
    assert "the worker count N must be at least 1" in proc.stderr and "0..-1" not in proc.stderr


# -- 3. the cron script under a POSIX sh -------------------------------------------------------
def posix_sh() -> list[str] | None:
    """A POSIX shell that is not bash, as cron's /bin/sh is on Debian and Ubuntu (dash)."""
    for name in ("dash", "posh"):
        if shutil.which(name):
            return [shutil.which(name)]
    if shutil.which("busybox"):
        return [shutil.which("busybox"), "sh"]
    return None


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.fixture
def stub_cosybatch(tmp_path):
    """A `cosybatch` on PATH that records its arguments, says it started, and holds on until told
    to finish with the exit code in the release file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "cosybatch"
    stub.write_text('#!/bin/sh\necho "$*" >> "$STUB_DIR/calls"\n: > "$STUB_DIR/started"\n'
                    'while [ ! -e "$STUB_DIR/release" ]; do sleep 0.02; done\nexit "$(cat "$STUB_DIR/release")"\n')
    stub.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STUB_DIR": str(tmp_path),
            "COSYBATCH_CRON_LOCK": str(tmp_path / "cron.lock")}


def test_cron_script_runs_under_dash_and_an_overlapping_slot_exits_75(tmp_path, stub_cosybatch):
    sh = posix_sh()
    if sh is None:
        pytest.skip("no POSIX sh other than bash (dash, posh or busybox) is installed")

    def slot() -> subprocess.Popen:
        return subprocess.Popen([*sh, "jobs/cron-english.sh"], cwd=ROOT, env={**os.environ, **stub_cosybatch},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = slot()
    wait_for_file(tmp_path / "started", first)  # cosybatch runs, holding the lock
    second = slot()
    _, err = second.communicate(timeout=60)
    assert second.returncode == 75
    assert "cron-english: the previous slot still holds" in err and "skipped (exit 75)" in err
    (tmp_path / "release").write_text("4")  # the first slot's run ends interrupted (resumable)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 4, err  # cosybatch's own code comes through
    assert (tmp_path / "calls").read_text().splitlines() == ["run --job jobs/english-piper.toml --max-runtime 5h"]

    (tmp_path / "release").write_text("0")
    third = slot()  # the lock went with the run that held it
    _, err = third.communicate(timeout=60)
    assert third.returncode == 0, err


def test_every_job_script_runs_under_a_posix_sh(tmp_path, stub_cosybatch):
    sh = posix_sh()
    if sh is None:
        pytest.skip("no POSIX sh other than bash (dash, posh or busybox) is installed")
    (tmp_path / "release").write_text("0")
    scripts = sorted((ROOT / "jobs").glob("*.sh"))
    assert len(scripts) >= 3
    for script in scripts:
        assert script.read_text().startswith("#!/bin/sh\n"), script.name
        proc = subprocess.run([*sh, str(script.relative_to(ROOT))], cwd=ROOT, env={**os.environ, **stub_cosybatch},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, (script.name, proc.stderr)
    assert len((tmp_path / "calls").read_text().splitlines()) == len(scripts)


# -- 4. the Airflow DAG, without Airflow -------------------------------------------------------
# Parameters of Airflow's DAG and BashOperator that the stubs accept: a parameter Airflow 3
# removed (schedule_interval, ...) or misspelt fails the test as it would fail the DAG import.
DAG_PARAMS = {"dag_id", "description", "schedule", "start_date", "end_date", "catchup", "default_args", "tags",
              "max_active_runs", "max_active_tasks", "dagrun_timeout", "params", "doc_md"}
BASH_PARAMS = {"task_id", "bash_command", "env", "append_env", "cwd", "retries", "retry_delay",
               "execution_timeout", "skip_on_exit_code", "do_xcom_push", "output_encoding", "pool", "queue"}


def airflow_stubs(version: int) -> tuple[dict, dict]:
    """Stand-ins for the modules the DAG imports, laid out as Airflow `version` lays them out;
    they record the DAG's tasks and edges."""
    import types

    seen: dict = {"dags": [], "tasks": {}, "edges": []}

    def check(kind: str, allowed: set, kwargs: dict) -> None:
        unknown = set(kwargs) - allowed
        assert not unknown, f"{kind} has no parameter(s) {sorted(unknown)}"

    class DAG:
        def __init__(self, **kwargs):
            check("DAG", DAG_PARAMS, kwargs)
            self.kwargs = kwargs
            seen["dags"].append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Task:
        def __init__(self, task_id: str, commands: list[str], kwargs: dict):
            self.task_id = task_id
            seen["tasks"][task_id] = {"commands": commands, **kwargs}

        def __rshift__(self, other):
            seen["edges"].append((self.task_id, other.task_id))
            return other

    class BashOperator(Task):
        def __init__(self, **kwargs):
            check("BashOperator", BASH_PARAMS, kwargs)
            super().__init__(kwargs["task_id"], [kwargs.pop("bash_command")], kwargs)

        @staticmethod
        def partial(**kwargs):
            check("BashOperator.partial", BASH_PARAMS - {"bash_command"}, kwargs)
            return types.SimpleNamespace(
                expand=lambda bash_command: Task(kwargs["task_id"], list(bash_command), kwargs))

    def package(name: str, **attrs) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so a submodule that is not stubbed here is not found
        module.__dict__.update(attrs)
        return module

    if version == 3:
        modules = {"airflow": package("airflow"), "airflow.sdk": package("airflow.sdk", DAG=DAG),
                   "airflow.providers": package("airflow.providers"),
                   "airflow.providers.standard": package("airflow.providers.standard"),
                   "airflow.providers.standard.operators": package("airflow.providers.standard.operators"),
                   "airflow.providers.standard.operators.bash": package("airflow.providers.standard.operators.bash",
                                                                        BashOperator=BashOperator)}
    else:
        modules = {"airflow": package("airflow", DAG=DAG), "airflow.operators": package("airflow.operators"),
                   "airflow.operators.bash": package("airflow.operators.bash", BashOperator=BashOperator)}
    return modules, seen


def load_dag(monkeypatch, version: int) -> dict:
    import runpy

    modules, seen = airflow_stubs(version)
    for name in [m for m in sys.modules if m == "airflow" or m.startswith("airflow.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    runpy.run_path(str(ROOT / "jobs" / "airflow_dag.py"))
    return seen


def test_airflow_dag_imports_on_airflow_3_and_2(monkeypatch):
    for version in (3, 2):
        seen = load_dag(monkeypatch, version)
        (dag,) = seen["dags"]
        assert dag.kwargs["default_args"]["retries"] >= 1  # each retry resumes
        assert seen["edges"] == [("synthesise", "merge")]
        commands = seen["tasks"]["synthesise"]["commands"]
        assert [c.rsplit("--shard ", 1)[1] for c in commands] == ["0/4", "1/4", "2/4", "3/4"]


def test_airflow_dag_commands_run_a_tiny_corpus_through_to_the_merge(tmp_path, monkeypatch):
    """The DAG's own bash commands, run as BashOperator runs them, from a copy of /opt/cosybatch
    whose corpus is 8 rows: every worker's last stdout line (its XCom) says complete, and the
    merge sees every row."""
    seen = load_dag(monkeypatch, 3)
    home = tmp_path / "opt-cosybatch"
    (home / "jobs").mkdir(parents=True)
    (home / "examples").mkdir()
    shutil.copy(ROOT / "jobs" / "english-piper-sharded.yaml", home / "jobs")
    write_parquet(home / "examples" / "corpus.parquet", corpus_rows(8))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def command(text: str) -> list[str]:
        assert text.startswith("cd /opt/cosybatch && cosybatch ")
        return ["bash", "-c", text.replace("/opt/cosybatch", str(home), 1)]

    workers = [subprocess.Popen(command(c), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for c in seen["tasks"]["synthesise"]["commands"]]
    done = 0
    for proc in workers:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        xcom = json.loads(out.splitlines()[-1])
        assert xcom["status"] == "complete"
        done += xcom["items_done"]
    assert done == 8
    (merge_command,) = seen["tasks"]["merge"]["commands"]
    merged = subprocess.run(command(merge_command), env=env, capture_output=True, text=True, timeout=600)
    assert merged.returncode == 0, merged.stderr
    assert json.loads(merged.stdout.splitlines()[-1])["items"] == 8


# -- 5. the Kubernetes Indexed Job's failure policy --------------------------------------------
def test_k8s_job_ignores_resumable_exits_and_fails_the_index_on_fatal_ones():
    import yaml

    from cosybatch.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TOO_MANY_FAILURES

    docs = list(yaml.safe_load_all((ROOT / "jobs" / "k8s-indexed-job.yaml").read_text()))
    spec = next(d for d in docs if d["kind"] == "Job")["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    # What the API server requires of a podFailurePolicy with FailIndex.
    assert pod["restartPolicy"] == "Never" and spec["completionMode"] == "Indexed" and spec["backoffLimitPerIndex"] >= 1
    rules = spec["podFailurePolicy"]["rules"]
    by_code = {}
    for rule in rules:
        assert rule["action"] in ("Ignore", "FailIndex", "FailJob", "Count")
        assert ("onExitCodes" in rule) != ("onPodConditions" in rule)  # exactly one requirement
        codes = rule.get("onExitCodes")
        if codes is not None:
            assert codes["containerName"] == container["name"] and codes["operator"] == "In"
            assert codes["values"] == sorted(set(codes["values"])) and 0 not in codes["values"]  # ordered, unique
            for code in codes["values"]:
                by_code.setdefault(code, rule["action"])  # the first matching rule wins
    assert by_code[EXIT_INTERRUPTED] == "Ignore"
    assert by_code[EXIT_BAD_INPUT] in ("FailIndex", "FailJob")
    assert by_code[EXIT_TOO_MANY_FAILURES] in ("FailIndex", "FailJob")
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert spec["activeDeadlineSeconds"] > 0  # ignored exits alone would retry without end
    assert spec["podReplacementPolicy"] == "Failed"  # one pod per index at a time
    # Time for the SIGTERM path (finish the batches in flight, commit, write stats), without a
    # preStop hook that would spend that time before the signal is even sent.
    assert pod["terminationGracePeriodSeconds"] >= 120
    assert "lifecycle" not in container


# -- 10. ray-run stopped by SIGTERM ------------------------------------------------------------
def test_ray_run_sigterm_mid_way_is_interrupted_and_after_the_last_chunk_is_complete(tmp_path, monkeypatch):
    """SIGTERM is sent from inside the driver at a known point: once when the first chunk comes
    back (rows are still unread: interrupted, exit 4), then, on the rerun, once every chunk has
    been dispatched and has finished (nothing was cut short: complete, exit 0)."""
    import logging
    import signal

    pytest.importorskip("ray")
    from helpers import read_output

    from cosybatch import ray_run as ray_module
    from cosybatch.ray_run import RayOptions, ray_run

    handled = []

    class Seen(logging.Handler):
        def emit(self, record):
            if "finishing the chunks in flight" in record.getMessage():
                handled.append(record)

    def sigterm_and_wait_until_handled():
        before = len(handled)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while len(handled) == before:  # the driver's handler runs on this (the main) thread
            assert time.monotonic() < deadline, "the SIGTERM handler never ran"
            time.sleep(0.01)

    when = {"point": "first chunk"}

    class Progress(ray_module.Progress):
        def update(self, items, audio_s):
            super().update(items, audio_s)
            if when["point"] == "first chunk":
                when["point"] = None
                sigterm_and_wait_until_handled()

        def close(self):
            super().close()
            if when["point"] == "all finished":
                when["point"] = None
                sigterm_and_wait_until_handled()

    seen = Seen()
    logging.getLogger("cosybatch").addHandler(seen)
    monkeypatch.setattr(ray_module, "Progress", Progress)
    data = [{"id": f"r{i}", "text": f"Row {i} is here."} for i in range(24)]
    corpus = write_parquet(tmp_path / "c.parquet", data)
    cfg = RunConfig(corpus=corpus, out=tmp_path / "out", progress="none")
    try:
        first = ray_run(cfg, RayOptions(actors=1, rows_per_task=4))
        assert (first.status, first.exit_code) == ("interrupted", 4)
        assert 0 < len(read_output(cfg.out)) < len(data)

        when["point"] = "all finished"
        second = ray_run(cfg, RayOptions(actors=1, rows_per_task=4))
        assert when["point"] is None and len(handled) == 2  # the SIGTERM did come, after the last chunk
        assert (second.status, second.exit_code) == ("complete", 0)
    finally:
        logging.getLogger("cosybatch").removeHandler(seen)
    assert sorted(read_output(cfg.out)) == sorted(r["id"] for r in data)
    assert json.loads((cfg.out / "stats.json").read_text())["status"] == "complete"
    handler = signal.getsignal(signal.SIGTERM)  # Ray's own, or the default: not the finished run's
    assert not getattr(handler, "__qualname__", "").startswith("ray_run.")


# -- 8. reading the HF export as the README says ------------------------------------------------
def readme_hf_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("**Reading the Hugging Face export.**")
    return text[start:text.index("\n## ", start)]


def hf_export_in(tmp_path: Path) -> dict:
    """out/corpus/exports/hf under tmp_path, as the README's paths expect; the env to run in."""
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(3))
    result = run(RunConfig(corpus=corpus, out=tmp_path / "out" / "corpus", export=("hf",), progress="none"))
    assert result.exit_code == 0
    return {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_DATASETS_OFFLINE": "1"}


def test_the_readme_hf_snippet_runs_as_written(tmp_path):
    section = readme_hf_section()
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "torchcodec" in section and "FFmpeg" in section  # what decoding ds[0]["audio"] needs
    env = hf_export_in(tmp_path)
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    item_id, sr, samples = proc.stdout.split()
    assert item_id.startswith("utt/") and sr == "22050" and int(samples) > 0


def test_decoding_the_hf_audio_with_torchcodec(tmp_path):
    """The README's decode path, where torchcodec and FFmpeg are installed (not on the CI machines)."""
    probe = subprocess.run([sys.executable, "-c", "import torchcodec.decoders"], capture_output=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip("torchcodec (with FFmpeg) is not installed")
    env = hf_export_in(tmp_path)
    code = ('import datasets\nds = datasets.load_dataset("parquet", data_files="out/corpus/exports/hf/data/*.parquet", '
            'split="train")\na = ds[0]["audio"]\nprint(a["sampling_rate"], len(a["array"]))\n')
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    sr, samples = proc.stdout.split()
    assert sr == "22050" and int(samples) > 0
