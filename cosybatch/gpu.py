"""GPU memory: the allocator backend, a memory-fraction cap, a pre-allocated pool, OOM detection.

Importing this module never imports torch (the CLI stays fast); every function that needs torch
imports it itself, and the read-only helpers (``memory_stats``, ``is_oom``) only look at a torch
that is already in ``sys.modules``.

Order in a run:

1. :func:`configure_allocator` before anything imports torch. In torch 2.13 the CUDA allocator
   backend is picked by a static initialiser of ``libc10_cuda`` when ``import torch`` loads it,
   not when CUDA initialises: setting ``PYTORCH_CUDA_ALLOC_CONF`` after ``import torch`` has no
   effect on the backend.
2. Load the models onto the GPU.
3. :func:`setup_pool` caps the process at ``fraction`` of the GPU and reserves what is left under
   the cap (minus a headroom) in torch's allocator, so batches never go back to the driver.
4. :func:`is_oom` tells an out-of-memory failure (torch, cuDNN, cuBLAS, onnxruntime) from others,
   so a caller can split the batch instead of dying; :func:`memory_stats` feeds stats.json.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import UsageError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("cosybatch")

ALLOC_CONF = "backend:cudaMallocAsync"
ENV = "PYTORCH_CUDA_ALLOC_CONF"
# torch >= 2.9 also reads this generic name, but only when PYTORCH_CUDA_ALLOC_CONF is unset: setting
# ours would silently override a user's PYTORCH_ALLOC_CONF, so a value there counts as the user's.
ENV_GENERIC = "PYTORCH_ALLOC_CONF"

_UINT64_MAX = (1 << 64) - 1
_RELEASE_THRESHOLD = 4  # cudaMemPoolAttrReleaseThreshold == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
_MIN_POOL = 1 << 20  # below this, halving on OOM gives up and reserves nothing

_OOM_MARKERS = (
    "out of memory",  # torch ("CUDA out of memory"), the CUDA runtime ("cudaErrorMemoryAllocation: out of memory")
    "out_of_memory",  # CUDA_ERROR_OUT_OF_MEMORY (driver API, onnxruntime's CUDA_CALL messages)
    "cudaerrormemoryallocation",
    "cudnn_status_alloc_failed",
    "cublas_status_alloc_failed",
    "failed to allocate memory",  # onnxruntime BFCArena: "Failed to allocate memory for requested buffer of size N"
)


# -- allocator backend ------------------------------------------------------------------------
def _backend_in(conf: str) -> str | None:
    """The backend a PYTORCH_*ALLOC_CONF value selects (the last ``backend:`` wins), else None."""
    found = None
    for match in re.finditer(r"(?:^|[\s,])backend\s*:\s*([A-Za-z_]+)", conf):
        found = match.group(1)
    return found


def _too_late_note() -> str | None:
    """A note when torch (a CUDA or ROCm build) is already imported with another backend, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    version = getattr(torch, "version", None)
    if not (getattr(version, "cuda", None) or getattr(version, "hip", None)):
        return None  # a CPU-only build has no CUDA allocator: the setting is harmless and moot
    try:
        backend = torch.cuda.get_allocator_backend()  # reads the chosen allocator; never initialises CUDA
    except Exception:  # an old or partial torch: say what we can
        backend = "unknown"
    if backend == "cudaMallocAsync":
        return None
    try:
        initialised = bool(torch.cuda.is_initialized())
    except Exception:
        initialised = False
    state = "and CUDA is initialised" if initialised else "which fixes the allocator backend at import"
    return (
        f"{ENV}={ALLOC_CONF} not applied: torch was imported before cosybatch configured its allocator "
        f"({state}; backend now {backend!r}); the setting applies from the next process"
    )


def configure_allocator(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Select the cudaMallocAsync allocator backend unless the user chose one; call before ``import torch``.

    Sets ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` in ``environ`` (default ``os.environ``)
    when neither it nor ``PYTORCH_ALLOC_CONF`` is set. A user's value is kept as it is. Returns None,
    or a one-line note for the log: the user's value does not select cudaMallocAsync, or (for
    ``os.environ`` only) torch was imported earlier with another backend, so nothing is changed.
    Pass a plain dict to prepare the environment of a child process.
    """
    target = os.environ if environ is None else environ
    for name in (ENV, ENV_GENERIC):
        current = target.get(name) or ""
        if current.strip():
            if _backend_in(current) == "cudaMallocAsync":
                return None
            shown = " ".join(current.split())  # one line, whatever the variable holds
            return (
                f"{name}={shown} is kept as you set it; cosybatch's pre-allocated GPU memory pool assumes "
                f"{ALLOC_CONF}, and options such as expandable_segments do not apply to cudaMallocAsync"
            )
    if target is os.environ:
        late = _too_late_note()
        if late is not None:
            return late
    target[ENV] = ALLOC_CONF
    return None


def validate_fraction(value: float) -> float:
    """The ``--memory-fraction`` value as a float in (0, 1]; UsageError otherwise (NaN included)."""
    if isinstance(value, bool):
        raise UsageError(f"--memory-fraction {value!r}: give a number in (0, 1], for example 0.9")
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"--memory-fraction {value!r}: give a number in (0, 1], for example 0.9") from None
    if not 0.0 < fraction <= 1.0:  # NaN compares false both ways
        raise UsageError(
            f"--memory-fraction {value!r}: must be greater than 0 and at most 1 (the share of the GPU's "
            "memory this process may use), for example 0.9"
        )
    return fraction


# -- the pre-allocated pool -------------------------------------------------------------------
@dataclass
class PoolInfo:
    """What :func:`setup_pool` did; all sizes in bytes."""

    total_bytes: int  # the GPU's memory, as cudaMemGetInfo reports it
    fraction: float
    cap_bytes: int  # fraction * total: torch's allocator may not go beyond this
    model_bytes: int  # allocated before the pool (the loaded models)
    pool_bytes: int  # reserved for batches (after halving on OOM; 0 if nothing could be reserved)
    seconds: float
    backend: str = ""  # "cudaMallocAsync" or "native"
    reserved_bytes: int = 0  # torch's reserved memory once the pool is in place
    notes: tuple[str, ...] = ()  # fallbacks taken (release threshold not verified, OOM halvings)


def _cuda_device(torch, device) -> torch.device:
    """A ``cuda:N`` device with its index; ValueError for anything that is not a usable CUDA device."""
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device {str(dev)!r}: GPU memory settings apply to CUDA devices only")
    if not torch.cuda.is_available():
        raise ValueError("no CUDA GPU is available: GPU memory settings apply to CUDA devices only")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _loaded(fragment: str) -> list[str]:
    """Paths of shared libraries mapped into this process whose file name contains ``fragment``."""
    paths: dict[str, None] = {}
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6 and fragment in os.path.basename(parts[5].strip()):
                    paths[parts[5].strip()] = None
    except OSError:
        pass
    return list(paths)


def _threshold_via(lib, get_pool: Callable[[ctypes.c_void_p], int], prefix: str) -> int:
    """Set the default pool's release threshold to UINT64_MAX through ``lib``; return it read back."""
    pool = ctypes.c_void_p()
    rc = get_pool(pool)
    if rc != 0:
        raise RuntimeError(f"{prefix}DeviceGetDefaultMemPool returned error {rc}")
    set_attr = getattr(lib, f"{prefix}MemPoolSetAttribute")
    get_attr = getattr(lib, f"{prefix}MemPoolGetAttribute")
    for fn in (set_attr, get_attr):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
    value = ctypes.c_uint64(_UINT64_MAX)
    rc = set_attr(pool, _RELEASE_THRESHOLD, ctypes.byref(value))
    if rc != 0:
        raise RuntimeError(f"{prefix}MemPoolSetAttribute returned error {rc}")
    check = ctypes.c_uint64(0)
    rc = get_attr(pool, _RELEASE_THRESHOLD, ctypes.byref(check))
    if rc != 0:
        raise RuntimeError(f"{prefix}MemPoolGetAttribute returned error {rc}")
    return check.value


def keep_pool_reserved(index: int) -> tuple[int | None, str | None]:
    """Make the device's default CUDA memory pool keep freed memory: release threshold = UINT64_MAX.

    What torch 2.13 offers (read from its sources): no Python API reaches the cudaMemPool behind
    ``backend:cudaMallocAsync`` (``torch.cuda.cudart()`` binds only profiler, host-register, stream
    and MemGetInfo calls; ``torch.cuda.MemPool`` is torch's own graph pool). Its allocator already
    sets this threshold on the device's default pool when it first uses the device
    (``lazy_init_device`` in c10/cuda/CUDAMallocAsyncAllocator.cpp), and
    ``set_per_process_memory_fraction`` is a hard limit on torch's *used* bytes, not a threshold.
    So this is a belt-and-braces check: it sets and reads the attribute back through ctypes, first
    with the libcudart torch loaded (``cudaDeviceGetDefaultMemPool`` + ``cudaMemPoolSetAttribute``),
    then with the driver API (``cuDeviceGetDefaultMemPool`` + ``cuMemPoolSetAttribute``).
    Returns (threshold read back or None, note or None). Never raises.
    """
    errors: list[str] = []
    candidates = _loaded("libcudart.so") or ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        try:
            fn = lib.cudaDeviceGetDefaultMemPool
            fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
            fn.restype = ctypes.c_int
            return _threshold_via(lib, lambda pool, fn=fn: fn(ctypes.byref(pool), index), "cuda"), None
        except (AttributeError, OSError, RuntimeError) as exc:
            errors.append(f"{path}: {exc}")
            break
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuInit", "cuDeviceGet", "cuDeviceGetDefaultMemPool"):
            getattr(lib, name).restype = ctypes.c_int
        if lib.cuInit(0) != 0:
            raise RuntimeError("cuInit failed")
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index)) != 0:
            raise RuntimeError(f"cuDeviceGet({index}) failed")
        get = lib.cuDeviceGetDefaultMemPool
        get.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        return _threshold_via(lib, lambda pool: get(ctypes.byref(pool), dev.value), "cu"), None
    except (AttributeError, OSError, RuntimeError) as exc:
        errors.append(f"libcuda.so.1: {exc}")
    return None, (
        "could not set the CUDA memory pool's release threshold (" + "; ".join(errors) + "); relying on "
        "torch's own setting (UINT64_MAX since its cudaMallocAsync backend first used the device)"
    )


def setup_pool(fraction: float, device: torch.device | str = "cuda", headroom_bytes: int = 512 << 20) -> PoolInfo:
    """Cap this process at ``fraction`` of the GPU and reserve the rest of the cap for batches.

    Call after the models are on the GPU. ``torch.cuda.set_per_process_memory_fraction`` sets the
    cap (with cudaMallocAsync it limits torch's allocated bytes, with the native allocator its
    reserved bytes). Then one uint8 tensor of ``cap - allocated - headroom_bytes`` is allocated and
    freed: the allocator keeps it reserved (cudaMallocAsync: the pool's release threshold is
    UINT64_MAX, see :func:`keep_pool_reserved`; native: cached until ``empty_cache``, which
    cosybatch never calls). The headroom stays free for cuDNN workspaces and onnxruntime, which
    allocate outside torch's pool. On OOM the pool is halved until it fits, down to 0.
    ValueError on a CPU device or without CUDA; UsageError for a fraction outside (0, 1].
    """
    import torch

    fraction = validate_fraction(fraction)
    if headroom_bytes < 0:
        raise ValueError(f"headroom_bytes {headroom_bytes}: must be >= 0")
    dev = _cuda_device(torch, device)
    start = time.perf_counter()
    notes: list[str] = []
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    try:
        backend = torch.cuda.get_allocator_backend()
    except Exception:
        backend = "unknown"
    if backend == "cudaMallocAsync":
        threshold, note = keep_pool_reserved(dev.index)
        if note is None and threshold != _UINT64_MAX:
            note = f"the CUDA memory pool's release threshold reads back as {threshold}, not UINT64_MAX"
        if note is not None:
            log.warning("%s", note)
            notes.append(note)
    total = int(torch.cuda.mem_get_info(dev)[1])
    cap = int(fraction * total)
    torch.cuda.synchronize(dev)
    model = int(torch.cuda.memory_allocated(dev))
    size = max(0, cap - model - int(headroom_bytes))
    while size > 0:
        try:
            block = torch.empty(size, dtype=torch.uint8, device=dev)
        except Exception as exc:
            if not is_oom(exc):
                raise
            notes.append(f"pool of {size} bytes did not fit; halved")
            size = size // 2 if size // 2 >= _MIN_POOL else 0
            continue
        del block
        break
    torch.cuda.synchronize(dev)
    reserved = int(torch.cuda.memory_reserved(dev))
    seconds = time.perf_counter() - start
    log.info(
        "GPU memory: %s backend, cap %.1f GiB (%.2f of %.1f GiB), models %.2f GiB, pool %.1f GiB, %.2f s",
        backend, cap / 2**30, fraction, total / 2**30, model / 2**30, size / 2**30, seconds,
    )
    return PoolInfo(total, fraction, cap, model, size, seconds, backend, reserved, tuple(notes))


# -- CUDA graph capture and the other workers -------------------------------------------------
class CaptureGate:
    """Keeps the process's other GPU work out of a CUDA graph capture.

    The caching allocator's "capture under way" state is process-wide: a free or an allocation from
    another thread (a second worker's flow or vocoder) while the LM records a graph can break the
    capture or the graph. Capture takes the gate alone (:meth:`capture`); other stages take it
    shared (:meth:`work`), so they run side by side and only wait while a graph is being recorded
    (rare: once per decode shape). A waiting capture holds back new work, so it is not starved.
    Do not nest: a thread inside :meth:`work` must not call :meth:`capture` or :meth:`work` again.
    """

    def __init__(self) -> None:
        import threading

        self._cond = threading.Condition()
        self._working = 0
        self._capturing = False
        self._waiting = 0
        self.captures = 0  # captures that took the gate (for tests and statistics)

    @property
    def capturing(self) -> bool:
        return self._capturing

    @contextlib.contextmanager
    def capture(self):
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: not self._capturing and self._working == 0)
            finally:
                self._waiting -= 1
            self._capturing = True
            self.captures += 1
        try:
            yield
        finally:
            with self._cond:
                self._capturing = False
                self._cond.notify_all()

    @contextlib.contextmanager
    def work(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._capturing and self._waiting == 0)
            self._working += 1
        try:
            yield
        finally:
            with self._cond:
                self._working -= 1
                self._cond.notify_all()


CAPTURE_GATE = CaptureGate()


# -- statistics and failures ------------------------------------------------------------------
def memory_stats(device: torch.device | str | int | None = None) -> dict:
    """Peak allocated, reserved, peak reserved bytes, fragmentation (1 - allocated / reserved), and
    the bytes the driver says are in use on the device (graph memory included).

    ``{}`` when torch is not imported or CUDA is not initialised (the CPU case): reporting never
    initialises CUDA.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    try:
        if not torch.cuda.is_initialized():
            return {}
        allocated = int(torch.cuda.memory_allocated(device))
        reserved = int(torch.cuda.memory_reserved(device))
        free, total = (int(x) for x in torch.cuda.mem_get_info(device))
        return {
            "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "reserved_bytes": reserved,
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "fragmentation": 1.0 - allocated / reserved if reserved > 0 else 0.0,
            # The driver's view: everything this process (and any other) holds on the GPU, CUDA graph
            # memory included, which torch's counters miss under cudaMallocAsync before torch 2.12.
            "device_used_bytes": total - free,
        }
    except (AttributeError, AssertionError, RuntimeError, ValueError):
        return {}


def is_oom(exc: BaseException) -> bool:
    """True for a GPU out-of-memory failure: torch's OutOfMemoryError, or a message from CUDA, cuDNN,
    cuBLAS or onnxruntime's BFC arena saying an allocation failed (also through ``raise ... from``)."""
    torch = sys.modules.get("torch")
    oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None) if torch is not None else None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(oom_type, type) and isinstance(current, oom_type):
            return True
        try:
            text = str(current).lower()
        except Exception:
            text = ""
        if any(marker in text for marker in _OOM_MARKERS):
            return True
        if "bfcarena" in text and ("alloc" in text or "memory" in text):
            return True
        current = current.__cause__
    return False


def ort_cuda_options(mem_limit_bytes: int | None) -> dict[str, str]:
    """onnxruntime CUDAExecutionProvider options: grow the arena by what is asked (it never shrinks),
    pick conv algorithms by heuristic (no per-shape benchmarking), optionally cap the arena
    (cuDNN workspaces can still exceed ``gpu_mem_limit``)."""
    options = {"arena_extend_strategy": "kSameAsRequested", "cudnn_conv_algo_search": "HEURISTIC"}
    if mem_limit_bytes is not None:
        if int(mem_limit_bytes) <= 0:
            raise ValueError(f"mem_limit_bytes {mem_limit_bytes}: must be positive")
        options["gpu_mem_limit"] = str(int(mem_limit_bytes))
    return options


def device_total_bytes(index: int = 0) -> int | None:
    """Total memory of GPU ``index`` without starting CUDA in this process (nvidia-smi), or None."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, f"--id={index}", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return int(float(out.strip().splitlines()[0]) * (1 << 20))  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


# -- can this process use CUDA? (run, run --check, cosybatch doctor) ------------------------------
ORT_CUDA = "CUDAExecutionProvider"


def cuda_driver_devices() -> tuple[int, str | None]:
    """How many CUDA devices the NVIDIA driver shows this process (``CUDA_VISIBLE_DEVICES`` applies),
    and why none when it is 0. Asks libcuda (``cuInit`` + ``cuDeviceGetCount``): no torch, no
    onnxruntime and no CUDA context. Never raises."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0, "no NVIDIA driver here (libcuda.so.1 cannot be loaded)"
    try:
        lib.cuInit.restype = ctypes.c_int
        lib.cuDeviceGetCount.restype = ctypes.c_int
        rc = lib.cuInit(0)
        if rc != 0:
            name = ctypes.c_char_p()
            lib.cuGetErrorName.restype = ctypes.c_int
            named = lib.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value
            shown = name.value.decode() if named else f"error {rc}"
            if rc == 100:  # CUDA_ERROR_NO_DEVICE
                return 0, f"the NVIDIA driver sees no GPU ({shown}; check CUDA_VISIBLE_DEVICES)"
            return 0, f"the NVIDIA driver does not start ({shown}); check the driver and the GPU with nvidia-smi"
        count = ctypes.c_int(0)
        rc = lib.cuDeviceGetCount(ctypes.byref(count))
    except (AttributeError, OSError) as exc:
        return 0, f"libcuda.so.1 does not answer ({exc})"
    if rc != 0 or count.value <= 0:
        return 0, "the NVIDIA driver sees no GPU (check CUDA_VISIBLE_DEVICES)"
    return count.value, None


def torch_cuda_problem() -> str | None:
    """Why torch cannot run on CUDA here, or None when ``torch.cuda.is_available()``. Imports torch:
    call :func:`configure_allocator` first, as a run does."""
    try:
        import torch
    except ImportError as exc:
        return f"torch cannot be imported ({exc}); install a CUDA build of torch (docs/gpu.md: GPU install)"
    build = getattr(torch.version, "cuda", None)
    if not build:
        return (f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch "
                "(docs/gpu.md: GPU install)")
    if torch.cuda.is_available():
        return None
    _, why = cuda_driver_devices()
    return f"torch {torch.__version__} (CUDA {build}) sees no usable GPU: {why or 'check the driver and nvidia-smi'}"


def onnxruntime_distributions() -> list[tuple[str, str]]:
    """(name, version) of every installed distribution whose files include the ``onnxruntime``
    module: onnxruntime, onnxruntime-gpu, ... More than one means two builds overwrote each other's
    files. Never imports onnxruntime."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    found = []
    for name in sorted(set(packages_distributions().get("onnxruntime", []))):
        try:
            found.append((name, version(name)))
        except PackageNotFoundError:
            continue
    return found


_PRELOADED: list[str | None] = []


def ort_preload_cuda(ort) -> str | None:
    """Load the CUDA and cuDNN libraries of pip's nvidia-* packages for onnxruntime's CUDA provider.

    onnxruntime-gpu's provider library has no search path of its own: without this (or an
    ``import torch`` first, or LD_LIBRARY_PATH) it cannot find libcublasLt.so.13 and the session
    silently falls back to the CPU. ``onnxruntime.preload_dlls`` (1.21 and later) finds them in
    site-packages; it prints what it could not load, which is returned (once per process) instead.
    """
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:  # onnxruntime before 1.21: the libraries must be on the loader's path
        return None
    if _PRELOADED:
        return _PRELOADED[0]
    import contextlib
    import io

    printed = io.StringIO()
    note = None
    try:
        with contextlib.redirect_stdout(printed):
            preload()
    except Exception as exc:
        note = f"onnxruntime.preload_dlls failed: {exc!r}"
    text = " ".join(printed.getvalue().split())
    note = note or (f"onnxruntime.preload_dlls: {text}" if text else None)
    _PRELOADED.append(note)
    return note


def ort_cuda_library_problem(ort) -> str | None:
    """Why onnxruntime's CUDA provider library cannot be loaded (a missing CUDA, cuDNN or driver
    library, named), or None. Preloads pip's CUDA libraries first, as the Piper engine does."""
    import glob

    ort_preload_cuda(ort)
    found = glob.glob(os.path.join(os.path.dirname(ort.__file__), "capi", "libonnxruntime_providers_cuda.so"))
    if not found:
        return None  # another layout (Windows, a custom build): let the session tell
    try:
        ctypes.CDLL(found[0])
    except OSError as exc:
        return f"onnxruntime's CUDA provider cannot be loaded: {exc}"
    return None


def ort_cuda_problem() -> str | None:
    """Why onnxruntime cannot run on CUDA here, or None: its build has the CUDA provider, the driver
    shows a GPU, and the provider's libraries load. Names a double install of two builds."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return f"onnxruntime cannot be imported ({exc}); see docs/gpu.md: GPU install"
    if ORT_CUDA not in ort.get_available_providers():
        dists = onnxruntime_distributions()
        shown = ", ".join(f"{n} {v}" for n, v in dists) or "none found"
        hint = "; two builds of the onnxruntime module are installed over each other" if len(dists) > 1 else ""
        return (f"this onnxruntime ({shown}) has no CUDA provider{hint}; install onnxruntime-gpu "
                "(docs/gpu.md: GPU install)")
    count, why = cuda_driver_devices()
    if not count:
        return why
    return ort_cuda_library_problem(ort)


def cuda_problem(runtime: str | None) -> str | None:
    """Why ``--device cuda`` cannot work here for an engine that runs on ``runtime`` ("torch",
    "onnxruntime", or None: only a GPU the driver shows is required), or None when it can."""
    if runtime == "torch":
        return torch_cuda_problem()
    if runtime == "onnxruntime":
        return ort_cuda_problem()
    return cuda_driver_devices()[1]


# -- batch budget from a measurement ------------------------------------------------------------
def _positive(value: object) -> bool:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return math.isfinite(number) and number > 0


def budget_from_probe(
    bytes_per_unit: Mapping[str, float], pool_bytes: int, safety: float = 0.8, floor: int = 1
) -> int:
    """The batch budget in padded cost units that fits ``pool_bytes``: the stage that needs the most
    bytes per unit decides, ``floor(safety * pool_bytes / worst)``, and never below ``floor``."""
    if not bytes_per_unit:
        raise ValueError("bytes_per_unit is empty: probe at least one stage")
    bad = {k: v for k, v in bytes_per_unit.items() if not _positive(v)}
    if bad:
        raise ValueError(f"bytes per unit must be positive and finite: {bad}")
    if not (math.isfinite(safety) and 0 < safety <= 1):
        raise ValueError(f"safety {safety}: must be in (0, 1]")
    if pool_bytes < 0:
        raise ValueError(f"pool_bytes {pool_bytes}: must be >= 0")
    worst = max(bytes_per_unit.values())
    return max(int(floor), math.floor(safety * pool_bytes / worst))


def probe_stage(fn: Callable[[], object], units: int, device: torch.device | str | int) -> float:
    """Bytes per padded unit that ``fn`` needs at its peak beyond what was allocated before it."""
    import torch

    if units <= 0:
        raise ValueError(f"units {units}: must be positive")
    dev = _cuda_device(torch, device)
    torch.cuda.synchronize(dev)
    before = int(torch.cuda.memory_allocated(dev))
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    peak = int(torch.cuda.max_memory_allocated(dev))
    return max(0, peak - before) / units
