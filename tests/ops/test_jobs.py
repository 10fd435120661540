"""The jobs/ folder as schedulers use it: job specs and their keys, every example spec valid, the
cron script under dash, the Airflow DAG without Airflow, and the Kubernetes Indexed Job's policy."""

from __future__ import annotations

import ast
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, cli, corpus_rows, write_parquet


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
@pytest.mark.parametrize("name", ["k8s-indexed-job.yaml", "k8s-indexed-job-s3.yaml"])
def test_k8s_job_ignores_resumable_exits_and_fails_the_index_on_fatal_ones(name):
    import yaml

    from cosybatch.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TOO_MANY_FAILURES

    docs = list(yaml.safe_load_all((ROOT / "jobs" / name).read_text()))
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


def test_the_s3_indexed_job_shares_no_volume_and_each_pod_writes_its_part_to_the_store(tmp_path):
    """The object-storage Indexed Job: its pods mount only the spec and a scratch emptyDir (no
    shared volume), and the spec it runs makes pod 2 stage on that scratch disk and write
    s3://.../part-00002-of-00004."""
    from cosybatch.jobspec import config_from_spec
    from cosybatch.run.preflight import part_config

    docs = list(yaml.safe_load_all((ROOT / "jobs" / "k8s-indexed-job-s3.yaml").read_text()))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    pod = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert {v["name"] for v in pod["volumes"] if "emptyDir" in v} == {"scratch"}
    (name, text), = config_map["data"].items()
    command = container["command"]
    assert command[command.index("--job") + 1] == f"{mounts['spec']}/{name}" and "--shard" in command
    spec = tmp_path / name
    spec.write_text(text)
    cfg = part_config(config_from_spec(spec, shard="2/4"))
    assert cfg.input.corpus == "s3://speech-corpora/english/"
    assert cfg.output.store == "s3://speech-datasets/english-piper/part-00002-of-00004"
    assert cfg.output.folder == Path(mounts["scratch"]) / "cosybatch" / "part-00002-of-00004"
    assert cfg.output.lease_s == 60


# -- job specs and the examples in jobs/ --------------------------------------------------------


def checked(*args: str, **kw) -> dict:
    proc = cli("run", *args, "--check", **kw)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])["config"]


@pytest.mark.slow
def test_job_spec_values_flags_override_and_bad_keys(tmp_path):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(2))
    spec = tmp_path / "job.toml"
    spec.write_text(f'corpus = "{corpus}"\nbatch-size = 4\nseed = 7\nnormalize = false\nexport = ["hf"]\n')
    cfg = checked("--job", str(spec))
    assert (cfg["batch_size"], cfg["seed"], cfg["normalize"], cfg["export"]) == (4, 7, False, ["hf"])
    cfg = checked("--job", str(spec), "--seed", "9", "--normalize")
    assert (cfg["batch_size"], cfg["seed"], cfg["normalize"]) == (4, 9, True)

    spec.write_text(f'corpus = "{corpus}"\nbatch_sise = 4\n')
    proc = cli("run", "--job", str(spec), "--check")
    assert proc.returncode == 2 and "unknown key 'batch_sise'" in proc.stderr and "batch_size" in proc.stderr
    spec.write_text(f'corpus = "{corpus}"\nbatch_size = "many"\n')
    proc = cli("run", "--job", str(spec), "--check")
    assert proc.returncode == 2 and "batch_size" in proc.stderr
    yml = tmp_path / "job.yaml"
    yml.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    proc = cli("run", "--job", str(yml), "--check")
    assert proc.returncode == 2 and "pwned" not in proc.stdout  # parsed, never executed


@pytest.mark.slow
def test_every_example_in_jobs_is_valid(cosyvoice_dir, cosyvoice_v1_dir, cosyvoice_v3_dir):
    jobs = ROOT / "jobs"
    specs = sorted(p for p in jobs.iterdir() if p.suffix in (".toml", ".yaml", ".yml") and not p.name.startswith("k8s"))
    assert len(specs) >= 3
    # The real CosyVoice folders cannot be downloaded here: tiny ones in the official layout of each
    # family stand in for them, and the spec's device is overridden on this GPU-less machine.
    stand_ins = {"cosyvoice-300m": (cosyvoice_v1_dir, "CosyVoice-300M-SFT", ["--speaker", "alice"]),
                 "cosyvoice2": (cosyvoice_dir, "CosyVoice2-0.5B", []),
                 "cosyvoice3": (cosyvoice_v3_dir, "Fun-CosyVoice3-0.5B", ["--precision", "fp32"])}
    families = set()
    for spec in specs:
        family = next((k for k in stand_ins if spec.name.startswith(k)), None)
        override = []
        if family:
            model, _, extra = stand_ins[family]
            override = ["--model", str(model), "--device", "cpu", *extra]
        proc = cli("run", "--job", str(spec.relative_to(ROOT)), "--shard", "0/4", *override, "--check")
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout.splitlines()[-1])
        cfg = report["config"]
        if family:
            families.add(family)
            options = cfg["engine_options"]
            assert cfg["engine"] == "cosyvoice" and options["model"] == str(model)  # --model overrides the table
            assert report["voice"]["family"] == stand_ins[family][1]
    assert families == set(stand_ins)  # a spec for each family

    # Command lines in the scheduler examples, checked as those schedulers would run them.
    commands = []
    for script in jobs.glob("*.sh"):
        text = script.read_text().replace("\\\n", " ")
        commands += [line[line.index("cosybatch run") + len("cosybatch"):] for line in text.splitlines()
                     if "cosybatch run" in line and not line.lstrip().startswith("#")]
    dag = ast.parse((jobs / "airflow_dag.py").read_text())
    run_template = next(n.value.value for n in ast.walk(dag) if isinstance(n, ast.Assign)
                        and getattr(n.targets[0], "id", "") == "RUN")
    command = run_template.format(index=1, count=4)
    commands.append(command[command.index("cosybatch run") + len("cosybatch"):])
    docs = list(yaml.safe_load_all((jobs / "k8s-indexed-job.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["spec"]["completionMode"] == "Indexed"
    container = job["spec"]["template"]["spec"]["containers"][0]
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    k8s_spec = yaml.safe_load(config_map["data"]["english-piper-sharded.yaml"])
    local_spec = yaml.safe_load((jobs / "english-piper-sharded.yaml").read_text())
    assert set(k8s_spec) == set(local_spec)  # the ConfigMap is the same spec with cluster paths
    commands.append(shlex.join(container["command"][1:]).replace("/etc/cosybatch/", "jobs/"))
    assert len(commands) >= 4
    for command in commands:
        args = shlex.split(command)[1:]  # drop "run"
        cfg = checked(*args, env={"JOB_COMPLETION_INDEX": "2", "SLURM_ARRAY_TASK_ID": "2"})
        assert cfg["corpus"] == "examples/corpus.parquet"
