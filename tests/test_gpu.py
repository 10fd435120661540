"""cosybatch.gpu on a CPU-only machine: the allocator setting, validation, budgets, OOM detection."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT

from cosybatch import gpu
from cosybatch.errors import UsageError

# Installed as sitecustomize.py in a child: records PYTORCH_CUDA_ALLOC_CONF at the moment anything
# first tries to import torch (before torch's shared libraries load and pick the allocator backend).
SPY = textwrap.dedent(
    """
    import os
    import sys

    _OUT = os.environ["COSYBATCH_TORCH_ENV_FILE"]


    class _TorchImportSpy:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" and not os.path.exists(_OUT):
                with open(_OUT, "w", encoding="utf-8") as f:
                    f.write(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "<unset>"))
            return None


    sys.meta_path.insert(0, _TorchImportSpy())
    """
)

CHILD = textwrap.dedent(
    """
    import json
    import sys

    import cosybatch.gpu as gpu

    torch_before = "torch" in sys.modules
    note = gpu.configure_allocator()
    import torch

    print(json.dumps({"torch_before": torch_before, "note": note, "cuda_init": torch.cuda.is_initialized()}))
    """
)


def run_child(tmp_path: Path, env_value: str | None) -> tuple[dict, str]:
    """Run CHILD with the spy installed; return its JSON line and what the spy saw at ``import torch``."""
    (tmp_path / "sitecustomize.py").write_text(SPY, encoding="utf-8")
    seen = tmp_path / "alloc_conf_at_torch_import.txt"
    env = {k: v for k, v in os.environ.items() if k not in (gpu.ENV, gpu.ENV_GENERIC)}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["COSYBATCH_TORCH_ENV_FILE"] = str(seen)
    if env_value is not None:
        env[gpu.ENV] = env_value
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert seen.exists(), "the sitecustomize spy never saw torch being imported"
    return json.loads(proc.stdout.strip().splitlines()[-1]), seen.read_text(encoding="utf-8")


# -- configure_allocator ----------------------------------------------------------------------
def clear_alloc_env(monkeypatch) -> None:
    """Unset both variables so that monkeypatch also undoes what the test's code sets."""
    for name in (gpu.ENV, gpu.ENV_GENERIC):
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)


@pytest.mark.slow
def test_allocator_set_before_torch_is_imported(tmp_path):
    result, seen = run_child(tmp_path, None)
    assert result["torch_before"] is False  # importing cosybatch.gpu does not import torch
    assert result["note"] is None
    assert seen == gpu.ALLOC_CONF == "backend:cudaMallocAsync"
    assert result["cuda_init"] is False


@pytest.mark.slow
def test_user_allocator_setting_is_kept(tmp_path):
    result, seen = run_child(tmp_path, "expandable_segments:True")
    assert seen == "expandable_segments:True"
    note = result["note"]
    assert "expandable_segments:True" in note and "cudaMallocAsync" in note and "kept" in note
    assert "\n" not in note


def test_configure_allocator_on_a_dict():
    env: dict[str, str] = {}
    assert gpu.configure_allocator(env) is None
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}

    env = {"PYTORCH_CUDA_ALLOC_CONF": ""}  # empty counts as unset
    assert gpu.configure_allocator(env) is None
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"

    for value in ("backend:cudaMallocAsync", " backend : cudaMallocAsync , release_lock_on_cudamalloc:True"):
        env = {"PYTORCH_CUDA_ALLOC_CONF": value}
        assert gpu.configure_allocator(env) is None
        assert env == {"PYTORCH_CUDA_ALLOC_CONF": value}

    env = {"PYTORCH_CUDA_ALLOC_CONF": "backend:native,expandable_segments:True"}
    note = gpu.configure_allocator(env)
    assert note is not None and "backend:native,expandable_segments:True" in note
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "backend:native,expandable_segments:True"}

    # torch reads PYTORCH_ALLOC_CONF only when PYTORCH_CUDA_ALLOC_CONF is unset: setting ours would
    # override the user's, so theirs is kept.
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    note = gpu.configure_allocator(env)
    assert note is not None and "PYTORCH_ALLOC_CONF=expandable_segments:True" in note
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert gpu.configure_allocator({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}) is None


def test_configure_allocator_too_late_once_a_cuda_torch_is_imported(monkeypatch):
    import torch

    clear_alloc_env(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # pretend to be a CUDA build
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    note = gpu.configure_allocator()
    assert note is not None and "next process" in note and "native" in note
    assert gpu.ENV not in os.environ  # nothing changed

    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert gpu.configure_allocator() is None


def test_configure_allocator_with_cpu_torch_sets_the_environment(monkeypatch):
    import torch

    assert torch.version.cuda is None  # this machine's CPU build: no CUDA allocator to be late for
    clear_alloc_env(monkeypatch)
    assert gpu.configure_allocator() is None
    assert os.environ[gpu.ENV] == gpu.ALLOC_CONF


# -- validate_fraction ------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5, math.nan, math.inf, "abc", None, True])
def test_validate_fraction_rejects(value):
    with pytest.raises(UsageError, match="--memory-fraction"):
        gpu.validate_fraction(value)


@pytest.mark.parametrize("value", [0.3, 1.0, 1, "0.5"])
def test_validate_fraction_accepts(value):
    assert gpu.validate_fraction(value) == float(value)


# -- budget_from_probe --------------------------------------------------------------------------
def test_budget_from_probe_worst_stage_and_safety():
    per_unit = {"lm": 1000.0, "flow": 4000.0, "hift": 2500.0}
    # floor(0.8 * 10_000_000 / 4000) = 2000: the flow decides
    assert gpu.budget_from_probe(per_unit, 10_000_000) == 2000
    assert gpu.budget_from_probe(per_unit, 10_000_000, safety=0.5) == 1250
    assert gpu.budget_from_probe(per_unit, 10_000_000, safety=1.0) == 2500
    assert gpu.budget_from_probe({"lm": 3.0}, 10) == 2  # floor(8 / 3)


def test_budget_from_probe_floor():
    assert gpu.budget_from_probe({"flow": 1e9}, 1000) == 1
    assert gpu.budget_from_probe({"flow": 1e9}, 0, floor=4) == 4
    assert gpu.budget_from_probe({"flow": 1e9}, 1000, floor=0) == 0


@pytest.mark.parametrize(
    ("per_unit", "pool", "safety"),
    [
        ({}, 100, 0.8),
        ({"lm": 0.0}, 100, 0.8),
        ({"lm": -1.0, "flow": 5.0}, 100, 0.8),
        ({"lm": math.nan}, 100, 0.8),
        ({"lm": math.inf}, 100, 0.8),
        ({"lm": 1.0}, -1, 0.8),
        ({"lm": 1.0}, 100, 0.0),
        ({"lm": 1.0}, 100, 1.5),
    ],
)
def test_budget_from_probe_rejects(per_unit, pool, safety):
    with pytest.raises(ValueError):
        gpu.budget_from_probe(per_unit, pool, safety=safety)


# -- is_oom -----------------------------------------------------------------------------------
def test_is_oom():
    import torch

    assert gpu.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert gpu.is_oom(torch.cuda.OutOfMemoryError(""))  # by type, whatever the message
    assert gpu.is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert gpu.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert gpu.is_oom(RuntimeError(
        "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running Conv node. "
        "Name:'/conv/Conv' Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:376 "
        "void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*, bool, "
        "onnxruntime::WaitNotificationFn) Failed to allocate memory for requested buffer of size 123"
    ))
    assert gpu.is_oom(RuntimeError("BFCArena::AllocateRawInternal: Available memory of 0 is smaller than requested"))
    assert gpu.is_oom(RuntimeError("CUDA failure 2: out of memory ; GPU=0"))
    try:
        try:
            raise torch.cuda.OutOfMemoryError("")
        except torch.cuda.OutOfMemoryError as inner:
            raise RuntimeError("batch 7 failed") from inner
    except RuntimeError as outer:
        assert gpu.is_oom(outer)

    assert not gpu.is_oom(ValueError("bad input"))
    assert not gpu.is_oom(RuntimeError("CUDA error: device-side assert triggered"))
    assert not gpu.is_oom(MemoryError())  # host memory, not the GPU's


def test_is_oom_without_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")
    assert gpu.is_oom(RuntimeError("CUDA out of memory"))
    assert not gpu.is_oom(ValueError("bad input"))


# -- memory_stats, setup_pool, probe_stage, ort options on CPU ----------------------------------
def test_memory_stats_is_empty_on_cpu_and_initialises_nothing(monkeypatch):
    import torch

    assert gpu.memory_stats() == {}
    assert gpu.memory_stats("cuda:0") == {}
    assert not torch.cuda.is_initialized()
    monkeypatch.delitem(sys.modules, "torch")
    assert gpu.memory_stats() == {}


def test_setup_pool_and_probe_refuse_cpu():
    import torch

    with pytest.raises(ValueError):
        gpu.setup_pool(0.5)  # "cuda", but there is none here
    with pytest.raises(ValueError):
        gpu.setup_pool(0.5, "cpu")
    with pytest.raises(ValueError):
        gpu.probe_stage(lambda: None, 10, "cpu")
    with pytest.raises(ValueError):
        gpu.probe_stage(lambda: None, 0, "cuda")
    with pytest.raises(UsageError, match="--memory-fraction"):
        gpu.setup_pool(1.5)
    assert not torch.cuda.is_initialized()


def test_ort_cuda_options():
    assert gpu.ort_cuda_options(None) == {"arena_extend_strategy": "kSameAsRequested",
                                          "cudnn_conv_algo_search": "HEURISTIC"}
    assert gpu.ort_cuda_options(2 << 30)["gpu_mem_limit"] == str(2 << 30)
    with pytest.raises(ValueError):
        gpu.ort_cuda_options(0)


class FakeCuda:
    """Just enough of torch.cuda to run setup_pool's arithmetic on a CPU: a GPU of ``total`` bytes
    whose allocations above ``fits`` fail with torch's OOM error."""

    def __init__(self, torch, monkeypatch, backend: str, total: int, allocated: int, fits: int):
        self.calls: list[tuple] = []
        self.sizes: list[int] = []
        self.fits = fits
        cuda = torch.cuda
        for name, fn in {
            "is_available": lambda: True,
            "current_device": lambda: 0,
            "get_allocator_backend": lambda: backend,
            "set_per_process_memory_fraction": lambda f, d=None: self.calls.append(("fraction", f, str(d))),
            "mem_get_info": lambda d=None: (total - allocated, total),
            "memory_allocated": lambda d=None: allocated,
            "memory_reserved": lambda d=None: allocated + (self.sizes[-1] if self.sizes else 0),
            "synchronize": lambda d=None: self.calls.append(("sync",)),
        }.items():
            monkeypatch.setattr(cuda, name, fn)
        real_empty = torch.empty

        def empty(size, dtype=None, device=None):
            if str(device) != "cuda:0":
                return real_empty(size, dtype=dtype, device=device)
            if size > self.fits:
                raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} bytes")
            self.sizes.append(size)
            return object()

        monkeypatch.setattr(torch, "empty", empty)


def test_setup_pool_arithmetic_and_halving_with_a_fake_gpu(monkeypatch):
    import torch

    gib = 1 << 30
    fake = FakeCuda(torch, monkeypatch, "native", total=80 * gib, allocated=4 * gib, fits=30 * gib)
    info = gpu.setup_pool(0.5, headroom_bytes=gib)
    assert ("fraction", 0.5, "cuda:0") in fake.calls
    assert (info.total_bytes, info.cap_bytes, info.model_bytes) == (80 * gib, 40 * gib, 4 * gib)
    assert info.pool_bytes == 35 * gib // 2  # 40 - 4 - 1 = 35 GiB did not fit, half of it did
    assert fake.sizes == [info.pool_bytes]
    assert info.backend == "native" and info.reserved_bytes == 4 * gib + info.pool_bytes
    assert any("halved" in note for note in info.notes)

    fake.fits = 0  # nothing fits: halve down to 0 and carry on
    assert gpu.setup_pool(0.5, "cuda:0", headroom_bytes=gib).pool_bytes == 0

    fake.fits = 1 << 62
    info = gpu.setup_pool(0.06, headroom_bytes=gib)  # the cap is below models + headroom: no pool
    assert info.pool_bytes == 0


def test_setup_pool_async_backend_falls_back_when_the_pool_is_unreachable(monkeypatch):
    import torch

    gib = 1 << 30
    monkeypatch.setattr(gpu, "_loaded", lambda fragment: ["/nonexistent/libcudart.so.12"])
    real_cdll = gpu.ctypes.CDLL

    def no_cuda(name, *a, **k):
        if "cuda" in str(name):
            raise OSError(f"{name}: cannot open shared object file")
        return real_cdll(name, *a, **k)

    monkeypatch.setattr(gpu.ctypes, "CDLL", no_cuda)
    FakeCuda(torch, monkeypatch, "cudaMallocAsync", total=16 * gib, allocated=gib, fits=1 << 62)
    info = gpu.setup_pool(0.9, headroom_bytes=0)
    assert info.backend == "cudaMallocAsync"
    assert info.pool_bytes == int(0.9 * 16 * gib) - gib
    assert any("release threshold" in note for note in info.notes)


def test_probe_stage_with_a_fake_gpu(monkeypatch):
    import torch

    events: list[str] = []
    state = {"allocated": 1000, "peak": 1000}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: events.append("sync"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: state["peak"])

    def reset(d=None):
        events.append("reset")
        state["peak"] = state["allocated"]

    def stage():
        events.append("fn")
        state["peak"] = 5000  # the stage peaked 4000 bytes above where it started

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    assert gpu.probe_stage(stage, 8, "cuda") == 500.0
    assert events == ["sync", "reset", "fn", "sync"]


def test_device_total_bytes_reads_nvidia_smi_without_starting_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu.device_total_bytes() is None  # no nvidia-smi: no cap, never a crash
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 143771\n")
    smi.chmod(0o755)
    assert gpu.device_total_bytes() == 143771 << 20
    assert gpu.ort_cuda_options(int(gpu.device_total_bytes() * 0.5))["gpu_mem_limit"] == str((143771 << 20) // 2)
