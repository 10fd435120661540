"""Job specs: every `cosybatch run` option in a TOML or YAML file. Files are parsed, never
executed (YAML through safe_load). Keys are option names (`batch_size` or `batch-size`)."""

from __future__ import annotations

from pathlib import Path

from .errors import UsageError


def load_job_spec(path: Path) -> dict:
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"--job {path}: cannot read the job spec ({exc.strerror or exc})") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text.decode("utf-8"))
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            raise UsageError(f"--job {path}: name the spec *.toml, *.yaml or *.yml")
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"--job {path}: not valid {suffix[1:].upper()} ({exc})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"--job {path}: the spec must be a table of option = value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}
