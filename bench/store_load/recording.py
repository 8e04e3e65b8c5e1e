"""A store that writes down every operation made through it: when, from which thread, which key, how long it
took. The real rank (``record_worker.py``) and every simulated one (``sim.py``) go through it, so their requests
are compared, and the latencies measured, by one piece of code."""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Op:
    """One store operation: ``start`` (monotonic seconds), ``seconds`` it took, the calling thread's name."""

    start: float
    seconds: float
    thread: str
    name: str
    key: str


class RecordingStore(dist.Store):
    """``inner``'s operations, each appended to ``ops`` (shared by the stores of one process: appends are atomic
    under the GIL)."""

    def __init__(self, inner: dist.Store, ops: list[Op]) -> None:
        super().__init__()
        self.inner = inner
        self.ops = ops

    def _timed(self, name: str, key: str, call):  # noqa: ANN001, ANN202 - any store method
        began = time.monotonic()
        try:
            return call()
        finally:
            self.ops.append(Op(began, time.monotonic() - began, threading.current_thread().name, name, key))

    def set(self, key: str, value: str | bytes) -> None:
        self._timed("set", key, lambda: self.inner.set(key, value))

    def get(self, key: str) -> bytes:
        return self._timed("get", key, lambda: self.inner.get(key))

    def add(self, key: str, amount: int) -> int:
        return self._timed("add", key, lambda: self.inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return self._timed("check", ",".join(keys), lambda: self.inner.check(keys))

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        return self._timed("compare_set", key, lambda: self.inner.compare_set(key, expected_value, desired_value))

    def delete_key(self, key: str) -> bool:
        return self._timed("delete_key", key, lambda: self.inner.delete_key(key))

    def num_keys(self) -> int:
        return self._timed("num_keys", "", self.inner.num_keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        call = (lambda: self.inner.wait(keys)) if timeout is None else (lambda: self.inner.wait(keys, timeout))
        self._timed("wait", ",".join(keys), call)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        super().set_timeout(timeout)
        self.inner.set_timeout(timeout)
