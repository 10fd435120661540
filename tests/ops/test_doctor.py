"""`cosybatch doctor`, `run --check --device cuda`, and failed starts that leave no folder behind
(issue 14, point 6). The no-GPU path runs for real on this machine; a GPU's presence is faked."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers import ROOT, cli, last_json

from cosybatch import doctor, gpu
from cosybatch.config import RunConfig
from cosybatch.errors import EXIT_USAGE, UsageError
from cosybatch.run import folder as folder_module
from cosybatch.run import preflight

CORPUS = ROOT / "examples" / "corpus.jsonl"
HAS_GPU = gpu.cuda_driver_devices()[0] > 0
no_gpu_only = pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")


# -- cosybatch doctor ---------------------------------------------------------------------------
@pytest.mark.slow
def test_doctor_reports_the_install():
    proc = cli("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = last_json(proc)
    assert report["cosybatch"] and report["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    import onnxruntime

    ort = report["onnxruntime"]
    assert ort["version"] == onnxruntime.__version__
    assert ort["providers"] == onnxruntime.get_available_providers()
    assert [d["name"] for d in ort["distributions"]] == [n for n, _ in gpu.onnxruntime_distributions()]
    assert report["torch"]["installed"] and "allocator" in report["torch"]
    assert set(report["engines"]) >= {"piper", "cosyvoice"}
    assert report["engines"]["piper"]["gpu_runtime"] == "onnxruntime"
    assert report["engines"]["cosyvoice"]["gpu_runtime"] == "torch"
    text = cli("doctor")
    assert text.returncode == 0
    for needle in ("cosybatch ", "torch ", "allocator backend", "NVIDIA driver", "onnxruntime ", "piper (onnxruntime)"):
        assert needle in text.stdout


@pytest.mark.slow
@no_gpu_only
def test_doctor_device_cuda_fails_without_a_gpu():
    proc = cli("doctor", "--device", "cuda")
    assert proc.returncode == EXIT_USAGE
    assert "no usable CUDA" in proc.stderr and "piper" in proc.stderr
    assert last_json(proc)["status"] == "error"
    as_json = cli("doctor", "--device", "cuda", "--engine", "piper", "--json")
    assert as_json.returncode == EXIT_USAGE
    report = last_json(as_json)
    assert report["ok"] is False and report["exit_code"] == EXIT_USAGE and "piper" in report["error"]
    assert list(report["engines"]) == ["piper"]


@pytest.mark.slow
def test_doctor_unknown_engine_is_a_usage_error():
    proc = cli("doctor", "--engine", "nope")
    assert proc.returncode == EXIT_USAGE and "unknown engine" in proc.stderr


def test_doctor_passes_when_cuda_is_usable(monkeypatch):
    monkeypatch.setattr(gpu, "cuda_problem", lambda runtime: None)
    report = doctor.diagnose(device="cuda", engine="piper")
    assert report["ok"] and report["exit_code"] == 0 and report["engines"]["piper"]["cuda"] == "ok"


def test_doctor_warns_about_two_onnxruntime_builds(monkeypatch):
    both = [("onnxruntime", "1.32.0"), ("onnxruntime-gpu", "1.31.1")]
    monkeypatch.setattr(gpu, "onnxruntime_distributions", lambda: both)
    report = doctor.diagnose()
    assert [d["name"] for d in report["onnxruntime"]["distributions"]] == ["onnxruntime", "onnxruntime-gpu"]
    assert any("two builds of the onnxruntime module" in w for w in report["warnings"])
    assert "warning: two builds" in doctor.describe(report)


def test_doctor_names_the_alias_of_the_gpu_install(monkeypatch):
    """gpu/onnxruntime: a distribution named onnxruntime that holds none of the module's files."""
    monkeypatch.setattr(gpu, "onnxruntime_distributions", lambda: [("onnxruntime-gpu", "1.31.1")])
    report = doctor.diagnose()
    assert report["onnxruntime"]["alias"]["name"] == "onnxruntime"
    assert not report["warnings"] or not any("two builds" in w for w in report["warnings"])


def test_onnxruntime_distributions_are_read_from_the_installed_files():
    from importlib.metadata import version

    import onnxruntime

    found = dict(gpu.onnxruntime_distributions())
    assert onnxruntime.__version__ in found.values()
    assert all(version(name) == v for name, v in found.items())


# -- the generic CUDA checks --------------------------------------------------------------------
@no_gpu_only
def test_cuda_helpers_on_this_machine():
    count, why = gpu.cuda_driver_devices()
    assert count == 0 and why
    assert gpu.cuda_problem(None) == why
    assert gpu.ort_cuda_problem()  # the CPU build here, or no driver
    assert gpu.torch_cuda_problem()


def test_cuda_driver_devices_reads_libcuda(monkeypatch):
    class FakeFn:
        def __init__(self, fn):
            self.fn, self.restype = fn, None

        def __call__(self, *args):
            return self.fn(*args)

    class FakeCuda:
        def __init__(self, init_rc, count):
            self.cuInit = FakeFn(lambda flags: init_rc)
            self.cuDeviceGetCount = FakeFn(lambda ref: (setattr(ref._obj, "value", count), 0)[1])
            self.cuGetErrorName = FakeFn(lambda rc, ref: 1)

    for lib, expected in ((FakeCuda(0, 2), (2, None)), (FakeCuda(0, 0), 0), (FakeCuda(100, 0), 0)):
        monkeypatch.setattr(gpu.ctypes, "CDLL", lambda name, lib=lib: lib)
        count, why = gpu.cuda_driver_devices()
        if isinstance(expected, tuple):
            assert (count, why) == expected
        else:
            assert count == 0 and "sees no GPU" in why


def test_torch_cuda_problem_follows_torch(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu.torch_cuda_problem() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees no usable GPU" in gpu.torch_cuda_problem()
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only build" in gpu.torch_cuda_problem()


def test_ort_cuda_problem_needs_the_provider_and_a_gpu(monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert "has no CUDA provider" in gpu.ort_cuda_problem()
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: [gpu.ORT_CUDA, "CPUExecutionProvider"])
    monkeypatch.setattr(gpu, "cuda_driver_devices", lambda: (0, "no NVIDIA driver here"))
    assert gpu.ort_cuda_problem() == "no NVIDIA driver here"
    monkeypatch.setattr(gpu, "cuda_driver_devices", lambda: (1, None))
    monkeypatch.setattr(gpu, "ort_cuda_library_problem", lambda ort: None)
    assert gpu.ort_cuda_problem() is None


# -- run --check --device cuda fails as the run does ----------------------------------------
@pytest.mark.slow
@no_gpu_only
def test_check_device_cuda_fails_like_the_run(tmp_path):
    out = tmp_path / "out"
    check = cli("run", str(CORPUS), "--out", str(out), "--device", "cuda", "--check")
    assert check.returncode == EXIT_USAGE, check.stdout + check.stderr
    assert "--device cuda" in check.stderr and "no usable CUDA GPU for the piper engine" in check.stderr
    real = cli("run", str(CORPUS), "--out", str(out), "--device", "cuda", "--progress", "none")
    assert real.returncode == EXIT_USAGE
    assert last_json(real)["error"] == last_json(check)["error"]
    assert not out.exists()  # nothing written: `status` has no half-made job to call "not started"
    status = cli("status", str(out))
    assert status.returncode == EXIT_USAGE and "holds no cosybatch job" in status.stderr


def cfg_for(tmp_path: Path, **kw) -> RunConfig:
    return RunConfig.from_options(corpus=CORPUS, out=tmp_path / "out", **kw)


def test_check_passes_the_device_when_cuda_is_usable(tmp_path, monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: [gpu.ORT_CUDA, "CPUExecutionProvider"])
    monkeypatch.setattr(gpu, "cuda_driver_devices", lambda: (1, None))
    monkeypatch.setattr(gpu, "ort_cuda_library_problem", lambda ort: None)
    assert preflight.check(cfg_for(tmp_path, device="cuda"))["voice"] == "en_US-joe-medium"
    monkeypatch.setattr(gpu, "cuda_driver_devices", lambda: (0, "the NVIDIA driver sees no GPU"))
    with pytest.raises(UsageError, match="sees no GPU"):
        preflight.check(cfg_for(tmp_path, device="cuda"))


def test_check_uses_torch_for_torch_engines(tmp_path, monkeypatch, cosyvoice_dir):
    import torch

    monkeypatch.delenv(gpu.ENV, raising=False)  # restored afterwards: the check sets it as a run does
    opts = {"model": str(cosyvoice_dir), "speaker": "alice"}
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert preflight.check(cfg_for(tmp_path, device="cuda", engine="cosyvoice", engine_options=opts))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="no usable CUDA GPU for the cosyvoice engine"):
        preflight.check(cfg_for(tmp_path, device="cuda", engine="cosyvoice", engine_options=opts))
    assert preflight.check(cfg_for(tmp_path, device="cpu", engine="cosyvoice", engine_options=opts))


# -- a failed start leaves no half-made folder -------------------------------------------------
@pytest.mark.slow
def test_a_bad_model_leaves_no_folder(tmp_path):
    out = tmp_path / "deep" / "out"
    proc = cli("run", str(CORPUS), "--engine", "cosyvoice", "--model", str(tmp_path / "missing"), "--out", str(out))
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert not (tmp_path / "deep").exists()


@pytest.mark.slow
def test_a_voice_that_fails_to_load_leaves_no_folder(tmp_path):
    from cosybatch.engines.piper.voice import bundled_voice

    _, config = bundled_voice()
    (tmp_path / "broken.onnx").write_bytes(b"not an onnx model")
    (tmp_path / "broken.onnx.json").write_text(config.read_text())
    out = tmp_path / "new" / "out"
    proc = cli("run", str(CORPUS), "--voice", str(tmp_path / "broken.onnx"), "--out", str(out), "--progress", "none")
    assert proc.returncode != 0
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_a_failed_start_keeps_a_folder_that_existed(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    proc = cli("run", str(tmp_path / "no-such-corpus.jsonl"), "--out", str(out))
    assert proc.returncode != 0
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # no .cosybatch left behind
    empty = tmp_path / "empty"
    empty.mkdir()
    cli("run", str(tmp_path / "no-such-corpus.jsonl"), "--out", str(empty))
    assert empty.is_dir() and not any(empty.iterdir())


@pytest.mark.slow
def test_a_failed_start_of_a_sharded_worker_leaves_no_folder(tmp_path):
    out = tmp_path / "sharded"
    proc = cli("run", str(tmp_path / "no-such-corpus.jsonl"), "--out", str(out), "--shard", "0/2")
    assert proc.returncode != 0
    assert not out.exists()


@pytest.mark.slow
def test_a_started_job_is_never_removed(tmp_path, monkeypatch):
    """Once job.json is written the folder is the job's, whatever happens next."""
    out = tmp_path / "out"
    done = cli("run", str(CORPUS), "--out", str(out), "--limit", "2", "--progress", "none")
    assert done.returncode == 0, done.stderr
    again = cli("run", str(CORPUS), "--out", str(out), "--limit", "2", "--seed", "7", "--progress", "none")
    assert again.returncode == EXIT_USAGE  # other settings: refused
    assert (out / ".cosybatch" / "job.json").is_file() and list(out.glob("shard-*.tar"))


def test_unstarted_cleanup_removes_only_what_it_created(tmp_path):
    from cosybatch.store.checkpoint import OutputDir

    parent = tmp_path / "a"
    out = parent / "b" / "c"
    created = folder_module._missing_folders(out)
    assert created == [out, out.parent, parent]
    os.makedirs(out)
    folder = OutputDir(out)
    folder.lock()
    (parent / "other.txt").write_text("someone else's")
    folder_module._remove_unstarted(folder, created, state_existed=False)
    folder.unlock()
    assert not (parent / "b").exists() and (parent / "other.txt").exists()  # a is not empty: kept


def test_piper_auto_device_takes_the_gpu_only_when_the_driver_shows_one(monkeypatch):
    from types import SimpleNamespace

    from cosybatch.engines.piper import engine as piper

    fake_ort = SimpleNamespace(get_available_providers=lambda: [gpu.ORT_CUDA, "CPUExecutionProvider"])
    monkeypatch.setattr(gpu, "device_total_bytes", lambda index=0: None)
    monkeypatch.setattr(gpu, "cuda_driver_devices", lambda: (0, "no NVIDIA driver here"))
    assert piper._providers(fake_ort, "auto") == ["CPUExecutionProvider"]  # a GPU build on a CPU machine
    monkeypatch.setattr(gpu, "cuda_driver_devices", lambda: (1, None))
    assert piper._providers(fake_ort, "auto")[0][0] == gpu.ORT_CUDA
    assert piper._providers(fake_ort, "cpu") == ["CPUExecutionProvider"]
    cpu_ort = SimpleNamespace(get_available_providers=lambda: ["CPUExecutionProvider"])
    with pytest.raises(UsageError, match="GPU install"):
        piper._providers(cpu_ort, "cuda")


def test_the_gpu_install_files_agree():
    """gpu/onnxruntime (the alias) and gpu/constraints.txt name the same onnxruntime-gpu (docs/gpu.md)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    alias = tomllib.loads((ROOT / "gpu" / "onnxruntime" / "pyproject.toml").read_text())
    project = alias["project"]
    assert project["name"] == "onnxruntime" and alias["tool"]["hatch"]["build"]["targets"]["wheel"]["bypass-selection"]
    version = project["version"]
    assert version.endswith("+gpu")
    assert project["dependencies"] == [f"onnxruntime-gpu[cuda,cudnn]=={version.removesuffix('+gpu')}"]
    pins = [line.strip() for line in (ROOT / "gpu" / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert pins == [f"onnxruntime=={version}"]
    readme = (ROOT / "README.md").read_text()
    assert "pip install ./gpu/onnxruntime" in readme and f"onnxruntime-gpu=={version.removesuffix('+gpu')}" in readme


# -- --version ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_version_needs_no_command():
    from cosybatch import __version__

    proc = cli("--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, __version__), proc.stderr
