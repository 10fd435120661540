"""benchmarks/gpu_throughput.py runs on the GPU machine's image from a plain checkout (issue 25).

The image (docs/gpu.md, "Running the GPU benchmark"): Python 3.12, torch, numpy, onnxruntime (CPU
build), pyarrow, typer, tqdm, onnx, onnxscript, tokenizers, tiktoken, safetensors, transformers and
what those need; no soundfile, faster-whisper, ctranslate2, nor upstream CosyVoice's packages, and
cosybatch installed nowhere. ``gpu_image_site/sitecustomize.py`` makes a child process look like
that: the missing packages cannot be imported, cosybatch only from this checkout, and each process
reports the third-party packages it imported.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "gpu_image_site"
# Not on the image; the ones cosybatch or its tests and benchmarks use elsewhere come first.
MISSING = ("soundfile", "faster_whisper", "ctranslate2", "whisper", "librosa", "scipy", "ray", "pytest",
           # upstream CosyVoice (the upstream-loop row) and its dependencies
           "cosyvoice", "matcha", "diffusers", "conformer", "einops", "hyperpyyaml", "torchaudio")
# On the image: the packages it lists, and what those import themselves.
IMAGE = {
    "torch", "torchgen", "functorch", "triton", "numpy", "onnxruntime", "pyarrow", "typer", "tqdm", "onnx",
    "onnxscript", "onnx_ir", "tokenizers", "tiktoken", "safetensors", "transformers",
    # torch's: sympy, networkx, jinja2, fsspec, filelock, typing_extensions
    "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec", "filelock", "typing_extensions",
    # typer's: click, rich, shellingham
    "click", "rich", "shellingham", "markdown_it", "mdurl", "pygments",
    # transformers' and tiktoken's: huggingface_hub, pyyaml, regex, requests, packaging
    "huggingface_hub", "hf_xet", "yaml", "_yaml", "regex", "requests", "urllib3", "certifi", "charset_normalizer",
    "idna", "packaging",
    # onnx's protobuf, onnxscript's ml_dtypes
    "google", "ml_dtypes",
    # the venv's own start-up (.pth files)
    "_distutils_hack",
}
MODULES = (  # what the benchmark and its workers import, lazily included
    "gpu_throughput", "cosyvoice_e2e", "gpu_memory", "cosybatch.engines", "cosybatch.engines.cosyvoice.engine",
    "cosybatch.cosyvoice.pipeline", "cosybatch.cosyvoice.model", "cosybatch.cosyvoice.lm.v1",
    "cosybatch.cosyvoice.lm.v2", "cosybatch.cosyvoice.lm.v3", "cosybatch.cosyvoice.tiny",
    "cosybatch.cosyvoice.frontend.features", "cosybatch.cosyvoice.frontend.text",
    "cosybatch.cosyvoice.frontend.whisper", "cosybatch.cosyvoice.flow.onnx", "cosybatch.plan", "cosybatch.gpu",
    "transformers.models.whisper.modeling_whisper", "torch.nn.attention",
)


def image_env(report: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    env.update(PYTHONPATH=str(SITE), GPU_IMAGE_ROOT=str(ROOT), GPU_IMAGE_BLOCKED=",".join(MISSING),
               GPU_IMAGE_REPORT=str(report), PYTHONUNBUFFERED="1")
    return env


def imported(report: Path) -> set[str]:
    """Third-party packages that the checkout's modules the processes loaded import at module level
    (what loading them needs; a lazy import inside a function fails the dry run if it is reached)."""
    files: set[str] = set()
    for file in report.glob("*.txt"):
        files |= set(filter(None, file.read_text().split("\n")))
    local = {p.stem for d in ("benchmarks", "tests") for p in (ROOT / d).glob("*.py")} | {"cosybatch"}
    names: set[str] = set()
    for file in files:
        tree = ast.parse(Path(file).read_text(encoding="utf-8"))
        todo = list(tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.Import):
                names |= {a.name.partition(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.partition(".")[0])
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                todo.extend(ast.iter_child_nodes(node))
    assert files and any(f.endswith("gpu_throughput.py") for f in files)
    return names - set(sys.stdlib_module_names) - local


def test_the_image_site_blocks_and_keeps_cosybatch_to_the_checkout(tmp_path):
    code = ("import importlib, sys\n"
            "for name in ('soundfile', 'cosybatch'):\n"
            "    try: importlib.import_module(name)\n"
            "    except ModuleNotFoundError as exc: print('refused', name)\n"
            "sys.path.insert(0, sys.argv[1]); import cosybatch; print(cosybatch.__file__)")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, cwd="/",
                          env=image_env(tmp_path), timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    assert lines[:2] == ["refused soundfile", "refused cosybatch"]
    assert lines[2].startswith(str(ROOT / "cosybatch"))


def test_what_the_gpu_benchmark_imports_is_on_the_gpu_image(tmp_path):
    code = ("import importlib, sys\n"
            f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
            f"for name in {MODULES!r}:\n"
            "    importlib.import_module(name)\n"
            "import cosybatch; print(cosybatch.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                          env=image_env(tmp_path), timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith(str(ROOT / "cosybatch"))
    extra = imported(tmp_path) - IMAGE
    assert not extra, f"the benchmark's modules import packages the GPU image may lack: {sorted(extra)}"
    assert "torch" in imported(tmp_path)


@pytest.mark.slow
def test_the_dry_run_passes_from_a_plain_checkout_on_the_image(tmp_path):
    """--dry-run from the repository root, cosybatch not installed: every row's code path (graph
    counts, the JSON rewritten after every row, rows skipped with their reason)."""
    report, out = tmp_path / "imports", tmp_path / "out"
    report.mkdir()
    proc = subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=image_env(report), timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "gpu_throughput.json").read_text())
    assert result == {**result, "device": "cpu", "size": "tiny"}
    assert json.loads(proc.stdout.strip().splitlines()[-1])["json_writes"] == result["json_writes"]
    # written after the graph check, after each row (run or skipped) and at the end
    assert result["json_writes"] == 1 + len(result["runs"]) + len(result["skipped"]) + 1
    graphs = result["graphs"]["fp32"]
    assert graphs["identical"] and graphs["graphs_captured"] == 0 and graphs["eager_steps"] == graphs["steps"] > 0
    runs = {r["row"]: r for r in result["runs"]}
    assert not [r for r in runs.values() if "error" in r], runs
    ours = [r for r in runs.values() if r["kind"] == "ours"]
    assert len(ours) == 3 and any(r.get("workers") == 2 for r in ours)
    for row in ours:  # CPU: every timed step eager, none replayed or captured; from this checkout
        pool = row["timed_lm_pool"]
        assert pool["steps"] > 0 and pool["eager_steps"] == pool["steps"] and pool["graph_replays"] == 0
        assert row["rtf"] > 0 and row["cosybatch"].startswith(str(ROOT / "cosybatch"))
    assert runs["asr"]["weights"].startswith("RANDOM") and runs["asr"]["batches"] and runs["asr"]["scoring"]
    skipped = {s["row"]: s["reason"] for s in result["skipped"]}
    assert "upstream" in skipped and "packages are missing" in skipped["upstream"]  # blocked here
    assert any("TensorRT" in reason for reason in skipped.values())
    assert len(proc.stdout) < 12_000  # what comes back of a GPU run's output holds every figure
    extra = imported(report) - IMAGE
    assert not extra, f"the benchmark's processes imported packages the GPU image may lack: {sorted(extra)}"


def test_the_built_in_engines_are_found_without_cosybatchs_entry_points(monkeypatch):
    """A plain checkout has no installed metadata, so no entry points: piper and cosyvoice still open."""
    import importlib.metadata

    from cosybatch.engines import registry

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: [])
    registry._entry_points.cache_clear()
    try:
        assert registry.engine_class("cosyvoice").name == "cosyvoice"
        assert registry.engine_class("piper").name == "piper"
        assert set(registry.BUILT_IN) <= set(registry.engine_names())
    finally:
        registry._entry_points.cache_clear()
