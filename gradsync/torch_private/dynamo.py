"""dynamo's private names outside the compile seam itself (:mod:`gradsync.ddp.compiled`): importing it ahead, and
reading its ``optimize_ddp`` mode where each release keeps it."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def import_dynamo() -> None:
    """Import ``torch._dynamo`` now (a slow import), as torch's optimizers do at their first construction."""
    importlib.import_module("torch._dynamo")


def optimize_ddp_mode_reader() -> Callable[[], object]:
    """dynamo's reader of its ``optimize_ddp`` mode, where this release keeps it."""
    utils = importlib.import_module("torch._dynamo.utils")
    reader = getattr(utils, "get_optimize_ddp_mode", None)  # 2.7 and later
    if reader is None:
        reader = importlib.import_module("torch._dynamo.config")._get_optimize_ddp_mode  # 2.4 to 2.6
    if not callable(reader):
        raise AttributeError("get_optimize_ddp_mode is not callable")
    return reader  # type: ignore[no-any-return]


def optimize_ddp_mode() -> str:
    """dynamo's ``optimize_ddp`` mode ("ddp_optimizer" is the default and the only one that splits graphs), read
    where each release keeps it: ``torch._dynamo.utils.get_optimize_ddp_mode`` from 2.7.0 (checked to 2.13.0),
    ``torch._dynamo.config._get_optimize_ddp_mode`` in 2.4.0-2.6.0."""
    return str(optimize_ddp_mode_reader()())
