"""The registry: engines found by name under the ``cosybatch.engines`` entry-point group, opened,
and their options parsed.

The built-in ``piper`` and ``cosyvoice`` register there too, in cosybatch's own pyproject.toml, so a
third-party package that registers an `Engine` subclass is found the same way. An engine's module
is imported when its class is first asked for, never its heavy dependencies (onnxruntime, torch).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from ..errors import UsageError
from .base import Alias, Engine, EngineOptions

ENTRY_POINT_GROUP = "cosybatch.engines"
DEFAULT_ENGINE = "piper"  # speaks real English on any machine with nothing to download


# The built-in engines as pyproject.toml registers them: found also from a plain checkout, where
# cosybatch is not installed and so has no entry points (the GPU machine runs the benchmarks so).
BUILT_IN = {"piper": "cosybatch.engines.piper:PiperEngine", "cosyvoice": "cosybatch.engines.cosyvoice:CosyVoiceEngine"}


@functools.cache
def _entry_points() -> dict:
    """Scanned once per process (about 13 ms here; the job asks for its engine class often)."""
    from importlib.metadata import EntryPoint, entry_points

    built_in = {name: EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in BUILT_IN.items()}
    return built_in | {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


# Engines registered by `register_engine` in this process (a notebook, a test): found before the
# entry points, and only here (a ray-run's workers, other processes, need the entry point).
_IN_PROCESS: dict[str, type[Engine]] = {}


def engine_names() -> list[str]:
    return sorted({*_entry_points(), *_IN_PROCESS})


def engine_class(name: str) -> type[Engine]:
    """The class registered as `name` (imported now, not its heavy dependencies)."""
    if name in _IN_PROCESS:
        return _IN_PROCESS[name]
    found = _entry_points()
    if name not in found:
        raise UsageError(f"unknown engine {name!r}; installed engines: {', '.join(engine_names()) or 'none'} "
                         f"(a plugin registers under the {ENTRY_POINT_GROUP!r} entry-point group)")
    try:
        cls = found[name].load()
    except Exception as exc:
        raise UsageError(f"engine {name!r} ({found[name].value}) failed to import: {exc!r}") from None
    return _checked(name, found[name].value, cls)


def register_engine(cls: type[Engine]) -> type[Engine]:
    """Make `cls` an engine of this process under `cls.name`, checked as an entry point's class
    is; usable as a class decorator. For notebooks and tests: an installed engine registers under
    the entry-point group instead (docs/writing-an-engine.md)."""
    where = f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', cls)}"
    name = getattr(cls, "name", "")
    if not name:
        raise UsageError(f"engine {where} has no name: set the class attribute name = '...'")
    _IN_PROCESS[name] = _checked(name, where, cls)
    return cls


def _checked(name: str, where: str, cls) -> type[Engine]:
    """`cls` if it is a complete Engine; refused here, before its model loads, if not."""
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise UsageError(f"engine {name!r} ({where}) is not a cosybatch.engines.Engine subclass")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise UsageError(f"engine {name!r} ({where}) does not implement {missing} (docs/writing-an-engine.md)")
    return cls


def open_engine(name: str, voice: Optional[str], options: EngineOptions) -> Engine:
    cls = engine_class(name)
    if options.engine is None:
        options = dataclasses.replace(options, engine=parse_engine_options(cls, {}))
    return cls(voice, options)


def parse_engine_options(cls: type[Engine], raw: Mapping[str, Any]):
    """`raw` (strings from --engine-opt, typed values from a job spec) -> an instance of
    `cls.Options`, each value converted to its field's type; errors name the key."""
    import difflib

    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    hints = typing.get_type_hints(cls.Options)
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            others = [n for n in engine_names() if n != cls.name and name in _option_names(n)]
            close = difflib.get_close_matches(name, fields, n=1)
            known = (f"it is an option of {' and '.join(others)}: add --engine {others[0]}" if len(others) == 1
                     else f"engines that take it: {', '.join(others)}; choose one with --engine" if others
                     else f"did you mean {close[0]!r}?" if close
                     else f"its options are: {', '.join(sorted(fields)) or 'none'}")
            raise UsageError(f"engine {cls.name!r} has no option {key!r}; {known}")
        values[name] = _convert(cls.name, name, value, hints[name])
    try:
        return cls.Options(**values)
    except TypeError as exc:  # a required option is missing
        raise UsageError(f"engine {cls.name!r}: {exc}; give it as --engine-opt KEY=VALUE") from None


def _option_names(engine: str) -> set[str]:
    try:
        return {f.name for f in dataclasses.fields(engine_class(engine).Options)}
    except UsageError:  # a broken plugin does not hide the real error
        return set()


def _convert(engine: str, key: str, value: Any, hint) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    target = args[0] if args else hint
    if value is None:
        if args or hint is Any:
            return None
    elif target is Any:
        return value
    elif target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.strip().lower() in ("1", "true", "yes", "on")
    elif target in (int, float):
        number = value
        if isinstance(value, str):
            try:
                number = float(value) if target is float else int(value)
            except ValueError:
                number = None
        if isinstance(number, (int, float)) and not isinstance(number, bool) and math.isfinite(number) \
                and (target is float or number == int(number)):
            return target(number)
    elif target is str and isinstance(value, (str, int, float, Path)) and not isinstance(value, bool):
        return str(value)
    elif target is Path and isinstance(value, (str, Path)):
        return Path(value)
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:79] + "…"
    raise UsageError(f"engine {engine!r} option {key} = {shown} should be a {getattr(target, '__name__', target)}")


def engine_aliases() -> dict[str, list[tuple[str, Alias]]]:
    """Every installed engine's aliases: option -> [(engine name, its declaration), ...]. An engine
    that fails to import is skipped here; choosing it with --engine reports why."""
    found: dict[str, list[tuple[str, Alias]]] = {}
    for name in engine_names():
        try:
            cls = engine_class(name)
        except UsageError:
            continue
        for alias in cls.aliases:
            found.setdefault(alias.option, []).append((name, alias))
    return found


def quantize(name: str, voice: Optional[str], raw_options: Mapping[str, Any]) -> dict:
    """`cosybatch quantize --engine NAME`: the engine's own quantize step, where it declares one
    (`Engine.quantize`); `raw_options` as for `parse_engine_options`."""
    cls = engine_class(name)
    if cls.quantize is None:
        offering = [n for n in engine_names() if n != name and _offers_quantize(n)]
        raise UsageError(f"engine {name!r} has no quantize step"
                         + (f"; engines that have one: {', '.join(offering)}" if offering else ""))
    return cls.quantize(voice, EngineOptions(engine=parse_engine_options(cls, raw_options)))


def _offers_quantize(name: str) -> bool:
    try:
        return engine_class(name).quantize is not None
    except UsageError:
        return False
