"""The flow estimator through ONNX Runtime (flow_backend=onnx) against our torch estimator, on CPU.

Exports take about 10 s each on the tiny model, so the module shares one cache folder (and the CLI
run points XDG_CACHE_HOME at it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from helpers import read_output, write_parquet

from cosybatch.cosyvoice.flow import onnx as flow_onnx
from cosybatch.cosyvoice.flow.cfm import FlowInput
from cosybatch.cosyvoice.flow.onnx import FlowBackendError
from cosybatch.cosyvoice.pipeline import Token2Wav
from cosybatch.engines import EngineOptions, open_engine
from cosybatch.engines.cosyvoice import CosyVoiceOptions, check_flow_backend
from cosybatch.errors import UsageError


@pytest.fixture(scope="module")
def xdg_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(scope="module")
def cache_root(xdg_cache) -> Path:
    return xdg_cache / "cosybatch"  # where XDG_CACHE_HOME=xdg_cache puts cosybatch's cache


@pytest.fixture(scope="module")
def t2w_torch(cosyvoice_dir) -> Token2Wav:
    return Token2Wav(cosyvoice_dir)


@pytest.fixture(scope="module")
def t2w_onnx(cosyvoice_dir, cache_root) -> Token2Wav:
    return Token2Wav(cosyvoice_dir, flow_backend="onnx", onnx_cache=cache_root)


def mixed_items() -> list[FlowInput]:
    """A padded batch: mixed lengths, some with a zero-shot prompt (tokens and mel), some without."""
    gen = torch.Generator().manual_seed(7)
    items = []
    for tokens, prompt in ((23, 0), (5, 9), (14, 0), (2, 4), (31, 12), (1, 0)):
        items.append(FlowInput(
            tokens=torch.randint(0, 6561, (tokens,), generator=gen),
            embedding=torch.randn(192, generator=gen),
            prompt_tokens=torch.randint(0, 6561, (prompt,), generator=gen) if prompt else None,
            prompt_mel=torch.randn(2 * prompt, 80, generator=gen) if prompt else None,
        ))
    return items


def onnx_files(cache_root: Path) -> list[Path]:
    return sorted((cache_root / "flow-onnx").glob("*.onnx"))


def test_onnx_mels_match_torch_on_a_padded_batch(t2w_torch, t2w_onnx, monkeypatch):
    runner = t2w_onnx.flow.decoder.runner
    assert isinstance(runner, flow_onnx.OnnxEstimator) and runner.providers == ["CPUExecutionProvider"]
    calls = []
    run = runner.session.run
    monkeypatch.setattr(runner.session, "run", lambda *a, **k: calls.append(1) or run(*a, **k))

    # The torch estimator must not run on the onnx path.
    def refuse(*args, **kwargs):
        raise AssertionError("the torch estimator ran with flow_backend=onnx")

    monkeypatch.setattr(t2w_onnx.flow.decoder.estimator, "forward", refuse)
    items = mixed_items()
    want = t2w_torch.mels(items)
    got = t2w_onnx.mels(items)
    assert len(calls) == t2w_onnx.flow.n_timesteps  # one session call per Euler step, CFG as one batch
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape and g.dtype == torch.float32
        assert float((g - w).abs().max()) <= 1e-4
    # One item alone gives what it gives inside the batch, as with torch.
    alone = t2w_onnx.mels(items[4:5])[0]
    assert float((alone - got[4]).abs().max()) <= 1e-4


def test_export_has_dynamic_batch_and_frames(t2w_onnx, cache_root):
    (path,) = onnx_files(cache_root)
    model = onnx.load(str(path))
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert list(dims) == ["x", "mask", "mu", "t", "spks", "cond"]
    batch, frames = dims["x"][0], dims["x"][2]
    assert isinstance(batch, str) and isinstance(frames, str) and dims["x"][1] == 80
    assert dims["mask"] == [batch, 1, frames] and dims["t"] == [batch] and dims["spks"] == [batch, 80]
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert set(types.values()) == {onnx.TensorProto.FLOAT}


def test_second_load_reuses_the_cache(cosyvoice_dir, t2w_onnx, cache_root, monkeypatch):
    before = onnx_files(cache_root)
    assert len(before) == 1
    mtime = before[0].stat().st_mtime_ns

    def no_export(*args, **kwargs):
        raise AssertionError("exported again although the cache holds the file")

    monkeypatch.setattr(flow_onnx, "export_estimator", no_export)
    again = Token2Wav(cosyvoice_dir, flow_backend="onnx", onnx_cache=cache_root)
    assert again.flow.decoder.runner.path == before[0]
    assert onnx_files(cache_root) == before and before[0].stat().st_mtime_ns == mtime


def test_damaged_cache_file_is_rebuilt(cosyvoice_dir, t2w_onnx, t2w_torch, cache_root, tmp_path, monkeypatch):
    (good,) = onnx_files(cache_root)
    folder = tmp_path / "cache"
    (folder / "flow-onnx").mkdir(parents=True)
    damaged = folder / "flow-onnx" / good.name
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the weights: still a loadable protobuf
    damaged.write_bytes(bytes(data))

    # The rebuilds' export writes the fixture's file, which a real export made (test_onnx_mels_...
    # checks it): a second real export (10 CPU-s) would only repeat that one.
    exports, exported = [], good.read_bytes()
    monkeypatch.setattr(flow_onnx, "export_estimator", lambda *a: exports.append(a) or a[1].write_bytes(exported))
    rebuilt = Token2Wav(cosyvoice_dir, flow_backend="onnx", onnx_cache=folder)
    assert len(exports) == 1
    files = onnx_files(folder)
    assert len(files) == 1 and files[0].read_bytes() == exported  # the damaged file is gone
    items = mixed_items()[:3]
    for w, g in zip(t2w_torch.mels(items), rebuilt.mels(items), strict=True):
        assert float((g - w).abs().max()) <= 1e-4

    # A truncated file (an export killed half-way cannot leave one, but a disk can) is rebuilt too.
    files[0].write_bytes(exported[:1000])
    Token2Wav(cosyvoice_dir, flow_backend="onnx", onnx_cache=folder)
    assert len(exports) == 2 and len(onnx_files(folder)) == 1
    assert onnx_files(folder)[0].read_bytes() == exported  # the truncated file was replaced
    assert not list((folder / "flow-onnx").glob("*.tmp"))


def test_cache_key_follows_weights_and_dtype(cosyvoice_dir, tmp_path):
    from cosybatch.cosyvoice.model import read_config

    config = flow_onnx.estimator_config(read_config(cosyvoice_dir))
    key = flow_onnx.export_key(cosyvoice_dir / "flow.pt", config, torch.float32)
    assert key == flow_onnx.export_key(cosyvoice_dir / "flow.pt", config, torch.float32)
    assert key != flow_onnx.export_key(cosyvoice_dir / "flow.pt", config, torch.float16)
    other = tmp_path / "flow.pt"
    other.write_bytes((cosyvoice_dir / "flow.pt").read_bytes() + b"\0")
    assert key != flow_onnx.export_key(other, config, torch.float32)
    changed = {**config, "estimator": {**config["estimator"], "num_heads": 3}}
    assert key != flow_onnx.export_key(cosyvoice_dir / "flow.pt", changed, torch.float32)


def test_cache_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert flow_onnx.cache_root() == tmp_path / "cosybatch"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored, as the XDG spec says
    assert flow_onnx.cache_root() == Path.home() / ".cache" / "cosybatch"


def test_engine_option_accepted_and_refused(cosyvoice_dir, monkeypatch):
    for backend in ("torch", "onnx", "tensorrt"):
        assert CosyVoiceOptions(model=cosyvoice_dir, flow_backend=backend).flow_backend == backend
    with pytest.raises(UsageError, match="flow_backend must be torch, onnx or tensorrt"):
        CosyVoiceOptions(model=cosyvoice_dir, flow_backend="trt")

    # Without onnxruntime's TensorRT provider (the CPU build has none): a clear usage error, before
    # any weights load; on a CPU device, whatever the build.
    import onnxruntime

    from cosybatch.engines.cosyvoice import CosyVoiceEngine

    with pytest.raises(UsageError, match=r"flow_backend=tensorrt: .*CUDA GPU"):
        open_engine("cosyvoice", None, EngineOptions(device="cpu", engine=CosyVoiceOptions(
            model=cosyvoice_dir, flow_backend="tensorrt")))
    available = onnxruntime.get_available_providers()
    if "TensorrtExecutionProvider" not in available:
        with pytest.raises(UsageError, match=r"flow_backend=tensorrt: .*TensorRT"):
            check_flow_backend("tensorrt", "cuda")
        with pytest.raises(UsageError, match=r"flow_backend=tensorrt: .*TensorRT"):
            CosyVoiceEngine.check(None, EngineOptions(device="cuda", engine=CosyVoiceOptions(
                model=cosyvoice_dir, flow_backend="tensorrt")))
    if "CUDAExecutionProvider" not in available:
        with pytest.raises(UsageError, match=r"flow_backend=onnx: .*onnxruntime-gpu"):
            check_flow_backend("onnx", "cuda")
    check_flow_backend("onnx", "cpu")
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # not installed
    with pytest.raises(UsageError, match="onnxscript"):
        check_flow_backend("onnx", "cpu")
    with pytest.raises(FlowBackendError, match="onnxscript"):
        Token2Wav(cosyvoice_dir, flow_backend="onnx")


def test_unwritable_cache_is_a_clear_error(cosyvoice_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(FlowBackendError, match=r"cache folder .* is not usable"):
        Token2Wav(cosyvoice_dir, flow_backend="onnx", onnx_cache=blocker)


@pytest.mark.slow
def test_cli_run_with_flow_backend_onnx(cosyvoice_dir, xdg_cache, t2w_onnx, tmp_path):
    corpus = write_parquet(tmp_path / "corpus.parquet", [
        {"id": "a", "text": "Hello there."},
        {"id": "b", "text": "The kettle is boiling, so please bring two cups."},
    ])
    env = dict(os.environ, XDG_CACHE_HOME=str(xdg_cache))
    outputs = {}
    for backend in ("torch", "onnx"):
        out = tmp_path / backend
        proc = subprocess.run(
            [sys.executable, "-m", "cosybatch", "run", str(corpus), "--engine", "cosyvoice", "--model",
             str(cosyvoice_dir), "--speaker", "alice", "--out", str(out), "--progress", "none", "--device", "cpu",
             *(["--engine-opt", f"flow_backend={backend}"] if backend != "torch" else [])],
            capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        assert summary["items_done"] == 2 and summary["items_failed"] == 0
        outputs[backend] = read_output(out)
    # The export was made by the fixture; the run found it in XDG_CACHE_HOME (no second file).
    assert len(list((xdg_cache / "cosybatch" / "flow-onnx").glob("*.onnx"))) == 1
    for item_id, item in outputs["torch"].items():
        other = outputs["onnx"][item_id]
        assert len(other["audio"]) == len(item["audio"]) > 0
        assert np.corrcoef(other["audio"], item["audio"])[0, 1] > 0.99
    fingerprint = json.loads((tmp_path / "onnx" / ".cosybatch" / "job.json").read_text())["fingerprint"]["engine"]
    assert fingerprint["flow_backend"] == "onnx"
