"""Operations: job specs, shards across workers, status, metrics and dataset formats."""

from __future__ import annotations

import ast
import gzip
import http.server
import io
import json
import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import soundfile
import yaml
from helpers import ROOT, cli, corpus_rows, read_output, wait_for_items, write_parquet

from cosybatch.config import RunConfig
from cosybatch.job import run


def checked(*args: str, **kw) -> dict:
    proc = cli("run", *args, "--check", **kw)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])["config"]


# -- job specs ---------------------------------------------------------------------------------
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


# -- shards across workers --------------------------------------------------------------------
def test_three_workers_cover_every_id_once_and_merge(tmp_path):
    rows = [{"id": f"id-{i}", "text": t} for i, t in enumerate(["Yes.", "No.", "Maybe so.", "Hello there.",
                                                                 "Good night.", "See you soon."] * 4)]
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out),
                               "--shard", f"{i}/3", "--progress", "none", "--workers", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    # The third worker takes its index from the environment, as a Kubernetes Indexed Job pod does.
    procs.append(subprocess.Popen([sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out),
                                   "--shard", "3", "--progress", "none", "--workers", "1"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "JOB_COMPLETION_INDEX": "2"}))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    parts = sorted(out.glob("part-*"))
    assert [p.name for p in parts] == [f"part-0000{i}-of-00003" for i in range(3)]
    seen: list[str] = []
    for part in parts:
        ids = list(read_output(part))  # self-contained: its own shards, manifest, stats
        assert ids and (part / "manifest.parquet").exists() and (part / "stats.json").exists()
        seen += ids
    assert sorted(seen) == sorted(r["id"] for r in rows)  # union is the corpus, disjoint

    merged = json.loads(cli("merge", str(out)).stdout)
    assert merged["items"] == len(rows) and merged["problems"] == []
    manifest = pq.read_table(out / "manifest.parquet").to_pylist()
    assert sorted(m["id"] for m in manifest) == sorted(r["id"] for r in rows)
    assert all((out / m["shard"]).exists() for m in manifest)
    status = json.loads(cli("status", str(out), "--json").stdout)
    assert status["status"] == "complete" and status["done"] == len(rows) and len(status["parts"]) == 3


def test_merge_refuses_missing_parts(tmp_path):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(3))
    run(RunConfig(corpus=corpus, out=tmp_path / "out", shard_index=0, shard_count=2, progress="none"))
    proc = cli("merge", str(tmp_path / "out"))
    assert proc.returncode == 2 and "parts [1] of 2 are missing" in proc.stderr
    status = json.loads(cli("status", str(tmp_path / "out"), "--json").stdout)
    assert status["status"] == "partial" and status["missing_parts"] == [1]
    assert json.loads(cli("merge", str(tmp_path / "out"), "--partial").stdout)["problems"]


# -- status and metrics ------------------------------------------------------------------------
def test_status_and_metrics_of_a_running_job(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    def metrics(path: Path) -> dict:
        out = {}
        for family in text_string_to_metric_families(path.read_text()):
            for sample in family.samples:
                out[(sample.name, sample.labels.get("status"))] = sample.value
        return out

    rows = corpus_rows(30)
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    prom = tmp_path / "cosybatch.prom"
    proc = subprocess.Popen([sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out),
                             "--metrics-file", str(prom), "--progress", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_items(out, proc, 4)
    live = json.loads(cli("status", str(out), "--json").stdout)
    assert live["status"] == "running" and live["total"] == 30
    assert 4 <= live["done"] < 30 and live["items_per_second"] > 0 and live["eta_seconds"] > 0
    during = metrics(prom)
    assert during[("cosybatch_run_complete", None)] == 0
    _stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr  # status did not disturb the run

    done = json.loads(cli("status", str(out), "--json").stdout)
    assert (done["status"], done["done"], done["failed"]) == ("complete", 30, 0)
    assert "complete, 30/30 done" in cli("status", str(out)).stdout
    final = metrics(prom)
    stats = json.loads((out / "stats.json").read_text())
    assert final[("cosybatch_items_total", "done")] == 30
    assert final[("cosybatch_items_total", "failed")] == 0
    assert final[("cosybatch_audio_seconds_total", None)] == pytest.approx(stats["audio_seconds"])
    assert final[("cosybatch_batch_seconds_count", None)] == stats["batches"]
    assert final[("cosybatch_run_complete", None)] == 1


def test_pushgateway_receives_the_final_metrics(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    received = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, body.decode()))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(2))
        url = f"http://127.0.0.1:{server.server_address[1]}"
        run(RunConfig(corpus=corpus, out=tmp_path / "job1", pushgateway=url, progress="none"))
    finally:
        server.shutdown()
    assert len(received) == 1
    path, body = received[0]
    from cosybatch.metrics import default_job_name

    assert path == f"/metrics/job/{default_job_name(tmp_path / 'job1')}"
    names = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples
             if s.labels.get("status") in (None, "done")}
    assert names["cosybatch_items_total"] == 2


def test_unreachable_pushgateway_does_not_fail_the_job(tmp_path):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(1))
    result = run(RunConfig(corpus=corpus, out=tmp_path / "o", pushgateway="http://127.0.0.1:9", progress="none"))
    assert result.status == "complete"


def test_unwritable_metrics_file_does_not_stop_the_audio(tmp_path, tone):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(2))
    result = run(tone(corpus, tmp_path / "out", metrics_file=tmp_path / "no" / "such" / "m.prom"))
    assert result.status == "complete" and result.exit_code == 0


# -- dataset formats ---------------------------------------------------------------------------
def test_dataset_formats_load_in_their_libraries(tmp_path):
    rows = corpus_rows(5)
    corpus = write_parquet(tmp_path / "c.parquet", rows)
    out = tmp_path / "out"
    run(RunConfig(corpus=corpus, out=out, export=("hf", "nemo", "lhotse"), shard_max_items=2, progress="none"))
    truth = {i["meta"]["id"]: i for i in read_output(out).values()}

    import datasets

    hf = datasets.load_dataset("parquet", data_files=sorted(map(str, (out / "exports/hf/data").glob("*.parquet"))),
                               split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert isinstance(hf.features["audio"], datasets.Audio)
    assert hf.features["audio"].sampling_rate == 22050
    raw = hf.cast_column("audio", datasets.Audio(decode=False))
    assert sorted(raw["id"]) == sorted(truth)
    for row in raw:
        audio, sr = soundfile.read(io.BytesIO(row["audio"]["bytes"]), dtype="float32")
        assert sr == 22050 and len(audio) == len(truth[row["id"]]["audio"])
        assert row["text"] == truth[row["id"]]["meta"]["text"]
        assert row["duration"] == pytest.approx(len(audio) / sr)

    manifest = out / "exports/nemo/manifest.jsonl"
    entries = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert sorted(e["id"] for e in entries) == sorted(truth)
    for e in entries:
        assert set(e) >= {"audio_filepath", "duration", "text"}
        info = soundfile.info(str(manifest.parent / e["audio_filepath"]))
        assert info.duration == pytest.approx(e["duration"], abs=1e-3)
        assert e["text"] == truth[e["id"]]["meta"]["text"]

    import lhotse

    cuts = lhotse.CutSet.from_manifests(
        recordings=lhotse.load_manifest(out / "exports/lhotse/recordings.jsonl.gz"),
        supervisions=lhotse.load_manifest(out / "exports/lhotse/supervisions.jsonl.gz"))
    assert len(cuts) == 5
    for cut in cuts:
        item_id = cut.supervisions[0].custom["id"]
        assert cut.duration == pytest.approx(truth[item_id]["meta"]["duration"])
        assert cut.supervisions[0].text == truth[item_id]["meta"]["text"]
        assert cut.load_audio().shape == (1, len(truth[item_id]["audio"]))
    with gzip.open(out / "exports/lhotse/recordings.jsonl.gz", "rt") as f:
        assert all(Path(json.loads(line)["sources"][0]["source"]).is_absolute() for line in f)

    # `cosybatch export` does the same on demand, also for a sharded job's root.
    proc = cli("export", str(out), "--to", "nemo")
    assert proc.returncode == 0 and json.loads(proc.stdout)["nemo"].endswith("manifest.jsonl")
