"""Bucket assignment must equal torch's C++ rule (so identical settings give identical buckets), and a Bucket's
views must tile its flat buffer exactly."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from gradsync.reducer.backward import GradientHooks
from gradsync.reducer.buckets import EAGER_COPY_BYTES, Bucket, BucketLayout, assign_buckets, is_large
from gradsync.reducer.caps import size_limits


def _random_tensors(rng: random.Random, n: int) -> list[torch.Tensor]:
    dtypes = [torch.float32, torch.float32, torch.float16, torch.float64]
    return [torch.empty(rng.randint(1, 300), dtype=rng.choice(dtypes)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_same_buckets_as_torch_for_an_explicit_order(seed: int) -> None:
    rng = random.Random(seed)
    tensors = _random_tensors(rng, rng.randint(1, 40))
    order = list(range(len(tensors)))
    rng.shuffle(order)
    limits = sorted(rng.sample([64, 256, 1024, 4096, 10**9], k=rng.randint(1, 3)))
    ours = assign_buckets(tensors, order, limits)
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [tensors[i] for i in order], limits, [False] * len(order), order
    )
    theirs = [list(b) for b in theirs]
    # Buckets that reached their limit come out in the same (launch) order; the unfilled ones, one per dtype at
    # most, come last: torch lists those in hash-map order, we in order of first appearance (same on every rank).
    n_unfilled = len({tensors[i].dtype for i in order})
    assert ours[: len(ours) - n_unfilled] == theirs[: len(theirs) - n_unfilled]
    assert sorted(ours) == sorted(theirs)


def test_first_bucket_small_then_cap() -> None:
    tensors = [torch.empty(100) for _ in range(10)]  # 400 bytes each
    assert assign_buckets(tensors, list(range(9, -1, -1)), [400, 1200]) == [[9], [8, 7, 6], [5, 4, 3], [2, 1, 0]]


def test_dtypes_never_share_a_bucket() -> None:
    tensors = [torch.empty(4), torch.empty(4, dtype=torch.float64), torch.empty(4)]
    buckets = assign_buckets(tensors, [0, 1, 2], [10**9])
    assert sorted(buckets) == [[0, 2], [1]]


def test_order_must_be_a_permutation() -> None:
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets([torch.empty(1), torch.empty(1)], [0, 0], [10])


def test_bucket_views_tile_the_buffer() -> None:
    params = [
        torch.nn.Parameter(torch.randn(3, 4)),
        torch.nn.Parameter(torch.randn(5)),
        torch.nn.Parameter(torch.randn(2, 2)),
    ]
    bucket = Bucket(0, [2, 0], params)
    assert bucket.buffer.numel() == 4 + 12
    assert [v.shape for v in bucket.views] == [params[2].shape, params[0].shape]
    bucket.views[0].fill_(1.0)
    bucket.views[1].fill_(2.0)
    assert bucket.buffer.tolist() == [1.0] * 4 + [2.0] * 12


def test_a_gradient_is_large_from_the_bytes_where_a_copy_of_its_own_pays() -> None:
    # EAGER_COPY_BYTES, measured in docs/scaling.md: below it a fused copy per bucket is cheaper than a call each.
    assert EAGER_COPY_BYTES == 128 * 1024
    assert is_large(torch.empty(32 * 1024)) and not is_large(torch.empty(32 * 1024 - 1))
    assert is_large(torch.empty(64 * 1024, dtype=torch.bfloat16))  # bytes, not elements


def test_size_limits_default_explicit_and_auto() -> None:
    mib = 1 << 20
    assert size_limits(None) == [mib, 25 * mib]  # torch's default: small first bucket
    assert size_limits("auto") == [mib, 25 * mib]  # iteration 1 of the tuner starts from torch's default
    assert size_limits(4) == [4 * mib, 4 * mib]  # an explicit cap applies to the first bucket too, as in torch
    for bad in (0, -1, "fast", float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="bucket_cap_mb must be a finite number > 0"):
            size_limits(bad)


@pytest.mark.parametrize(
    "shapes",
    [
        [(256, 256), (8,)],  # one vector: copied with the rest
        [(256, 256), (8,), (5,), (3, 3), (64, 64)],  # vectors by torch.cat, the small matrices by _foreach_copy_
        [(8,), (5,), (2,)],  # vectors only
        [(3, 3), (2, 2)],  # no vectors
    ],
)
@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("missing", [False, True])
@pytest.mark.parametrize("quiet", [False, True])
def test_gather_puts_every_gradient_in_its_slot(shapes: list, as_view: bool, missing: bool, quiet: bool) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    if missing:
        params[-1].grad = None  # no gradient: its slot is zeroed
    # torch's arithmetic (Reducer::mark_variable_ready_dense): a gradient copied in is multiplied by 1 / world size,
    # bit for bit; 3 ranks is where that and a division round differently.
    expected = [None if p.grad is None else torch.mul(p.grad, 1.0 / 3) for p in params]
    bucket = Bucket(0, list(range(len(params))), params, as_view)
    # Quiet hooks: the large gradients wait for the gather too; otherwise each arrives alone, first.
    large = list(range(bucket.n_large))
    if not quiet:
        for slot in large:
            bucket.take(slot, 3)
    bucket.gather(3, large if quiet else ())
    for p, view in zip(bucket.params, bucket.views):
        want = expected[next(i for i, q in enumerate(params) if q is p)]
        assert torch.equal(view, torch.zeros_like(view) if want is None else want)
        if as_view and want is not None:
            assert p.grad.data_ptr() == view.data_ptr()  # .grad now lives in the bucket


def test_a_gradient_already_in_its_slot_is_divided_as_torch_divides_it() -> None:
    # gradient_as_bucket_view's steady state: .grad is the slot, and torch divides it in place (div_, not mul).
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    bucket = Bucket(0, [0, 1], params, as_view=True)
    for p in params:
        p.grad = torch.randn_like(p)
    bucket.gather(1)  # the first time: .grad moves into its slot
    values = [v.clone() for v in bucket.views]
    bucket.gather(3)
    assert all(torch.equal(v, w / 3) for v, w in zip(bucket.views, values))


def test_quiet_parameters_are_heard_by_count_and_named_by_identity_when_late() -> None:
    params = [torch.nn.Parameter(torch.randn(2)) for _ in range(4)]
    layout = BucketLayout(params, order=[0, 1, 2, 3], limits=[1 << 20], as_view=False)
    hooks = GradientHooks(params, lambda i: lambda _inputs, _outputs: None)
    hooks.quiet_down(layout, [3, 1, 0, 2])  # 2 is ready last: its hook stands for the others
    quiet = hooks.quiet_in(0)
    assert quiet is not None and sorted(quiet.indices) == [0, 1, 3]
    assert hooks.hooked_count(layout.buckets[0]) == 1
    for i in (3, 1, 0):
        quiet.heard.append(params[i])  # what their hooks do
    assert quiet.unheard() == []
    hooks.clear_heard()
    quiet.heard.append(params[3])  # the order changed: 0 and 1 are still to come
    assert sorted(quiet.unheard()) == [0, 1]
    for _ in range(100):  # backwards whose notes no synced forward clears (another wrapper training) do not pile up
        quiet.heard.append(params[0])
    assert len(quiet.heard) == 3
    hooks.hear_late([0, 1])
    hooks.speak_up_if_order_changed()
    assert hooks.quiet_in(0) is None and hooks.hooked_count(layout.buckets[0]) == 4
    hooks.close()


def test_a_quiet_hook_notes_its_parameter_and_runs_no_python() -> None:
    params = [torch.nn.Parameter(torch.randn(2)) for _ in range(3)]
    layout = BucketLayout(params, order=[0, 1, 2], limits=[1 << 20], as_view=False)
    fired: list[int] = []
    hooks = GradientHooks(params, lambda i: lambda _inputs, _outputs: fired.append(i))
    hooks.quiet_down(layout, [0, 1, 2])
    sum((p * 1).sum() for p in params).backward()
    quiet = hooks.quiet_in(0)
    assert fired == [2] and quiet is not None and quiet.unheard() == []  # 0 and 1 only noted
    hooks.close()
