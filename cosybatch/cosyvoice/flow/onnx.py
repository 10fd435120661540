"""The flow's estimator (``CausalConditionalDecoder``) through ONNX Runtime.

The estimator is exported once per checkpoint with ``torch.onnx.export(dynamo=True)`` (the
``torch.export`` path; TorchScript, and the ONNX exporter built on it, are deprecated) with dynamic
batch and frame axes, and run by ONNX Runtime's CPU, CUDA or TensorRT execution provider in place of
the torch module. Everything around it stays in torch: the encoder, the Euler solver (fp32 state),
classifier-free guidance as one batch of 2B, the starting noise.

Inputs are the estimator's: ``x, mask, mu, spks, cond`` in the export's dtype and ``t`` in fp32;
the attention bias is built inside the graph from ``mask``.

The exported file lives in the user's cache folder (``$XDG_CACHE_HOME/cosybatch/flow-onnx``, by
default ``~/.cache/cosybatch/flow-onnx``), keyed by the sha256 of ``flow.pt``, the estimator's
settings in ``cosyvoice2.yaml``, the source of the modules that define the graph, the torch and
exporter versions and the dtype. It is written to a temporary file and renamed into place, its
name carries the sha256 of its own bytes (a damaged file is detected, removed and rebuilt), and a
lock file makes concurrent jobs and sharded workers on one machine wait for one export instead of
each running their own. Nothing from the model folder is executed: the graph is our own module's,
with the folder's weights loaded as tensors.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...cache import cache_root, cached_file, sha256_hex

BACKENDS = ("torch", "onnx", "tensorrt")
INPUT_NAMES = ("x", "mask", "mu", "t", "spks", "cond")
OUTPUT_NAME = "velocity"
# Bump to invalidate every cached export (a change in how the file is made).
FORMAT_VERSION = 1
# TensorRT's optimisation profile: estimator batches (2B, guided and unconditioned halves) up to
# 64 items of up to 3000 mel frames (60 s), as upstream's TensorRT flow. A call outside it is split
# into batches of at most TRT_MAX_BATCH, and one longer than TRT_MAX_FRAMES runs on torch.
TRT_MAX_BATCH = 64
TRT_OPT_BATCH = 64
TRT_MAX_FRAMES = 3000
TRT_OPT_FRAMES = 500

log = logging.getLogger("cosybatch")

_ORT_TYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16}
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16"}


class FlowBackendError(ValueError):
    """The flow backend cannot run here (a missing provider or package, an unwritable cache)."""


# --------------------------------------------------------------------------------------------
# Providers


def _require_providers(backend: str, device: torch.device | str) -> None:
    """FlowBackendError unless onnxruntime here has what ``backend`` needs on ``device`` (no CUDA started)."""
    if backend not in BACKENDS or backend == "torch":
        raise FlowBackendError(f"flow_backend {backend!r} has no ONNX Runtime providers (onnx or tensorrt)")
    import onnxruntime as ort

    device = torch.device(device)
    available = ort.get_available_providers()
    have = f"this onnxruntime {ort.__version__} has {', '.join(available)}"
    if backend == "tensorrt":
        if device.type != "cuda":
            raise FlowBackendError("flow_backend=tensorrt needs a CUDA GPU (--device cuda); on CPU use "
                                   "flow_backend=onnx or torch")
        if "TensorrtExecutionProvider" not in available:
            raise FlowBackendError(f"flow_backend=tensorrt needs onnxruntime-gpu with TensorRT's libraries; {have} "
                                   "(install TensorRT, see docs/gpu.md, or use flow_backend=onnx)")
    if device.type == "cuda" and "CUDAExecutionProvider" not in available:
        raise FlowBackendError(f"flow_backend={backend} on CUDA needs onnxruntime-gpu; {have} "
                               "(see docs/gpu.md, or use flow_backend=torch)")


def providers(backend: str, device: torch.device | str, fp16: bool = False,
              trt_cache: Path | None = None) -> list:
    """onnxruntime's provider list for ``backend`` on ``device``; FlowBackendError if unavailable."""
    _require_providers(backend, device)
    device = torch.device(device)
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    from ...gpu import ort_cuda_options

    index = device.index if device.index is not None else torch.cuda.current_device()
    cuda = ("CUDAExecutionProvider", {"device_id": str(index), **ort_cuda_options(None)})
    if backend == "onnx":
        return [cuda, "CPUExecutionProvider"]
    trt = {
        "device_id": str(index),
        "trt_fp16_enable": "True" if fp16 else "False",
        "trt_profile_min_shapes": _profile(1, 1),
        "trt_profile_opt_shapes": _profile(TRT_OPT_BATCH, TRT_OPT_FRAMES),
        "trt_profile_max_shapes": _profile(TRT_MAX_BATCH, TRT_MAX_FRAMES),
    }
    if trt_cache is not None:
        trt |= {"trt_engine_cache_enable": "True", "trt_engine_cache_path": str(trt_cache),
                "trt_timing_cache_enable": "True", "trt_timing_cache_path": str(trt_cache)}
    return [("TensorrtExecutionProvider", trt), cuda, "CPUExecutionProvider"]


def _profile(batch: int, frames: int, channels: int = 80) -> str:
    shapes = {"x": (batch, channels, frames), "mask": (batch, 1, frames), "mu": (batch, channels, frames),
              "t": (batch,), "spks": (batch, channels), "cond": (batch, channels, frames)}
    return ",".join(f"{name}:{'x'.join(str(d) for d in shape)}" for name, shape in shapes.items())


def check_backend(backend: str, device: torch.device | str) -> None:
    """Fail early (before any weights load) when ``backend`` cannot run on ``device``."""
    if backend not in BACKENDS:
        raise FlowBackendError(f"flow_backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return
    _require_providers(backend, device)
    try:
        import onnxscript  # noqa: F401  (torch.onnx.export(dynamo=True) translates with it)
    except ImportError:
        raise FlowBackendError(f"flow_backend={backend} exports the flow with torch.onnx, which needs the "
                               "onnxscript package: pip install 'cosybatch[cosyvoice]'") from None


# --------------------------------------------------------------------------------------------
# Export and cache


def export_key(flow_pt: Path, estimator_config: Any, dtype: torch.dtype) -> str:
    """What the exported graph depends on, hashed: the weights, the settings, our code, the tools."""
    import onnxscript

    here = Path(__file__).resolve().parent
    parts = {
        "format": FORMAT_VERSION,
        "flow_pt": sha256_hex(flow_pt),
        "estimator": estimator_config,
        # The graph is traced from our modules (CosyVoice2's estimator in v2.py, its blocks in cfm.py):
        # a change in them must not reuse an old export.
        "code": {name: sha256_hex(here / name) for name in ("cfm.py", "v2.py", "onnx.py")},
        "exporter": {"torch": torch.__version__, "onnxscript": onnxscript.__version__, "dynamo": True},
        "dtype": _DTYPE_NAMES[dtype],
    }
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def export_estimator(estimator: torch.nn.Module, path: Path, dtype: torch.dtype) -> None:
    """Export a copy of ``estimator`` (on the CPU, in ``dtype``) to ``path``: dynamic batch and frames."""
    from torch.export import Dim

    module = copy.deepcopy(estimator).to(device="cpu", dtype=dtype).eval()
    b, t = 2, 37  # neither 0 nor 1, so torch.export does not specialise the axes
    channels = module.final_proj.out_channels
    gen = torch.Generator().manual_seed(0)  # the global RNG is left alone
    example = (
        torch.randn(b, channels, t, generator=gen).to(dtype),
        torch.ones(b, 1, t, dtype=dtype),
        torch.randn(b, channels, t, generator=gen).to(dtype),
        torch.rand(b, generator=gen),
        torch.randn(b, channels, generator=gen).to(dtype),
        torch.randn(b, channels, t, generator=gen).to(dtype),
    )
    batch, frames = Dim("batch", min=1), Dim("frames", min=1)
    dynamic = {"x": {0: batch, 2: frames}, "mask": {0: batch, 2: frames}, "mu": {0: batch, 2: frames},
               "t": {0: batch}, "spks": {0: batch}, "cond": {0: batch, 2: frames}}
    # The exporter logs and warns at length (torchvision ops it skips, deprecations inside torch);
    # none of it is actionable here, and stdout may carry the job's JSON summary.
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, example, str(path), dynamo=True, verbose=False, external_data=False,
                              input_names=list(INPUT_NAMES), output_names=[OUTPUT_NAME], dynamic_shapes=dynamic)
    finally:
        quiet.setLevel(level)


def cached_export(estimator: torch.nn.Module, flow_pt: Path, estimator_config: Any, dtype: torch.dtype,
                  folder: Path | None = None) -> Path:
    """The estimator's ONNX file from the cache, exported (once, atomically) when missing or damaged."""
    folder = Path(folder) if folder is not None else cache_root() / "flow-onnx"
    key = export_key(flow_pt, estimator_config, dtype)

    def build(tmp: Path) -> None:
        log.info("exporting the flow estimator to ONNX (%s, once per checkpoint) into %s", _DTYPE_NAMES[dtype],
                 folder)
        try:
            export_estimator(estimator, tmp, dtype)
        except Exception as exc:  # the exporter raises many types; none is the user's to debug
            raise FlowBackendError(f"exporting the flow estimator to ONNX failed ({type(exc).__name__}: "
                                   f"{str(exc)[:500]}); use flow_backend=torch") from exc

    try:
        return cached_file(folder, key, build)
    except OSError as exc:
        raise FlowBackendError(f"the flow's ONNX cache folder {folder} is not usable ({exc}); set XDG_CACHE_HOME "
                               "to a writable folder") from None


# --------------------------------------------------------------------------------------------
# Running it


class OnnxEstimator:
    """Calls an ONNX Runtime session like the torch estimator: torch tensors in, a torch tensor out
    (in the session's dtype, on the inputs' device). On CUDA the tensors are bound in place (no
    copies through the host). A call TensorRT's profile does not cover is split by batch, or (too
    many frames) run by ``fallback``, the torch estimator."""

    def __init__(self, path: Path, provider_list: list, device: torch.device | str,
                 fallback: Callable[..., Tensor] | None = None, max_batch: int | None = None,
                 max_frames: int | None = None, threads: int | None = None):
        import onnxruntime as ort

        self.path = Path(path)
        self.device = torch.device(device)
        self.fallback = fallback
        self.max_batch, self.max_frames = max_batch, max_frames
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(self.path), options, providers=provider_list)
        inputs = {i.name: i.type for i in self.session.get_inputs()}
        if sorted(inputs) != sorted(INPUT_NAMES) or any(t not in _ORT_TYPES for t in inputs.values()):
            raise FlowBackendError(f"{self.path}: not a flow estimator export (inputs {inputs})")
        self.dtypes = {name: _ORT_TYPES[t] for name, t in inputs.items()}
        self.out_dtype = _ORT_TYPES[self.session.get_outputs()[0].type]
        self.providers = self.session.get_providers()

    def __call__(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        if self.max_frames is not None and x.size(2) > self.max_frames and self.fallback is not None:
            return self.fallback(x, mask, mu, t, spks, cond)
        if self.max_batch is not None and x.size(0) > self.max_batch:
            step = self.max_batch
            return torch.cat([self(*(a[s : s + step] for a in (x, mask, mu, t, spks, cond)))
                              for s in range(0, x.size(0), step)])
        args = dict(zip(INPUT_NAMES, (x, mask, mu, t, spks, cond), strict=True))
        if x.device.type == "cuda":
            return self._run_cuda(args)
        feeds = {name: a.detach().to(self.dtypes[name]).contiguous().numpy() for name, a in args.items()}
        (out,) = self.session.run([OUTPUT_NAME], feeds)
        return torch.from_numpy(out)

    def _run_cuda(self, args: dict[str, Tensor]) -> Tensor:
        import numpy as np

        np_types = {torch.float32: np.float32, torch.float16: np.float16}
        device = args["x"].device
        index = device.index if device.index is not None else torch.cuda.current_device()
        binding = self.session.io_binding()
        keep = []
        for name, a in args.items():
            a = a.detach().to(self.dtypes[name]).contiguous()
            keep.append(a)
            binding.bind_input(name, "cuda", index, np_types[a.dtype], tuple(a.shape), a.data_ptr())
        out = torch.empty(tuple(args["x"].shape), dtype=self.out_dtype, device=device)
        binding.bind_output(OUTPUT_NAME, "cuda", index, np_types[out.dtype], tuple(out.shape), out.data_ptr())
        # onnxruntime runs on its own stream: the inputs must be written before it reads them.
        torch.cuda.current_stream(device).synchronize()
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        del keep
        return out


def estimator_config(config) -> Any:
    """The estimator's settings as ``cosyvoice2.yaml`` gives them (a ModelConfig's flow section)."""
    decoder = config.flow.kwargs.get("decoder")
    estimator = decoder.kwargs.get("estimator") if decoder is not None else None
    return {"estimator": getattr(estimator, "kwargs", estimator),
            "decoder": {k: v for k, v in getattr(decoder, "kwargs", {}).items() if k != "estimator"}}


def attach(flow, config, backend: str, device: torch.device | str, precision: str = "fp32",
           folder: Path | None = None) -> OnnxEstimator | None:
    """Make ``flow``'s CFM run its estimator through ONNX Runtime (``backend`` onnx or tensorrt).

    Call with the flow's fp32 weights (before any conversion to half precision). The export is in
    fp16 for the CUDA provider when ``precision`` is fp16 or bf16 (onnxruntime has no bf16 CUDA
    kernels for most ops), else fp32; TensorRT builds from the fp32 export, in fp16 when asked.
    """
    if backend == "torch":
        flow.decoder.runner = None
        return None
    check_backend(backend, device)
    device = torch.device(device)
    half = precision in ("fp16", "bf16") and device.type == "cuda"
    dtype = torch.float16 if half and backend == "onnx" else torch.float32
    estimator = flow.decoder.estimator
    path = cached_export(estimator, Path(config.path) / "flow.pt", estimator_config(config), dtype,
                         folder=None if folder is None else Path(folder) / "flow-onnx")
    trt_cache = None
    limits: dict = {}
    if backend == "tensorrt":
        trt_cache = (Path(folder) if folder is not None else cache_root()) / "flow-trt" / (
            path.stem + ("-fp16" if half else "-fp32"))
        try:
            trt_cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FlowBackendError(f"TensorRT's engine cache folder {trt_cache} is not usable ({exc}); set "
                                   "XDG_CACHE_HOME to a writable folder") from None
        limits = {"max_batch": TRT_MAX_BATCH, "max_frames": TRT_MAX_FRAMES}
    runner = OnnxEstimator(path, providers(backend, device, fp16=half, trt_cache=trt_cache), device,
                           fallback=estimator, **limits)
    wanted = {"onnx": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}[backend]
    if device.type == "cuda" and wanted not in runner.providers:
        # onnxruntime falls back to the CPU when a GPU provider fails to start (missing CUDA/cuDNN/TensorRT libraries).
        raise FlowBackendError(f"onnxruntime could not start its {wanted} (it runs {', '.join(runner.providers)}), "
                               "usually for missing CUDA, cuDNN or TensorRT libraries: see cosybatch doctor")
    flow.decoder.runner = runner
    return runner
