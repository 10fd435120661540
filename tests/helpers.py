"""What the tests share besides fixtures: paths, corpus writers, the subprocess CLI, and reading a
cosybatch output folder back the way a user would. conftest.py holds only fixtures."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import soundfile
import zygote

ROOT = Path(__file__).resolve().parent.parent
"""The repository root (examples/, jobs/, README.md)."""
GOLDEN = ROOT / "tests" / "golden"
"""Recorded upstream outputs (tests/golden/make_v3_golden.py writes them)."""

# Mixed lengths on purpose: durations must grow with text, batches must bucket by length.
TEXTS = [
    "Yes.",
    "Good morning.",
    "The kettle is boiling.",
    "Please close the window before you leave the house.",
    "Rain is expected this afternoon, so bring an umbrella and a warm coat.",
    "The library opens at nine. Returns go in the slot by the door. Late fees are small.",
    "After the long winter, the farmers checked every fence, repaired the old barn roof, and "
    "planted rows of beans, carrots and potatoes along the southern edge of the field.",
    "Why not?",
]


# -- corpora ---------------------------------------------------------------------------------------
def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    """One row a line; a str row is written as it is (to write a broken line on purpose)."""
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def corpus_rows(n: int) -> list[dict]:
    """n rows of the example sentences (ids utt/0, utt/1, ...): real text of mixed lengths."""
    lines = [line for line in (ROOT / "examples" / "sentences.txt").read_text().splitlines() if line.strip()]
    return [{"id": f"utt/{i}", "text": lines[i % len(lines)]} for i in range(n)]


def numbered_rows(n: int, prefix: str = "r") -> list[dict]:
    """n short rows, ids PREFIX0, PREFIX1, ..., each text naming its number."""
    return [{"id": f"{prefix}{i}", "text": f"Row {i} says something."} for i in range(n)]


def finished_tone_job(tone, folder: Path, n: int = 8, **settings) -> tuple[Path, Path]:
    """(corpus, out): a complete n-row job of the tone engine (the `tone` fixture) in FOLDER/out,
    run in process, shards of 2 items."""
    from cosybatch.run.local import run

    corpus = write_jsonl(folder / "c.jsonl", numbered_rows(n))
    out = folder / "out"
    assert run(tone(corpus, out, **{"shard_max_items": 2, **settings})).status == "complete"
    return corpus, out

# -- the command line, as a user runs it -----------------------------------------------------------
def cli(*args, env: dict | None = None, cwd: Path | None = ROOT, timeout: float = 600,
        check: bool = False, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m cosybatch ARGS` in a process of its own (Path arguments welcome): a child forked
    by this test process's zygote, which has the CLI's imports done (tests/zygote.py), or with
    fresh=True (or COSYBATCH_TEST_FRESH=1) a new interpreter. env adds to this process's
    environment; check=True fails the test on a non-zero exit, with both streams."""
    argv, full_env = [*map(str, args)], {**os.environ, **(env or {})}
    if fresh or os.environ.get("COSYBATCH_TEST_FRESH") == "1":
        proc = subprocess.run([sys.executable, "-m", "cosybatch", *argv], capture_output=True, text=True,
                              timeout=timeout, env=full_env, cwd=cwd)
    else:
        proc = zygote.run(argv, full_env, cwd, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:{proc.stdout}\nstderr:{proc.stderr}")
    return proc


def last_json(proc: subprocess.CompletedProcess) -> dict:
    """The JSON summary line every command ends its stdout with."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_run(corpus: Path, out: Path, *extra, shard_max_items: int = 4, progress: str = "log") -> subprocess.Popen:
    """`cosybatch run CORPUS --out OUT EXTRA` in the background, to be signalled or killed."""
    return subprocess.Popen(
        [sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out), "--shard-max-items",
         str(shard_max_items), "--progress", progress, *map(str, extra)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


# -- reading a job's folder back -------------------------------------------------------------------
def journal(out: Path) -> list[dict]:
    from cosybatch.store.checkpoint import Journal

    return list(Journal.read(out / ".cosybatch" / "journal.jsonl"))


def committed_items(out: Path) -> int:
    """Items the journal records as committed (0 before the folder has a journal)."""
    return sum(len(r["items"]) for r in journal(out) if r["t"] == "items")


def wait_for_items(out: Path, proc: subprocess.Popen, n: int, timeout: float = 120) -> None:
    """Until the background run has committed n items; fails if it ends or stalls first."""
    deadline = time.monotonic() + timeout
    while committed_items(out) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "run made no progress"
        time.sleep(0.05)


def read_output(out: Path) -> dict[str, dict]:
    """id -> {meta, audio, sample_rate, shard, key, data}; fails if any id appears twice, a member is
    broken or an item has another member than its audio (of the format its KEY.json names) and KEY.json."""
    items: dict[str, dict] = {}
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        keys = sorted({name.split(".", 1)[0] for name in members})
        for key in keys:
            meta = json.loads(members[f"{key}.json"])
            fmt = meta.get("format", "wav")  # the audio member is KEY.wav, KEY.flac or KEY.opus
            assert {n for n in members if n.startswith(f"{key}.")} == {f"{key}.json", f"{key}.{fmt}"}
            audio, sr = soundfile.read(io.BytesIO(members[f"{key}.{fmt}"]), dtype="float32")
            assert meta["id"] not in items, f"id {meta['id']!r} written twice"
            items[meta["id"]] = {"meta": meta, "audio": audio, "sample_rate": sr, "shard": shard.name, "key": key,
                                 "data": members[f"{key}.{fmt}"]}
    return items


def assert_complete(out: Path, rows: list[dict]) -> dict:
    """Every row's id once, every tar opens, every WAV decodes to its recorded length, no .partial left."""
    items = read_output(out)
    assert sorted(items) == sorted(r["id"] for r in rows)
    assert not list(out.glob("*.partial"))
    for item in items.values():
        assert len(item["audio"]) == item["meta"]["num_samples"] > 0
    return items


def assert_exactly_once(out: Path, expected_ids) -> dict:
    """Every expected id once in the shards (every WAV decodes) and in the manifest, no two items
    under one shard and key, and `verify` finds nothing wrong. Returns read_output's items."""
    from cosybatch.store.verify import verify

    items = read_output(out)  # every WAV decodes; fails on an id written twice
    assert sorted(items) == sorted(expected_ids)
    manifest = pq.read_table(out / "manifest.parquet").to_pylist()
    assert sorted(r["id"] for r in manifest) == sorted(expected_ids)
    assert len({(r["shard"], r["key"]) for r in manifest}) == len(manifest)
    result = verify(out)
    assert result["ok"], result
    return items


# -- object storage (moto's S3 server: the s3 fixture) ------------------------------------------------

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def s3_fs(endpoint: str):
    """pyarrow's S3 client for the test server, with the tests' credentials."""
    from pyarrow import fs as pafs

    return pafs.S3FileSystem(endpoint_override=endpoint.split("://")[1], scheme="http", access_key="testing",
                             secret_key="testing", region="us-east-1", allow_bucket_creation=True)


def download_prefix(fs, prefix: str, dest: Path) -> dict[str, int]:
    """Every object under BUCKET/PREFIX, byte for byte, into DEST (names relative to the prefix);
    returns name -> size."""
    from pyarrow import fs as pafs

    found = {}
    for info in fs.get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True)):
        if info.type != pafs.FileType.File:
            continue
        name = info.path[len(prefix):].lstrip("/")
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(info.path, compression=None) as f:
            path.write_bytes(f.read())
        found[name] = info.size
    return found
