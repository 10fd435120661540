"""`cosybatch doctor`: what this install offers each engine, on the CPU and on a GPU.

It reports cosybatch and Python; torch, its CUDA build and whether it sees a GPU; the GPUs with
their free and total memory; the allocator backend a run would use; which distributions hold the
`onnxruntime` module (two means the CPU and GPU builds overwrote each other's files), its version
and providers; and, for each engine, whether `--device cuda` would work here and if not why. The
checks are the ones `cosybatch run --device cuda` makes before it writes anything (cosybatch.gpu).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import sys
from typing import Optional

from . import __version__, gpu
from .errors import UsageError

GPU_INSTALL = "docs/gpu.md: GPU install"


def diagnose(device: Optional[str] = None, engine: Optional[str] = None) -> dict:
    """The report as a dict (what `--json` prints). ``device="cuda"``: ``ok`` is False, with an
    ``error``, unless every engine checked can run on CUDA here. ``engine``: check that one only;
    otherwise every installed engine whose GPU runtime (torch, onnxruntime) is installed."""
    if device not in (None, "auto", "cpu", "cuda"):
        raise UsageError(f"--device {device!r}: choose auto, cpu or cuda")
    warnings: list[str] = []
    report: dict = {
        "cosybatch": __version__,
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
    }
    report["torch"] = _torch(warnings)
    count, why = gpu.cuda_driver_devices()
    report["driver"] = {"devices": count, "problem": why}
    report["gpus"] = report["torch"].pop("gpus", None) or (_smi_gpus() if count else [])
    report["onnxruntime"] = _onnxruntime(warnings)
    report["engines"] = _engines(engine)
    _cross_checks(report, warnings)
    report["warnings"] = warnings
    problems = []
    if device == "cuda":
        checked = {name: e for name, e in report["engines"].items() if e.get("checked")}
        if not checked:
            problems.append("no engine to check: " + ("; ".join(
                f"{name}: {e.get('cuda')}" for name, e in report["engines"].items()) or "none installed"))
        problems += [f"{name}: {e['cuda']}" for name, e in checked.items() if e["cuda"] != "ok"]
    report["device"] = device
    report["ok"] = not problems
    report["exit_code"] = 0 if not problems else UsageError.exit_code
    if problems:
        report["error"] = "--device cuda: no usable CUDA here for " + "; ".join(problems)
    return report


# -- parts ------------------------------------------------------------------------------------
def _torch(warnings: list[str]) -> dict:
    """torch, its CUDA build, the GPUs it sees and the allocator backend a run would give it."""
    if importlib.util.find_spec("torch") is None:
        return {"installed": False}
    note = gpu.configure_allocator()  # as a run does, before torch is imported
    if note:
        warnings.append(note)
    try:
        import torch
    except Exception as exc:  # a broken install: say so rather than crash the report
        return {"installed": True, "error": repr(exc)}
    build = getattr(torch.version, "cuda", None)
    info: dict = {"installed": True, "version": torch.__version__, "cuda_build": build,
                  "cudnn": None, "cuda_available": False}
    conf = os.environ.get(gpu.ENV) or os.environ.get(gpu.ENV_GENERIC)
    try:
        backend = torch.cuda.get_allocator_backend() if build else None  # never initialises CUDA
    except Exception:
        backend = None
    info["allocator"] = {"backend": backend, gpu.ENV: os.environ.get(gpu.ENV),
                         gpu.ENV_GENERIC: os.environ.get(gpu.ENV_GENERIC)}
    if build and conf and backend and backend != "cudaMallocAsync":
        warnings.append(f"torch's allocator backend is {backend}, not cudaMallocAsync: the pre-allocated pool "
                        "assumes cudaMallocAsync (docs/gpu.md: Memory)")
    if not build:
        return info
    with contextlib.suppress(Exception):
        info["cudnn"] = torch.backends.cudnn.version()
    info["cuda_available"] = bool(torch.cuda.is_available())
    if info["cuda_available"]:
        gpus = []
        for index in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(index)
            major, minor = torch.cuda.get_device_capability(index)
            gpus.append({"index": index, "name": torch.cuda.get_device_name(index), "free_bytes": int(free),
                         "total_bytes": int(total), "capability": f"{major}.{minor}"})
        info["gpus"] = gpus
    return info


def _smi_gpus() -> list[dict]:
    """GPUs as nvidia-smi lists them (when torch has no CUDA): name, free and total memory."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index,name,memory.free,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            gpus.append({"index": int(parts[0]), "name": parts[1], "free_bytes": int(float(parts[2])) << 20,
                         "total_bytes": int(float(parts[3])) << 20})
        except (IndexError, ValueError):
            continue
    return gpus


def _onnxruntime(warnings: list[str]) -> dict:
    """Which distributions hold the onnxruntime module, its version, build and providers."""
    from importlib.metadata import PackageNotFoundError, version

    holders = gpu.onnxruntime_distributions()
    info: dict = {"distributions": [{"name": n, "version": v} for n, v in holders]}
    names = {n.lower() for n, _ in holders}
    try:
        plain = version("onnxruntime")
    except PackageNotFoundError:
        plain = None
    if plain is not None and "onnxruntime" not in names:
        # A distribution named onnxruntime with no files of the module: cosybatch's gpu/onnxruntime,
        # which satisfies piper-tts's requirement with onnxruntime-gpu.
        info["alias"] = {"name": "onnxruntime", "version": plain}
    if len(holders) > 1:
        shown = ", ".join(f"{n} {v}" for n, v in holders)
        warnings.append(f"two builds of the onnxruntime module are installed over each other ({shown}): whichever "
                        f"was installed last owns the files, and the next install of either changes it. Keep one "
                        f"({GPU_INSTALL} says how)")
    if importlib.util.find_spec("onnxruntime") is None:
        info["installed"] = False
        return info
    try:
        import onnxruntime as ort
    except Exception as exc:
        info.update(installed=True, error=repr(exc))
        return info
    info.update(installed=True, version=ort.__version__, module=os.path.dirname(ort.__file__),
                providers=list(ort.get_available_providers()))
    try:
        from onnxruntime.capi import build_and_package_info as build

        info["cuda_build"] = getattr(build, "cuda_version", None) or None
    except ImportError:
        info["cuda_build"] = None
    if gpu.ORT_CUDA in info["providers"]:
        info["cuda_libraries"] = gpu.ort_cuda_library_problem(ort) or "ok"
    return info


def _runtime_of(cls) -> Optional[str]:
    return cls.gpu_runtime or ("torch" if cls.needs_torch_allocator else None)


def _engines(only: Optional[str]) -> dict:
    """For each engine: what runs it on a GPU and whether --device cuda would work here."""
    from .engines import engine_class, engine_names

    names = [only] if only else engine_names()
    found: dict = {}
    cache: dict = {}
    for name in names:
        try:
            cls = engine_class(name)  # an unknown --engine is a usage error, raised here
        except UsageError:
            if only:
                raise
            found[name] = {"checked": False, "cuda": "the engine does not import"}
            continue
        runtime = _runtime_of(cls)
        module = {"torch": "torch", "onnxruntime": "onnxruntime"}.get(runtime or "")
        if not only and module and importlib.util.find_spec(module) is None:
            found[name] = {"gpu_runtime": runtime, "checked": False, "cuda": f"{module} is not installed"}
            continue
        if runtime not in cache:
            cache[runtime] = gpu.cuda_problem(runtime)
        found[name] = {"gpu_runtime": runtime, "checked": True, "cuda": cache[runtime] or "ok"}
    return found


def _cross_checks(report: dict, warnings: list[str]) -> None:
    torch, ort = report["torch"], report["onnxruntime"]
    if torch.get("cuda_available") and gpu.ORT_CUDA not in (ort.get("providers") or []):
        warnings.append("torch can use the GPU but onnxruntime cannot: the Piper engine and CosyVoice's speech "
                        f"tokenizer would run on the CPU ({GPU_INSTALL})")
    major = (torch.get("cuda_build") or "").split(".")[0]
    ort_major = (ort.get("cuda_build") or "").split(".")[0]
    if major and ort_major and major != ort_major:
        warnings.append(f"torch is built for CUDA {torch['cuda_build']} and onnxruntime for CUDA {ort['cuda_build']}: "
                        "both CUDA runtimes must be installed; pick an onnxruntime-gpu of torch's CUDA major version")


# -- text ---------------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def describe(report: dict) -> str:
    """The report as lines of text."""
    py = report["python"]
    lines = [f"cosybatch {report['cosybatch']}, Python {py['version']} ({py['executable']}), {report['platform']}"]
    torch = report["torch"]
    if not torch.get("installed"):
        lines.append("torch: not installed (the CosyVoice engine needs it: pip install 'cosybatch[cosyvoice]')")
    elif "error" in torch:
        lines.append(f"torch: does not import: {torch['error']}")
    else:
        build = f"CUDA {torch['cuda_build']} build" if torch["cuda_build"] else "CPU-only build"
        seen = ("sees the GPU" if torch["cuda_available"] else "sees no GPU") if torch["cuda_build"] else ""
        cudnn = torch.get("cudnn")
        if isinstance(cudnn, int):  # 92000 is 9.20.0
            cudnn = f"{cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}"
        lines.append(f"torch {torch['version']}: {build}" + (f", cuDNN {cudnn}" if cudnn else "")
                     + (f", {seen}" if seen else ""))
        alloc = torch.get("allocator") or {}
        conf = alloc.get(gpu.ENV) or alloc.get(gpu.ENV_GENERIC) or "unset"
        backend = alloc.get("backend") or "none (no CUDA allocator in this build)"
        lines.append(f"  allocator backend: {backend} ({gpu.ENV}={conf})")
    driver = report["driver"]
    lines.append(f"NVIDIA driver: {driver['devices']} GPU(s)" if driver["devices"]
                 else f"NVIDIA driver: {driver['problem']}")
    for g in report["gpus"]:
        lines.append(f"  GPU {g['index']}: {g['name']}, {_gib(g['free_bytes'])} free of {_gib(g['total_bytes'])}")
    ort = report["onnxruntime"]
    holders = ", ".join(f"{d['name']} {d['version']}" for d in ort["distributions"]) or "no distribution found"
    if not ort.get("installed"):
        lines.append(f"onnxruntime: not installed ({holders})")
    elif "error" in ort:
        lines.append(f"onnxruntime: does not import ({holders}): {ort['error']}")
    else:
        # The module's version, then the package(s) holding its files: "onnxruntime 1.32.0, installed as
        # onnxruntime-gpu"; only where they differ (two builds over each other) are their versions shown.
        dists = ort["distributions"]
        if len(dists) == 1 and dists[0]["version"] == ort["version"]:
            source = f"installed as {dists[0]['name']}"
        else:
            source = f"its files from {holders}"
        lines.append(f"onnxruntime {ort['version']}, {source}"
                     + (f" (CUDA {ort['cuda_build']} build)" if ort.get("cuda_build") else "")
                     + f": {', '.join(ort['providers'])}")
        if ort.get("alias"):
            lines.append(f"  onnxruntime {ort['alias']['version']} is an alias with no files ({GPU_INSTALL})")
        if ort.get("cuda_libraries"):
            lines.append(f"  CUDA provider libraries: {ort['cuda_libraries']}")
    lines.append("--device cuda, by engine:")
    for name, e in report["engines"].items():
        runtime = e.get("gpu_runtime") or "a GPU"
        mark = "ok" if e["cuda"] == "ok" else ("not checked: " if not e.get("checked") else "no: ") + e["cuda"]
        lines.append(f"  {name} ({runtime}): {mark}")
    for w in report["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
