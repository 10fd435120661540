"""Makes a Python process look like the GPU machine's image, for tests/ops/test_gpu_benchmark.py.

Put this folder first on PYTHONPATH (children inherit it). Then:
- a top-level package named in GPU_IMAGE_BLOCKED cannot be imported (the image lacks it);
- cosybatch imports only from GPU_IMAGE_ROOT, through sys.path, as from a plain checkout: the
  venv's editable install is taken off sys.meta_path (the image has cosybatch installed nowhere);
- at exit, the files of the checkout the process imported go to GPU_IMAGE_REPORT/<pid>.txt.
"""

import atexit
import importlib.abc
import importlib.machinery
import os
import sys

ROOT = os.path.realpath(os.environ["GPU_IMAGE_ROOT"])
BLOCKED = frozenset(filter(None, os.environ.get("GPU_IMAGE_BLOCKED", "").split(",")))
REPORT = os.environ.get("GPU_IMAGE_REPORT")
PREFIX = os.path.realpath(sys.prefix)  # the venv running the test, wherever it is


class GpuImageFinder(importlib.abc.MetaPathFinder):
    """sys.meta_path's PathFinder, but blind to the blocked packages and to a cosybatch outside ROOT,
    so that ``import x`` fails and ``importlib.util.find_spec(x)`` is None, as where x is absent."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if name == "cosybatch" and spec is not None:
            origin = os.path.realpath(spec.origin) if spec.origin else ""
            if not origin.startswith(ROOT + os.sep):
                return None
        return spec

    def find_distributions(self, *args, **kwargs):
        """Installed distributions (importlib.metadata), less the blocked ones."""
        for dist in importlib.machinery.PathFinder.find_distributions(*args, **kwargs):
            name = (dist.metadata["Name"] or "").lower().replace("-", "_")
            if name not in BLOCKED and name != "cosybatch":
                yield dist

    def invalidate_caches(self):
        importlib.machinery.PathFinder.invalidate_caches()


sys.meta_path[:] = [GpuImageFinder() if f is importlib.machinery.PathFinder else f for f in sys.meta_path
                    if not str(getattr(f, "__module__", "")).startswith("__editable__")]


def _report() -> None:
    files = set()
    # The script run (its __main__ has lost __file__ by now), then every module still loaded.
    for module in [type("script", (), {"__file__": sys.argv[0] if sys.argv else None}), *sys.modules.values()]:
        file = getattr(module, "__file__", None)
        file = os.path.realpath(file) if isinstance(file, str) else ""
        # The checkout's own modules: not a made-up name (torch's _ops.py), not the packages of a venv
        # that lives inside the checkout (CI's .venv), not a compiled extension.
        if os.path.isfile(file) and file.startswith(ROOT + os.sep) and file.endswith(".py") \
                and not file.startswith(PREFIX + os.sep):
            files.add(file)
    with open(os.path.join(REPORT, f"{os.getpid()}.txt"), "w") as f:
        f.write("\n".join(sorted(files)))


if REPORT:
    atexit.register(_report)
