"""Read a CosyVoice model's yaml (``cosyvoice2.yaml``) as data, never as code.

Upstream loads these files with hyperpyyaml, whose tags import and call Python objects
(``!new:module.Class``, ``!name:module.func``, ``!apply:func``). A model directory is untrusted
input, so here every tag becomes plain data: ``!new:`` and ``!name:`` become a :class:`Call`
naming the target and holding its arguments, ``!apply:`` entries are dropped (upstream uses them to
seed random generators), and ``!ref <key>`` is resolved against the file's own keys, with simple
arithmetic (``!ref <a> * <b>``) evaluated by a small parser of our own.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class Call:
    """A ``!new:target`` or ``!name:target`` node: what upstream would construct, and with what."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    args: list[Any] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.target.rsplit(".", 1)[-1]


@dataclass
class _Ref:
    expr: str


class _Apply:
    """Marker for ``!apply:`` nodes, which are dropped."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that turns hyperpyyaml tags into data."""


def _call(loader: _Loader, suffix: str, node: yaml.Node) -> Call:
    if isinstance(node, yaml.MappingNode):
        return Call(suffix, kwargs=loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Call(suffix, args=loader.construct_sequence(node, deep=True))
    value = loader.construct_scalar(node)
    return Call(suffix, args=[value] if value not in ("", None) else [])


def _apply(loader: _Loader, suffix: str, node: yaml.Node) -> _Apply:
    return _Apply()


def _ref(loader: _Loader, node: yaml.Node) -> _Ref:
    return _Ref(str(loader.construct_scalar(node)))


_Loader.add_multi_constructor("!new:", _call)
_Loader.add_multi_constructor("!name:", _call)
_Loader.add_multi_constructor("!apply:", _apply)
_Loader.add_constructor("!ref", _ref)
_Loader.add_constructor("!copy", _ref)

_REF = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)((?:\[[^\]]+\])*)>")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
# Bounds for untrusted files: no arithmetic blow-up, no billion-laughs expansion through references.
_MAX_NUMBER = 1e15
_MAX_NODES = 100_000


def _arith(node: ast.AST) -> float | int:
    """Evaluate a parsed expression made only of numbers, + - * / // % and parentheses."""
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _arith(node.left), _arith(node.right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise ValueError("division by zero")  # one wording for / // %, and not a ZeroDivisionError
        value = _OPS[type(node.op)](left, right)
        if abs(value) > _MAX_NUMBER:
            raise ValueError(f"a value over {_MAX_NUMBER:g}")
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _arith(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("only numbers and + - * / // % are allowed")


def _shown(text: str, limit: int = 500) -> str:
    """An expression quoted in an error message, cut so that a runaway one cannot flood the log."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "…"


class _Resolver:
    def __init__(self, root: dict[str, Any]):
        self.root = root
        self.active: set[str] = set()
        self.done: dict[str, Any] = {}  # each key resolved once, however often it is referenced
        self.nodes = 0

    def lookup(self, name: str, subscripts: str) -> Any:
        if name not in self.root:
            raise ValueError(f"!ref <{name}> names no top-level key")
        if name in self.active:
            raise ValueError(f"!ref <{name}> refers to itself")
        if name not in self.done:
            self.active.add(name)
            try:
                self.done[name] = self.resolve(self.root[name])
            finally:
                self.active.discard(name)
        value = self.done[name]
        for key in re.findall(r"\[([^\]]+)\]", subscripts):
            key = key.strip("'\"")
            value = value[int(key)] if isinstance(value, list) else value[key]
        return value

    def expr(self, text: str) -> Any:
        refs = list(_REF.finditer(text))
        whole = refs and len(refs) == 1 and refs[0].group(0) == text.strip()
        if whole:
            return self.lookup(refs[0].group(1), refs[0].group(2))
        substituted = _REF.sub(lambda m: repr(self.lookup(m.group(1), m.group(2))), text)
        try:
            return _arith(ast.parse(substituted, mode="eval"))
        # A huge literal overflows a float (`!ref 1000...000 / 1`: ArithmeticError) and thousands of
        # nested operators exhaust the parser or the stack (MemoryError, RecursionError): each is a
        # broken file like any other, reported with the expression, not a crash.
        except (SyntaxError, ValueError, ArithmeticError) as exc:
            raise ValueError(f"cannot evaluate !ref {_shown(text)}: {exc}") from None
        except (RecursionError, MemoryError):
            raise ValueError(f"cannot evaluate !ref {_shown(text)}: nested too deeply") from None

    def resolve(self, value: Any) -> Any:
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            raise ValueError(f"more than {_MAX_NODES} values after resolving references")
        if isinstance(value, _Ref):
            return self.expr(value.expr)
        if isinstance(value, Call):
            return Call(value.target, self.resolve(value.kwargs), self.resolve(value.args))
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items() if not isinstance(v, _Apply)}
        if isinstance(value, list):
            return [self.resolve(v) for v in value if not isinstance(v, _Apply)]
        return value


def load_yaml(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse a hyperpyyaml file into plain data with :class:`Call` nodes; never imports anything.

    ``overrides`` replace top-level keys before references are resolved (upstream passes
    ``qwen_pretrain_path`` this way).
    """
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path}: not valid YAML: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    raw = {k: v for k, v in raw.items() if not isinstance(v, _Apply)}
    raw.update(overrides or {})
    try:
        return _Resolver(raw).resolve(raw)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    except RecursionError:  # a chain of thousands of !ref, each naming the next
        raise ValueError(f"{path}: !ref references nested too deeply") from None


def expect(node: Any, *names: str, where: str) -> Call:
    """Check that ``node`` constructs one of the classes ``names`` (by class name) and return it."""
    if not isinstance(node, Call) or node.name not in names:
        found = node.target if isinstance(node, Call) else type(node).__name__
        raise ValueError(f"{where}: expected {' or '.join(names)}, found {found}; this model family is not supported")
    return node
