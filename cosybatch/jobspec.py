"""Job specs: every `cosybatch run` option in a TOML or YAML file. Files are parsed, never
executed (YAML through a SafeLoader that also refuses aliases). Keys are option names
(`batch_size` or `batch-size`)."""

from __future__ import annotations

import re
from pathlib import Path

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
