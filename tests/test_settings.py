"""Environment variables are parsed in one place and refused by name; gradsync's errors share one base class and
one prefix; the code base keeps its functions short."""

from __future__ import annotations

import ast
import pathlib

import pytest

import gradsync
from gradsync import settings
from gradsync.errors import CollectiveError, ConfigError, GradsyncError, ModelMismatchError


@pytest.mark.parametrize("text,value", [("1", True), ("ON", True), (" yes ", True), ("off", False), ("0", False)])
def test_booleans_accept_the_usual_spellings(text: str, value: bool) -> None:
    assert settings.read_bool("GRADSYNC_X", not value, {"GRADSYNC_X": text}) is value


def test_unset_or_empty_boolean_is_the_default() -> None:
    assert settings.read_bool("GRADSYNC_X", True, {}) is True
    assert settings.read_bool("GRADSYNC_X", False, {"GRADSYNC_X": ""}) is False


def test_unknown_boolean_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"GRADSYNC_DEBUG='maybe' is not a boolean"):
        settings.debug({"GRADSYNC_DEBUG": "maybe"})


@pytest.mark.parametrize("text", ["abc", "-5", "0", "inf", "nan"])
def test_bad_timeouts_are_refused_by_name(text: str) -> None:
    with pytest.raises(ConfigError, match="GRADSYNC_TIMEOUT="):
        settings.timeout_seconds(600.0, {"GRADSYNC_TIMEOUT": text})


def test_timeout_default_and_value() -> None:
    assert settings.timeout_seconds(600.0, {}) == 600.0
    assert settings.timeout_seconds(600.0, {"GRADSYNC_TIMEOUT": "2.5"}) == 2.5


def test_errors_share_one_base_and_one_prefix() -> None:
    error = CollectiveError("all-reduce of bucket 0 failed on rank 1")
    assert isinstance(error, GradsyncError) and isinstance(error, RuntimeError)
    assert str(error) == "gradsync: all-reduce of bucket 0 failed on rank 1"
    assert error.message == "all-reduce of bucket 0 failed on rank 1"
    assert isinstance(ModelMismatchError("x"), ValueError) and isinstance(ConfigError("x"), ValueError)
    assert gradsync.GradsyncError is GradsyncError


MAX_BODY_LINES = 40


def test_no_function_in_gradsync_is_longer_than_a_screen() -> None:
    too_long = []
    for path in sorted(pathlib.Path(gradsync.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) and len(node.body) > 1 else node.body
                lines = (node.end_lineno or node.lineno) - body[0].lineno + 1
                if lines > MAX_BODY_LINES:
                    too_long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not too_long, too_long


def test_a_timeout_too_long_to_represent_is_refused_by_name() -> None:
    """GRADSYNC_TIMEOUT=99999999999999 was accepted here and ended in OverflowError (days=1157407407) in init."""
    with pytest.raises(ConfigError, match=r"GRADSYNC_TIMEOUT='99999999999999': .* at most 1e\+09"):
        settings.timeout_seconds(600.0, {"GRADSYNC_TIMEOUT": "99999999999999"})
    assert settings.timeout_seconds(600.0, {"GRADSYNC_TIMEOUT": "86400"}) == 86400.0


def test_an_environ_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(ConfigError, match="environ must be a mapping of variable names to values, got list"):
        settings.debug(["GRADSYNC_DEBUG=1"])  # type: ignore[arg-type]
