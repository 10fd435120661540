"""Datasets written to object storage (cosybatch.store.objects), against a real S3-API server
(moto's, one per test process, a bucket per test): a run to s3:// commits each shard only after
its upload, a kill -9 in the middle of a multipart upload loses nothing and duplicates nothing
whether the rerun has the old staging folder or an empty one (a second machine), two workers of
a sharded job stage on two "machines" and `merge` runs on the URI, the lease keeps a second
writer out, and a missing bucket or bad credentials are refused before any work. What the store
holds is read back by listing and reading its objects, never through cosybatch."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import soundfile
from helpers import S3_ENV, cli, corpus_rows, download_prefix, last_json, s3_fs, write_jsonl

from cosybatch.errors import OutputError, UsageError
from cosybatch.store.objects import LEASE, Lease, Store

pytestmark = pytest.mark.slow

# More than one part of a multipart upload (pyarrow's S3 client sends 5 MiB parts), so that the
# killed upload has sent data, not only opened.
MULTIPART_BYTES = 6 << 20

# `python -m cosybatch` whose upload of one shard (HANG_ON) sends MULTIPART_BYTES of a multipart
# upload, says so in a file (HANG_MARK) and waits there to be killed.
HANGING_UPLOAD = f"""
import os, sys, time
from cosybatch.store import objects

real = objects.Store.upload

def upload(self, path, name):
    if name != os.environ["HANG_ON"]:
        return real(self, path, name)
    with self._output(name) as stream:
        stream.write(b"\\0" * {MULTIPART_BYTES})
        open(os.environ["HANG_MARK"], "w").close()
        time.sleep(3600)

objects.Store.upload = upload
from cosybatch.__main__ import main
sys.argv = ["cosybatch", *sys.argv[1:]]
main()
"""


def env_for(endpoint: str) -> dict:
    return {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}


LEASE_S = "6"
"""The runs' --lease here. A live run renews it every 2 s; `status` calls it running while the last
renewal is under 12 s old, and a second writer watches it for 6 s. With --lease 2 (renewal every
0.67 s, a 4 s window) a busy 2-core machine once stalled the hung run's renewal long enough for
`status` to say "stopped". A rerun after a kill waits this long: wall time, not CPU."""


def run_to(corpus, uri: str, staging: Path, endpoint: str, *extra) -> subprocess.CompletedProcess:
    return cli("run", corpus, "--out", uri, "--staging", staging, "--engine", "tone", "--progress", "none",
               "--shard-max-items", "2", "--lease", LEASE_S, *extra, env=env_for(endpoint))


def store_items(fs, prefix: str, dest: Path) -> dict[str, dict]:
    """The dataset in the store as a trainer reads it: the manifest, and each item it lists read
    from its shard object (every audio member decodes to its length); fails on an id listed twice
    or an item whose shard does not hold it."""
    download_prefix(fs, prefix, dest)
    manifest = pq.read_table(dest / "manifest.parquet").to_pylist()
    ids = [r["id"] for r in manifest]
    assert len(ids) == len(set(ids)), "an id is listed twice"
    found: dict[str, dict] = {}
    for shard in sorted({r["shard"] for r in manifest}):
        with tarfile.open(dest / shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name, data in members.items():
            if name.endswith(".json"):
                meta = json.loads(data)
                audio, _ = soundfile.read(io.BytesIO(members[name[:-5] + ".wav"]))
                assert len(audio) == meta["num_samples"] > 0
                assert meta["id"] not in found, f"{meta['id']} is in two shards"
                found[meta["id"]] = {**meta, "shard": shard, "key": name[:-5]}
    assert sorted(found) == sorted(ids)
    return found


def segments_items(fs, prefix: str) -> int:
    """Items the store's commit segments record."""
    from pyarrow import fs as pafs

    count = 0
    for info in fs.get_file_info(pafs.FileSelector(f"{prefix}/.cosybatch/commits", allow_not_found=True)):
        with fs.open_input_stream(info.path, compression=None) as f:
            count += sum(len(r["items"]) for r in map(json.loads, f.read().splitlines()) if r["t"] == "items")
    return count


def test_a_run_to_s3_commits_each_shard_after_its_upload_and_reruns_anywhere(s3, tmp_path):
    fs = s3_fs(s3.endpoint)
    rows = corpus_rows(9)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
    staging = tmp_path / "machine-a"
    proc = run_to(corpus, f"s3://{s3.bucket}/ds/", staging, s3.endpoint)
    assert proc.returncode == 0, proc.stderr
    summary = last_json(proc)
    assert summary["out"] == f"s3://{s3.bucket}/ds" and summary["items_done"] == 9
    stats = json.loads((staging / "stats.json").read_text())
    assert stats["stage_seconds"]["upload"] > 0 and stats["status"] == "complete"
    items = store_items(fs, f"{s3.bucket}/ds", tmp_path / "read")
    assert sorted(items) == sorted(r["id"] for r in rows)
    listed = sorted(p.relative_to(tmp_path / "read").as_posix() for p in (tmp_path / "read").rglob("*")
                    if p.is_file())
    shards = [n for n in listed if n.startswith("shard-")]
    segments = [n for n in listed if n.startswith(".cosybatch/commits/")]
    assert len(shards) >= 2 and shards == sorted({m["shard"] for m in
                                                  pq.read_table(tmp_path / "read" / "manifest.parquet").to_pylist()})
    # One commit segment per shard, replaced at the end by one checkpoint of the whole journal.
    assert segments == [f".cosybatch/commits/upto-{len(shards):08d}.jsonl"]
    closed = [json.loads(line)["shard"] for line in (tmp_path / "read" / segments[0]).read_text().splitlines()
              if json.loads(line)["t"] == "closed"]
    assert closed == list(range(len(shards)))
    assert {"manifest.parquet", "stats.json", "README.md", ".cosybatch/job.json"} <= set(listed)
    assert LEASE not in listed  # given back at the end
    assert json.loads((tmp_path / "read" / "stats.json").read_text())["status"] == "complete"
    assert not list(staging.glob("shard-*"))  # staging keeps no uploaded shard
    # The report's clips were read from the store by range (no shard fetched): each is its member.
    import base64
    import re

    page = (tmp_path / "read" / "report.html").read_text()
    embedded = dict(re.findall(r'<audio controls preload="metadata" data-id="([^"]+)" src="data:audio/[a-z-]+;base64,'
                               r'([A-Za-z0-9+/=]+)"', page))
    assert len(embedded) == 9 and "could not be read" not in page
    for item_id, data in embedded.items():
        meta = items[item_id]
        with tarfile.open(tmp_path / "read" / meta["shard"]) as tar:
            assert base64.b64decode(data) == tar.extractfile(f"{meta['key']}.wav").read()
    for name in listed:
        if name.endswith((".json", ".jsonl", ".md")):
            assert "testing" not in (tmp_path / "read" / name).read_text(), f"a credential in {name}"

    for where in (staging, tmp_path / "machine-b"):  # the same staging, then an empty one
        again = run_to(corpus, f"s3://{s3.bucket}/ds", where, s3.endpoint)
        assert again.returncode == 0, again.stderr
        assert last_json(again)["items_done"] == 0 and last_json(again)["job_totals"]["items_done"] == 9

    status = cli("status", f"s3://{s3.bucket}/ds", "--json", env=env_for(s3.endpoint))
    assert status.returncode == 0, status.stderr
    assert last_json(status)["done"] == 9 and last_json(status)["status"] == "complete"
    assert last_json(status)["root"] == f"s3://{s3.bucket}/ds"
    verified = cli("verify", f"s3://{s3.bucket}/ds", "--json", env=env_for(s3.endpoint))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    scored = cli("qc", f"s3://{s3.bucket}/ds", "--json", env=env_for(s3.endpoint))
    assert scored.returncode == 0, scored.stderr
    assert last_json(scored)["clips"] == 9
    exported = cli("export", f"s3://{s3.bucket}/ds", "--to", "nemo", env=env_for(s3.endpoint))
    assert exported.returncode == 0, exported.stderr
    assert last_json(exported)["nemo"] == f"s3://{s3.bucket}/ds/exports/nemo/tarred_audio_manifest.json"
    read = tmp_path / "read2"
    download_prefix(fs, f"{s3.bucket}/ds", read)
    nemo = [json.loads(line) for line in (read / "exports/nemo/tarred_audio_manifest.json").read_text().splitlines()]
    assert sorted(r["id"] for r in nemo) == sorted(r["id"] for r in rows)
    assert pq.read_table(read / "qc.parquet").num_rows == 9 and (read / "report.html").exists()
    for tar in (read / "exports/nemo").glob("audio_*.tar"):  # the store's copies of the shards, byte for byte
        assert tar.read_bytes() == (read / f"shard-{int(tar.stem.split('_')[1]):06d}.tar").read_bytes()


def corpus_in_s3(fs, rows: list[dict], prefix: str, parts: int = 3) -> str:
    """ROWS as PARTS JSONL parts under PREFIX in the store: the corpus's URI."""
    for p in range(parts):
        data = "".join(json.dumps(r) + "\n" for r in rows[p::parts]).encode()
        with fs.open_output_stream(f"{prefix}/part-{p:05d}.jsonl", compression=None) as f:
            f.write(data)
    return f"s3://{prefix}/"


def _killed_mid_upload(s3, tmp_path: Path, rows: list[dict], staging: Path) -> str:
    """A run of a corpus of parts in the store to s3://BUCKET/ds, killed with SIGKILL while a
    multipart upload of shard-000001.tar is in flight (checked with boto3: the store has the
    upload open, and no such object). Returns the corpus's URI."""

    corpus = corpus_in_s3(s3_fs(s3.endpoint), rows, f"{s3.bucket}/corpus")
    mark = tmp_path / "hanging"
    script = tmp_path / "hanging_upload.py"
    script.write_text(HANGING_UPLOAD)
    proc = subprocess.Popen(
        [sys.executable, str(script), "run", corpus, "--out", f"s3://{s3.bucket}/ds", "--staging", str(staging),
         "--engine", "tone", "--progress", "none", "--shard-max-items", "2", "--lease", LEASE_S],
        env={**os.environ, **env_for(s3.endpoint), "HANG_ON": "shard-000001.tar", "HANG_MARK": str(mark)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _until_mid_upload(proc, mark, s3, tmp_path, corpus)
    finally:
        if proc.poll() is None:  # a failing check must not leave the hung run behind
            proc.kill()
            proc.communicate()
    return corpus


def _until_mid_upload(proc: subprocess.Popen, mark: Path, s3, tmp_path: Path, corpus: str) -> None:
    import boto3

    deadline = time.monotonic() + 120
    while not mark.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the upload of shard-000001.tar never started"
        time.sleep(0.05)
    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    def in_flight() -> list[str]:  # the multipart uploads the store has open
        return [u["Key"] for u in client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])]

    while "ds/shard-000001.tar" not in in_flight():
        assert time.monotonic() < deadline, "no multipart upload in flight"
        time.sleep(0.05)
    status = cli("status", f"s3://{s3.bucket}/ds", "--json", env=env_for(s3.endpoint))  # from another "machine"
    assert status.returncode == 0, status.stderr
    assert last_json(status)["status"] == "running"
    assert last_json(status)["done"] == segments_items(s3_fs(s3.endpoint), f"{s3.bucket}/ds") > 0
    second = run_to(corpus, f"s3://{s3.bucket}/ds", tmp_path / "machine-c", s3.endpoint)  # a second writer, elsewhere
    assert second.returncode == 2, second.stderr
    assert "being written by another cosybatch run" in second.stderr and not (tmp_path / "machine-c").exists()
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert "ds/shard-000001.tar" in in_flight()  # left open by the kill (a lease renewal may be too)
    listed = {o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket).get("Contents", [])}
    assert "ds/shard-000000.tar" in listed and "ds/shard-000001.tar" not in listed


def test_kill_9_mid_upload_then_a_fresh_machine_resumes_exactly_once(s3, tmp_path):
    rows = corpus_rows(12)
    corpus = _killed_mid_upload(s3, tmp_path, rows, tmp_path / "machine-a")
    fs = s3_fs(s3.endpoint)
    committed = segments_items(fs, f"{s3.bucket}/ds")
    assert 0 < committed < 12
    # The rerun waits out the dead run's lease first.
    rerun = run_to(corpus, f"s3://{s3.bucket}/ds", tmp_path / "machine-b", s3.endpoint)
    assert rerun.returncode == 0, rerun.stderr
    assert last_json(rerun)["items_done"] == 12 - committed  # the uncommitted rows were made again, no more
    items = store_items(fs, f"{s3.bucket}/ds", tmp_path / "read")
    assert sorted(items) == sorted(r["id"] for r in rows)


def test_kill_9_mid_upload_then_the_same_staging_uploads_what_it_sealed(s3, tmp_path):
    from cosybatch.store.checkpoint import Journal

    rows = corpus_rows(12)
    staging = tmp_path / "machine-a"
    corpus = _killed_mid_upload(s3, tmp_path, rows, staging)
    staged = sum(len(r["items"]) for r in Journal.read(staging / ".cosybatch" / "journal.jsonl") if r["t"] == "items")
    fs = s3_fs(s3.endpoint)
    assert staged > segments_items(fs, f"{s3.bucket}/ds")  # staging holds sealed shards the store lacks
    rerun = run_to(corpus, f"s3://{s3.bucket}/ds", staging, s3.endpoint)
    assert rerun.returncode == 0, rerun.stderr
    assert last_json(rerun)["items_done"] == 12 - staged  # what staging held was uploaded, not made again
    items = store_items(fs, f"{s3.bucket}/ds", tmp_path / "read")
    assert sorted(items) == sorted(r["id"] for r in rows)


def test_a_corpus_part_changed_in_the_store_is_refused_naming_it_and_restart_starts_over(s3, tmp_path):
    fs = s3_fs(s3.endpoint)
    rows = corpus_rows(6)
    corpus = corpus_in_s3(fs, rows, f"{s3.bucket}/corpus")
    staging = tmp_path / "staging"
    assert run_to(corpus, f"s3://{s3.bucket}/ds", staging, s3.endpoint).returncode == 0
    with fs.open_output_stream(f"{s3.bucket}/corpus/part-00001.jsonl", compression=None) as f:
        f.write(json.dumps({"id": "new", "text": "A row that was not there."}).encode() + b"\n")
    for where in (staging, tmp_path / "fresh"):  # the job's record comes from the store either way
        refused = run_to(corpus, f"s3://{s3.bucket}/ds", where, s3.endpoint)
        assert refused.returncode == 2, refused.stderr
        assert "part part-00001.jsonl changed" in refused.stderr
    restarted = run_to(corpus, f"s3://{s3.bucket}/ds", tmp_path / "fresh", s3.endpoint, "--restart")
    assert restarted.returncode == 0, restarted.stderr
    assert last_json(restarted)["job_totals"]["items_done"] == 5  # parts 0 and 2, and the new row
    items = store_items(fs, f"{s3.bucket}/ds", tmp_path / "read")
    assert sorted(items) == sorted([r["id"] for r in rows if rows.index(r) % 3 != 1] + ["new"])
    download = tmp_path / "read"
    assert [p.name for p in download.glob(".cosybatch/commits/*.jsonl")] == \
        [f"upto-{len(list(download.glob('shard-*.tar'))):08d}.jsonl"]  # the old job's commits are gone


def test_two_workers_on_two_machines_then_merge_on_the_uri(s3, tmp_path):
    fs = s3_fs(s3.endpoint)
    rows = corpus_rows(10)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
    for index in (0, 1):
        proc = run_to(corpus, f"s3://{s3.bucket}/job", tmp_path / f"machine-{index}", s3.endpoint, "--shard",
                      f"{index}/2")
        assert proc.returncode == 0, proc.stderr
        assert last_json(proc)["out"] == f"s3://{s3.bucket}/job/part-{index:05d}-of-00002"
    lease = json.dumps({"owner": "x", "host": "elsewhere", "pid": 7, "beats": 0, "seconds": 60,
                        "written": time.time()}).encode()
    with fs.open_output_stream(f"{s3.bucket}/job/part-00001-of-00002/.cosybatch/lease.json", compression=None) as f:
        f.write(lease)  # a run writing part 1 now, as far as the store says
    refused = cli("merge", f"s3://{s3.bucket}/job", env=env_for(s3.endpoint))
    assert refused.returncode == 2 and "part-00001-of-00002 is being written by a run now" in refused.stderr
    fs.delete_file(f"{s3.bucket}/job/part-00001-of-00002/.cosybatch/lease.json")
    merged = cli("merge", f"s3://{s3.bucket}/job", env=env_for(s3.endpoint))
    assert merged.returncode == 0, merged.stderr
    assert last_json(merged)["items"] == 10 and last_json(merged)["problems"] == []
    dest = tmp_path / "read"
    download_prefix(fs, f"{s3.bucket}/job", dest)
    manifest = pq.read_table(dest / "manifest.parquet").to_pylist()
    assert sorted(r["id"] for r in manifest) == sorted(r["id"] for r in rows)
    for record in manifest:  # every listed shard is an object, and holds the item
        with tarfile.open(dest / record["shard"]) as tar:
            assert json.loads(tar.extractfile(f"{record['key']}.json").read())["id"] == record["id"]
    assert (dest / "README.md").exists()


def test_the_lease_keeps_a_second_writer_out_and_a_dead_ones_lapses(s3, tmp_path, monkeypatch):
    for key, value in env_for(s3.endpoint).items():
        monkeypatch.setenv(key, value)
    store = Store(f"s3://{s3.bucket}/leased")
    first = Lease(store, 2)
    first.acquire()
    first.confirm()
    with pytest.raises(UsageError, match="being written by another cosybatch run"):
        Lease(store, 2).acquire()  # watches the lease for 2 s: the first renews it
    first.check()
    first._stop.set()  # the first run dies without giving the lease back: it stops renewing
    first._thread.join()
    second = Lease(store, 2)
    second.acquire()  # the lease did not move for 2 s: taken over
    second.confirm()
    with pytest.raises(OutputError, match="lost its lease"):
        first.check()  # the first run, were it only paused, commits nothing more
    second.release()
    assert store.read(LEASE) is None


def test_a_missing_bucket_and_bad_credentials_are_refused_before_any_work(s3, tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", corpus_rows(3))
    staging = tmp_path / "staging"
    proc = run_to(corpus, "s3://no-such-bucket/ds", staging, s3.endpoint)
    assert proc.returncode == 2, proc.stderr
    assert "'no-such-bucket' does not exist" in proc.stderr and "testing" not in proc.stderr
    assert not staging.exists()
    proc = run_to(corpus, f"s3://{s3.bucket}-not-a-path", staging, s3.endpoint)
    assert proc.returncode == 2 and "name a bucket and a prefix" in proc.stderr
    proc = cli("run", corpus, "--out", f"s3://{s3.bucket}/ds", "--staging", staging, "--engine", "tone",
               env={**env_for("http://127.0.0.1:9"), "AWS_EC2_METADATA_DISABLED": "true"})  # nothing listens there
    assert proc.returncode == 2, proc.stderr
    assert "AWS_ENDPOINT_URL" in proc.stderr and not staging.exists()


def test_bad_credentials_are_refused_before_any_work(s3_server_checking_credentials, tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", corpus_rows(3))
    staging = tmp_path / "staging"
    proc = run_to(corpus, "s3://any/ds", staging, s3_server_checking_credentials)  # keys it never issued
    assert proc.returncode == 2, proc.stderr
    assert "ACCESS_DENIED" in proc.stderr and "the credentials (AWS_ACCESS_KEY_ID" in proc.stderr
    assert "testing" not in proc.stderr  # the key is not repeated back
    assert not staging.exists()


def test_a_shard_damaged_in_staging_before_its_upload_is_repaired_first(s3, tmp_path):
    """Staging's sealed shard is cut after the kill: the rerun repairs staging before it uploads
    anything, so the store gets the shard's whole members only, and the rest are made again."""
    rows = corpus_rows(12)
    staging = tmp_path / "machine-a"
    corpus = _killed_mid_upload(s3, tmp_path, rows, staging)
    sealed = staging / "shard-000001.tar"
    with open(sealed, "r+b") as f:
        f.truncate(sealed.stat().st_size - 3000)  # into the last member
    rerun = run_to(corpus, f"s3://{s3.bucket}/ds", staging, s3.endpoint)
    assert rerun.returncode == 0, rerun.stderr
    items = store_items(s3_fs(s3.endpoint), f"{s3.bucket}/ds", tmp_path / "read")
    assert sorted(items) == sorted(r["id"] for r in rows)


def test_the_journal_is_its_newest_checkpoint_then_the_segments_after_it(s3, tmp_path, monkeypatch):
    """Checkpoints every few commits (here 3) keep a resume to a few objects; the segments they
    replace are deleted, and the journal read back is the journal written."""
    from cosybatch.config import RunConfig
    from cosybatch.run.local import run
    from cosybatch.store import objects

    for key, value in env_for(s3.endpoint).items():
        monkeypatch.setenv(key, value)
    fs = s3_fs(s3.endpoint)
    store = Store(f"s3://{s3.bucket}/journal")
    for name, text in (("upto-00000004", "a\nb\n"), ("00000002", "old\n"), ("00000004", "c\n"),
                       ("00000005", "d\n"), ("00000007", "after a gap\n")):
        store.write(f".cosybatch/commits/{name}.jsonl", text.encode())
    assert objects.store_journal(store) == (b"a\nb\nc\nd\n", 6)

    monkeypatch.setattr(objects, "CHECKPOINT_EVERY", 3)
    rows = corpus_rows(8)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
    cfg = RunConfig.from_options(corpus=corpus, out=f"s3://{s3.bucket}/ds", staging=tmp_path / "staging", engine="tone",
                                 progress="none", shard_max_items=1, batch_size=1, lease=2)
    assert run(cfg).status == "complete"
    staged = (tmp_path / "staging" / ".cosybatch" / "journal.jsonl").read_bytes()
    names = sorted(n.rsplit("/", 1)[-1] for n in Store(f"s3://{s3.bucket}/ds").list(".cosybatch/commits"))
    assert names == ["upto-00000008.jsonl"]
    assert objects.store_journal(Store(f"s3://{s3.bucket}/ds")) == (staged, 8)
    again = run(cfg.with_options(out=f"s3://{s3.bucket}/ds", staging=tmp_path / "fresh"))
    assert again.status == "complete" and again.stats["items_done"] == 0
    assert (tmp_path / "fresh" / ".cosybatch" / "journal.jsonl").read_bytes() == staged
    assert sorted(store_items(fs, f"{s3.bucket}/ds", tmp_path / "read")) == sorted(r["id"] for r in rows)
