"""Fixtures (and the memory release between tests); shared functions live in helpers.py."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TEXTS

# A job run in process leaves its engine (an ONNX session, torch modules) in reference cycles that
# only a full collection frees, and the suite runs hundreds of tests between full collections: the
# process grew by ~400 MB per Piper job, 11 GB in all. After any test that grew the process by more
# than RELEASE_AFTER_BYTES, collect and hand the freed heap back to the system.
RELEASE_AFTER_BYTES = 256 * 2**20
_baseline = {"rss": 0}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _release_memory() -> None:
    gc.collect()
    # glibc keeps freed arenas otherwise; elsewhere the collection alone frees what the cycles held.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield  # setup, call and teardown, module and session fixtures' teardown included
    if os.path.exists("/proc/self/statm") and _rss_bytes() > _baseline["rss"] + RELEASE_AFTER_BYTES:
        _release_memory()
        _baseline["rss"] = _rss_bytes()


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return list(TEXTS)


@pytest.fixture(scope="module")
def engine():
    """The real bundled voice on CPU, loaded once per module (a load is well under a second; its ONNX
    session keeps the arena of its largest batch, about a GB, so it is not kept for the session)."""
    from cosybatch.engines import EngineOptions, open_engine

    return open_engine("piper", None, EngineOptions(device="cpu"))


@pytest.fixture(scope="session")
def cosyvoice_dir(tmp_path_factory) -> Path:
    """A tiny CosyVoice2 model directory in the official layout, random weights, written once. Its LM
    ends rows a few tokens after their minimum length (short=True), as a trained one ends a
    sentence (tests/engines/cosyvoice/test_cosyvoice_qc.py edits a copy whose rows run to the cap)."""
    from cosybatch.cosyvoice.tiny import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("cosyvoice") / "CosyVoice2-tiny", short=True)


@pytest.fixture(scope="session")
def cosyvoice_v1_dir(tmp_path_factory) -> Path:
    """A tiny CosyVoice-300M-SFT folder in the official layout (speakers in spk2info.pt), random weights
    (short=True, as cosyvoice_dir)."""
    from cosybatch.cosyvoice.tiny import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("cosyvoice-v1") / "CosyVoice-300M-SFT-tiny", family="v1",
                           variant="sft", short=True)


@pytest.fixture(scope="session")
def cosyvoice_v1_instruct_dir(tmp_path_factory) -> Path:
    """A tiny CosyVoice-300M-Instruct folder (its folder name is what says it follows instructions)."""
    from cosybatch.cosyvoice.tiny import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("cosyvoice-v1i") / "CosyVoice-300M-Instruct-tiny", family="v1",
                           variant="instruct", short=True)


@pytest.fixture(scope="session")
def cosyvoice_v3_dir(tmp_path_factory) -> Path:
    """A tiny Fun-CosyVoice3-0.5B folder in the official layout, random weights."""
    from cosybatch.cosyvoice.tiny import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("cosyvoice-v3") / "Fun-CosyVoice3-0.5B-tiny", family="v3")


@pytest.fixture(scope="session")
def tone():
    """RunConfig for the tone engine (tests/plugin, installed as a plugin): a job's mechanics in
    process, in milliseconds, with no model. tone(corpus, out, **settings) -> RunConfig."""
    from importlib.metadata import entry_points

    from cosybatch.config import RunConfig

    if not any(ep.name == "tone" for ep in entry_points(group="cosybatch.engines")):
        pytest.fail("the test plugin is not installed: pip install --no-deps ./tests/plugin (as .ci/run does)")

    def config(corpus: Path, out: Path, **settings) -> RunConfig:
        return RunConfig.from_options(corpus=corpus, out=out, **{"engine": "tone", "progress": "none", **settings})

    return config


# -- a real S3 API (moto's standalone server) -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(log_path: Path, **env: str):
    """moto's standalone S3 server on a free loopback port (ENV added to its environment): its
    endpoint URL, once it answers."""
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if exe is None:
        pytest.fail("moto_server is missing: pip install -e '.[test]' (it holds moto[server])")
    port = _free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **env})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "moto_server did not open its port in 60 s"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def s3_server_checking_credentials(tmp_path):
    """moto's S3 server checking every request's credentials (INITIAL_NO_AUTH_ACTION_COUNT=0):
    keys it never issued are refused, as a real store refuses bad ones."""
    with moto_server(tmp_path / "moto-auth.log", INITIAL_NO_AUTH_ACTION_COUNT="0") as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def s3_shared_server(tmp_path_factory):
    """One moto S3 server for the session's (the xdist worker's) tests that take `s3`: its endpoint."""
    with moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as endpoint:
        yield endpoint


@pytest.fixture
def s3(s3_shared_server, request):
    """A bucket of this test's own (named from its id) in the session's moto server: `.endpoint`
    and `.bucket`. Cheaper than a server per test; the buckets keep tests apart."""
    import hashlib
    from types import SimpleNamespace

    from helpers import s3_fs

    name = "t-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    s3_fs(s3_shared_server).create_dir(name)
    return SimpleNamespace(endpoint=s3_shared_server, bucket=name)
