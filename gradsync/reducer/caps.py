"""Bucket caps, parsed once: what the user asked for, the byte limits iteration 1 buckets with, and whether the tuner
may choose others at the rebuild.

torch keeps ``bucket_cap_mb`` as ``bucket_bytes_cap`` (and ``bucket_cap_mb_list`` as ``bucket_bytes_cap_list``) and
its Reducer takes the byte caps. Here one :class:`BucketCaps` value, built at construction, feeds torch's two
attributes, the reducer's layout, the tuner and the cross-rank settings check, so none of them parses the
arguments again.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from gradsync import settings
from gradsync.errors import ConfigError
from gradsync.reducer import buckets  # its defaults are read at each call: the scaling lab scales them
from gradsync.reducer.buckets import MIB

Asked = float | str | Sequence[float] | None


@dataclass(frozen=True)
class BucketCaps:
    """``bucket_cap_mb`` / ``bucket_cap_mb_list`` and the tuning switch, parsed once.

    >>> caps = BucketCaps.parse(None, None, tuning=False, device_type="cpu")
    >>> caps.limits, caps.tune, caps.bytes_cap
    ((1048576, 26214400), False, 26214400)
    """

    asked: tuple[object, ...]  # (bucket_cap_mb, bucket_cap_mb_list) as given: every rank must agree on it
    limits: tuple[int, ...]  # byte limits of the first bucket, the second, ...; the last for all later ones
    tune: bool  # whether the tuner may propose other caps at the rebuild
    bytes_cap: int  # torch's bucket_bytes_cap
    bytes_cap_list: tuple[int, ...]  # torch's bucket_bytes_cap_list

    @classmethod
    def parse(
        cls, cap_mb: float | str | None, cap_list: Sequence[float] | None, tuning: bool | None, device_type: str
    ) -> BucketCaps:
        """``tuning``: the constructor's switch; None reads ``GRADSYNC_BUCKET_TUNING`` (on by default)."""
        chosen: Asked = list(cap_list) if cap_list else cap_mb
        limits = size_limits(chosen)
        # torch (_BucketCapacityConfig.create): the list's largest cap, else the cap, else 25 MiB.
        if cap_list:
            torch_cap = float(max(cap_list))
        else:
            torch_cap = buckets.DEFAULT_BUCKET_CAP_MB if cap_mb is None or isinstance(cap_mb, str) else float(cap_mb)
        return cls(
            asked=(cap_mb, tuple(cap_list) if cap_list else None),
            limits=tuple(limits),
            tune=tuning_enabled(chosen, device_type, tuning),
            bytes_cap=int(torch_cap * MIB),
            bytes_cap_list=tuple(int(c * MIB) for c in cap_list or ()),
        )

    def first_limits(self, rebuilds: bool) -> list[int]:
        """Iteration 1's limits, torch's (``_BucketCapacityConfig.compute_bucket_size_limits``, torch 2.13): where
        the buckets will be rebuilt in the observed order, iteration 1 has one bucket, since registration order need
        not be execution order and a bucket waiting on a late gradient would stall the ones after it; with a dynamic
        graph (never rebuilt) or a ``bucket_cap_mb_list``, the configured caps.

        >>> BucketCaps.parse(None, None, tuning=False, device_type="cpu").first_limits(rebuilds=True) == [sys.maxsize]
        True
        """
        if rebuilds and not self.bytes_cap_list:
            return [sys.maxsize]
        return list(self.limits)

    @property
    def is_default(self) -> bool:
        """torch's ``bucket_bytes_cap_default``: no cap given, so the first bucket is the small one."""
        return self.limits[0] < self.bytes_cap and not self.bytes_cap_list


def size_limits(bucket_cap_mb: Asked) -> list[int]:
    """Byte limits for the first bucket and the rest, from ``bucket_cap_mb``.

    None or ``"auto"``: torch's default, 25 MiB with a 1 MiB first bucket (small, so communication starts early);
    with ``"auto"`` (and None unless tuning is switched off) these are only iteration 1's limits and
    :mod:`gradsync.reducer.autotune` may choose others at the rebuild. A number: that many MiB for every bucket,
    first included (as torch does when a cap is given). A list (torch's ``bucket_cap_mb_list``): the k-th bucket's
    cap, the last one for all later buckets.

    >>> size_limits(None)
    [1048576, 26214400]
    """
    if bucket_cap_mb is None or bucket_cap_mb == "auto":
        return [buckets.DEFAULT_FIRST_BUCKET_BYTES, int(buckets.DEFAULT_BUCKET_CAP_MB * MIB)]
    if isinstance(bucket_cap_mb, Sequence) and not isinstance(bucket_cap_mb, str):
        if not bucket_cap_mb or not all(_is_cap(cap) for cap in bucket_cap_mb):
            raise ConfigError(
                f"bucket_cap_mb_list must hold finite caps > 0 (MiB per bucket), got {list(bucket_cap_mb)}"
            )
        return [max(int(cap * MIB), 1) for cap in bucket_cap_mb]
    if not _is_cap(bucket_cap_mb):
        raise ConfigError(
            f"bucket_cap_mb must be a finite number > 0 (MiB per bucket), None or 'auto', got {bucket_cap_mb!r}; "
            "for a single bucket holding every gradient pass a cap larger than the model, e.g. 1e6"
        )
    cap = max(int(float(bucket_cap_mb) * MIB), 1)  # type: ignore[arg-type]
    return [cap, cap]


def tuning_enabled(bucket_cap_mb: Asked, device_type: str = "cpu", switch: bool | None = None) -> bool:
    """``"auto"`` tunes; None (torch's default) tunes unless the switch (default ``GRADSYNC_BUCKET_TUNING``) is off,
    or the model is on a GPU; a number or a list never does.

    On a GPU the tuner times with CUDA events (:mod:`gradsync.observe.clock`), but neither its cost model nor its
    trial has been checked against measurement there yet, so it decides nothing by default: a CUDA model keeps
    torch's caps unless ``bucket_cap_mb="auto"`` asks for the tuner."""
    if bucket_cap_mb is None:
        on = settings.bucket_tuning() if switch is None else switch
        return on and device_type != "cuda"
    return bucket_cap_mb == "auto"


def _is_cap(cap: object) -> bool:
    return isinstance(cap, (int, float)) and not isinstance(cap, bool) and math.isfinite(cap) and cap > 0
