"""Status and metrics: `status` of a running job, the Prometheus textfile, the Pushgateway (its
grouping and last success), and metrics that fail without stopping the audio."""

from __future__ import annotations

import base64
import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import cli, corpus_rows, wait_for_items, write_parquet

from cosybatch.config import RunConfig
from cosybatch.run.local import run


# -- status and metrics ------------------------------------------------------------------------
@pytest.mark.slow
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
        run(RunConfig.from_options(corpus=corpus, out=tmp_path / "job1", pushgateway=url, progress="none"))
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
    result = run(RunConfig.from_options(corpus=corpus, out=tmp_path / "o", pushgateway="http://127.0.0.1:9",
                                        progress="none"))
    assert result.status == "complete"


def test_unwritable_metrics_file_does_not_stop_the_audio(tmp_path, tone):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(2))
    result = run(tone(corpus, tmp_path / "out", metrics_file=tmp_path / "no" / "such" / "m.prom"))
    assert result.status == "complete" and result.exit_code == 0


# -- Pushgateway grouping, last success, textfile labels ---------------------------------------


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
        result = run(RunConfig.from_options(corpus=corpus, out=tmp_path / team / "english", shard_index=0,
                                            shard_count=2,
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
    cfg = RunConfig.from_options(corpus=corpus, out=tmp_path / "out", metrics_file=prom, pushgateway=gateway.url,
                    metrics_job="english-nightly", progress="none")
    assert run(cfg).status == "complete"
    textfile = prom.read_text()
    assert all("job" not in s.labels for s in samples(textfile))
    first = value(textfile, "cosybatch_last_success_timestamp_seconds", cosybatch_job="english-nightly")
    assert first == json.loads((cfg.output.folder / "stats.json").read_text())["last_success_timestamp_seconds"]

    # The next night fails its failure threshold: the job's last success is still the first run's.
    again = run(RunConfig.from_options(**{**cfg.options(), "max_failures": "0"}))
    assert again.status == "too_many_failures"
    textfile = prom.read_text()
    assert value(textfile, "cosybatch_run_complete") == 0
    assert value(textfile, "cosybatch_last_success_timestamp_seconds") == first
    assert [p for _, p, _ in gateway.received] == ["/metrics/job/english-nightly"] * 2
    assert value(gateway.received[1][2], "cosybatch_last_success_timestamp_seconds") == first


@pytest.mark.slow
def test_metrics_job_is_a_run_flag_and_a_spec_key(tmp_path):
    corpus = write_parquet(tmp_path / "c.parquet", corpus_rows(1))
    spec = tmp_path / "job.toml"
    spec.write_text(f'corpus = "{corpus}"\nmetrics-job = "from-spec"\n')
    proc = cli("run", "--job", str(spec), "--check")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["config"]["metrics_job"] == "from-spec"
    proc = cli("run", "--job", str(spec), "--metrics-job", "from-flag", "--check")
    assert json.loads(proc.stdout.splitlines()[-1])["config"]["metrics_job"] == "from-flag"
