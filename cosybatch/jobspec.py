"""Job specs: every `cosybatch run` option in a TOML or YAML file. Files are parsed, never
executed (YAML through a SafeLoader that also refuses aliases). Keys are option names
(`batch_size` or `batch-size`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import yaml

from .errors import UsageError

QUOTE_LIMIT = 200
# Option names are short identifiers; anything else is refused here, quoted briefly.
_OPTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


def quote(value, limit: int = QUOTE_LIMIT) -> str:
    """`repr(value)` for an error message, cut to `limit` characters with '…'. (With aliases
    refused, a spec value is a plain tree no bigger than its file, so its repr is cheap.)"""
    return _cut(repr(value), limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _AliasFound(Exception):
    def __init__(self, anchor: str, line: int):
        super().__init__(anchor, line)
        self.anchor, self.line = anchor, line


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases. An alias reuses a node, so a few hundred bytes of nested
    aliases ("billion laughs") stand for billions of values: quoting or walking one hangs the
    process and fills memory. Specs are flat option tables and never need them."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasFound(event.anchor, event.start_mark.line + 1)
        return super().compose_node(parent, index)


def _load_yaml(path: Path, text: bytes):
    try:
        return yaml.load(text, Loader=_SpecLoader)
    except _AliasFound as alias:
        raise UsageError(f"--job {path}: YAML aliases (*name) are not allowed in job specs; write the value "
                         f"out (line {alias.line}: *{_cut(str(alias.anchor), 40)})") from None


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
            data = _load_yaml(path, text)
        else:
            raise UsageError(f"--job {path}: name the spec *.toml, *.yaml or *.yml")
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"--job {path}: not valid {suffix[1:].upper()} ({_cut(str(exc), 500)})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"--job {path}: the spec must be a table of option = value")
    for key in data:
        if not isinstance(key, str) or not _OPTION_NAME.fullmatch(key):
            raise UsageError(f"--job {path}: key {quote(key, 60)} is not an option name; "
                             "keys are `cosybatch run` options such as batch_size")
    return {key.replace("-", "_"): value for key, value in data.items()}


def spec_options(path: Path) -> dict:
    """A job spec's values as flat `cosybatch run` options (RunConfig.from_options takes them),
    each checked against the type of the matching flag; unknown keys are refused with the
    nearest option named."""
    import difflib

    from .config import SPEC_STRUCTURES, run_options

    hints = {name: option.hint for name, option in run_options().items()}
    aliases = _alias_names()
    values: dict = {}
    spec_engine_options: dict = {}
    for key, value in load_job_spec(path).items():
        if key == "engine_options":  # the engine's own table; its keys are checked by the engine
            if not isinstance(value, dict):
                raise UsageError(f"--job {path}: engine_options must be a table of KEY = value")
            spec_engine_options.update(value)
            continue
        if key == "qc" and isinstance(value, dict):  # the [qc] table: mode, the qc_* options, thresholds
            qc_values, limits = _qc_table(path, value, hints)
            values.update(qc_values)
            if limits:
                values["qc_limits"] = limits
            continue
        if key in aliases:  # a spec's alias keys are its engine options; flags override both
            spec_engine_options.setdefault(key, value)
            continue
        if key not in hints:
            close = difflib.get_close_matches(key, hints, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; options are: {', '.join(sorted(hints))}"
            raise UsageError(f"--job {path}: unknown key {key!r}{hint}")
        if key == "export" and isinstance(value, list):
            value = ",".join(map(str, value))
        if key in SPEC_STRUCTURES and isinstance(value, (list, dict)):
            values[key] = value  # the engine section parses and checks it
            continue
        values[key] = _typed(path, key, value, hints[key])
    if spec_engine_options:
        values["engine_options"] = spec_engine_options
    return values


def config_from_spec(path: Optional[Path] = None, **overrides):
    """A RunConfig from a job spec (TOML or YAML; None: no spec) with flat options given as
    keywords overriding its values, as flags on `cosybatch run --job` do: what the CLI builds."""
    from .config import RunConfig

    values = spec_options(Path(path)) if path is not None else {}
    values.update(overrides)
    return RunConfig.from_options(**values)


def _alias_names() -> set:
    from .engines import engine_aliases

    return set(engine_aliases())


def _qc_table(path: Path, table: dict, hints: dict) -> tuple[dict, dict]:
    """A job spec's [qc] table -> (qc_* option values, signal thresholds). `mode` is --qc; a key
    named like a --qc-* flag without its prefix sets that flag; the rest are thresholds, checked by
    the quality section against the known names."""
    values, limits = {}, {}
    for key, value in table.items():
        key = str(key).replace("-", "_")
        name = "qc" if key == "mode" else f"qc_{key}"
        if name in hints and name != "qc_limits":
            values[name] = _typed(path, f"qc.{key}", value, hints[name])
        else:
            limits[key] = value
    return values, limits


def _typed(path: Path, key: str, value, hint):
    """A spec value as the flag's type: int, float, bool, str or Path (each maybe Optional)."""
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    target = args[0] if args else hint
    if value is None and args:
        return None
    if typing.get_origin(target) is list:  # engine_opt: a list of KEY=VALUE strings
        if isinstance(value, list) and all(isinstance(x, str) for x in value):
            return value
        raise UsageError(f"--job {path}: {key} = {quote(value)} should be a list of KEY=VALUE strings")
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, (str, int, float)) and not isinstance(value, bool),
        Path: isinstance(value, str),
    }.get(target, False)
    if not ok:
        raise UsageError(f"--job {path}: {key} = {quote(value)} should be a {getattr(target, '__name__', target)}")
    return target(value)
