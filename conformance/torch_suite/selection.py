"""Which tests of ``DistributedTest._DistTestBase`` exercise DDP (the rule is in the package docstring)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path

DDP_REFERENCE = re.compile(r"\bDistributedDataParallel\b")
# The names the brief suggested; only a cross-check of the source rule (see `keyword_only`).
DDP_KEYWORDS = re.compile(
    r"ddp|distributeddataparallel|join|sync_?batch_?norm|sync_bn|grad_is_view|static_graph|comm_hook|bucket"
    r"|unused|zero_redundancy|no_sync|localsgd",
    re.IGNORECASE,
)


def distributed_test_path() -> Path:
    spec = importlib.util.find_spec("torch")  # finds the installed torch without importing it
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("torch is not installed")
    return Path(spec.origin).parent / "testing" / "_internal" / "distributed" / "distributed_test.py"


@cache
def _base_class_methods() -> tuple[str, dict[str, ast.FunctionDef]]:
    source = distributed_test_path().read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "_DistTestBase":
            methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
            return source, methods
    raise LookupError("DistributedTest._DistTestBase not found in distributed_test.py")


@cache
def _self_calls(method: str) -> frozenset[str]:
    _source, methods = _base_class_methods()
    return frozenset(
        node.attr
        for node in ast.walk(methods[method])
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and node.attr in methods
    )


def reached_methods(test: str) -> set[str]:
    """The test and every ``self.<method>`` of the base class it reaches, transitively."""
    seen, todo = {test}, [test]
    while todo:
        for callee in _self_calls(todo.pop()):
            if callee not in seen:
                seen.add(callee)
                todo.append(callee)
    return seen


@cache
def _source_lines() -> list[str]:
    return _base_class_methods()[0].splitlines()


@cache
def _mentions_ddp(method: str) -> bool:
    node = _base_class_methods()[1][method]
    text = "\n".join(_source_lines()[node.lineno - 1 : node.end_lineno])
    return bool(DDP_REFERENCE.search(text))


def uses_ddp(test: str) -> bool:
    return any(_mentions_ddp(m) for m in reached_methods(test))


def base_tests() -> list[str]:
    """Test methods as written in the source (parametrized ones before instantiation)."""
    _source, methods = _base_class_methods()
    return [name for name in methods if name.startswith("test_")]


def ddp_base_tests() -> list[str]:
    return [name for name in base_tests() if uses_ddp(name)]


def keyword_only() -> list[str]:
    """Tests whose name matches a DDP keyword but which never construct DDP (reported, not run)."""
    return [name for name in base_tests() if DDP_KEYWORDS.search(name) and not uses_ddp(name)]


def runtime_test_names() -> list[str]:
    """The test methods unittest sees, after ``instantiate_parametrized_tests``."""
    os.environ.setdefault("BACKEND", "gloo")
    os.environ.setdefault("WORLD_SIZE", "2")
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    return sorted(name for name in dir(DistributedTest._DistTestBase) if name.startswith("test_"))


def base_of(runtime_name: str, bases: Iterable[str]) -> str | None:
    """The source test a runtime name was instantiated from: itself, or the longest ``<base>_...`` prefix."""
    candidates = [b for b in bases if runtime_name == b or runtime_name.startswith(b + "_")]
    return max(candidates, key=len, default=None)


def select(substrings: list[str] | None = None) -> dict[str, str]:
    """Selected runtime test names -> their source test, filtered by any of ``substrings`` (case-insensitive)."""
    ddp_bases = ddp_base_tests()
    all_bases = base_tests()
    selected: dict[str, str] = {}
    for name in runtime_test_names():
        base = base_of(name, all_bases)
        if base in ddp_bases and _matches(name, substrings):
            selected[name] = base
    return selected


def _matches(name: str, substrings: list[str] | None) -> bool:
    return not substrings or any(s.lower() in name.lower() for s in substrings)
