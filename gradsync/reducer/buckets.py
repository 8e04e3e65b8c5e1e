"""Where gradients live: the flat buckets, the layout that places each parameter's gradient in one, and how the
averages get back into ``.grad`` (copied, or lent).

Li et al. (VLDB 2020, section 3.2.3): all-reducing many small tensors is far slower than a few large ones, so
gradients are packed into flat buffers ("buckets") of about ``bucket_cap_mb`` each and reduced together. A layout is
one value, built whole and replaced whole (at the rebuild after iteration 1, and while the tuner's choice is
checked), never edited in place.

Write-back by lending: torch's C++ reducer (``gradient_as_bucket_view=False``) copies every averaged slot back into
``.grad`` (``Reducer::finalize_bucket_dense``), a second pass over every gradient byte. In the usual loop
``zero_grad()`` sets gradients to None (its default since torch 2.0), so each backward's ``.grad`` is a fresh tensor
that nothing else holds; then ``grad.set_(slot)`` gives the same tensor object the same values with no copy: the
slot is lent to it. A lent slot is the user's until they let go of it. Before the next synced backward writes into
the buckets, their storage must be held by nothing but the reducer's own views (:class:`Lending`); if a gradient, a
view, a DLPack export or the storage object of one is still held (``zero_grad(set_to_none=False)``, gradients kept
across steps, no_sync accumulating into the last step's), the buckets move to a storage of their own, once, and
averages are copied back from then on: torch's behaviour and torch's cost. Nothing is lent where the values could
differ from torch's: gradient_as_bucket_view (``.grad`` is the slot already), mixed precision, a gradient that
anything but its parameter holds, or whose memory anything else holds
(:func:`~gradsync.torch_private.storage.gradient_held_by_its_parameter_alone`), one that needs autograd
(``create_graph=True``), a tensor subclass, or a layout other than the slot's. Only what cannot be detected (a raw
``data_ptr()`` an extension keeps, a CUDA graph that captured the address) is left, and docs/migrating.md says to
turn lending off (``GRADSYNC_LENDING=0``) there.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence

import torch

from gradsync import torch_private
from gradsync.reducer.sparse_bucket import SparseBucket
from gradsync.torch_private.storage import (
    calibrate,
    can_count_storage_uses,
    gradient_held_by_its_parameter_alone,
    storage_holders,
)

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25.0
# torch's dist._DEFAULT_FIRST_BUCKET_BYTES: the first-launched bucket is small so communication starts early.
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB
# Gradients of at least this many bytes are copied into their bucket on their own, as soon as they are ready
# (spreading the copying over backward), and lent back; smaller ones are copied together when the bucket is full, in
# one fused copy and one scaling of their region. Below it, a call per tensor from Python costs more than the tensor's
# bytes, and checking whether a gradient may be lent its slot more than the copy it saves (docs/scaling.md, measured
# by ``python -m bench.scale.copy_calls``).
EAGER_COPY_BYTES = 128 * 1024


def assign_buckets(
    tensors: Sequence[torch.Tensor],
    order: Sequence[int],
    size_limits: Sequence[int],
    sparse: Sequence[bool] | None = None,
) -> list[list[int]]:
    """Group tensor indices, taken in ``order``, into buckets of one dtype and device each.

    Same rule as torch's ``_compute_bucket_assignment_by_size`` when given an explicit order: a bucket closes as
    soon as its byte size reaches its limit; the k-th bucket of a (dtype, device) uses ``size_limits[k]`` and all
    later ones the last limit. Buckets come out in the order they close (then the unfilled ones), which is the order
    they will be launched. A tensor whose gradient is sparse (``sparse[i]``) gets a bucket of its own, at its place
    in the order (torch's rule too).

    >>> ts = [torch.zeros(4), torch.zeros(4), torch.zeros(4)]
    >>> assign_buckets(ts, [2, 1, 0], [16, 1 << 20])
    [[2], [1, 0]]
    """
    if sorted(order) != list(range(len(tensors))):
        raise ValueError(f"order must be a permutation of range({len(tensors)}), got {list(order)}")
    if not size_limits or any(limit <= 0 for limit in size_limits):
        raise ValueError(f"size_limits must be positive byte counts, got {list(size_limits)}")
    open_buckets: dict[tuple, list[int]] = {}
    open_sizes: dict[tuple, int] = {}
    closed_count: dict[tuple, int] = {}
    result: list[list[int]] = []
    for i in order:
        if sparse is not None and sparse[i]:
            result.append([i])
            continue
        t = tensors[i]
        key = (t.dtype, t.device)
        open_buckets.setdefault(key, []).append(i)
        open_sizes[key] = open_sizes.get(key, 0) + t.numel() * t.element_size()
        limit = size_limits[min(closed_count.get(key, 0), len(size_limits) - 1)]
        if open_sizes[key] >= limit:
            result.append(open_buckets.pop(key))
            del open_sizes[key]
            closed_count[key] = closed_count.get(key, 0) + 1
    result.extend(b for b in open_buckets.values() if b)
    return result


def is_large(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient is copied in on its own as soon as it is ready (see :data:`EAGER_COPY_BYTES`)."""
    return param.numel() * param.element_size() >= EAGER_COPY_BYTES


def order_in_bucket(param_indices: list[int], params: Sequence[torch.Tensor]) -> tuple[list[int], int, int]:
    """The bucket's members in buffer order, with how many are large and how many of the small ones are vectors.

    Large gradients first, then all the small ones side by side at the end of the buffer, so the small ones are
    divided by a single kernel over one range, not a kernel launch per tensor; among those, vectors (biases, norm
    weights) first, so that one torch.cat copies them in, cheaper for them than _foreach_copy_. Membership is what
    assign_buckets decided; only the order inside the bucket changes, identically on every rank.
    """
    large = [i for i in param_indices if is_large(params[i])]
    small = [i for i in param_indices if not is_large(params[i])]
    vectors = [i for i in small if params[i].dim() == 1]
    return large + vectors + [i for i in small if params[i].dim() != 1], len(large), len(vectors)


class Bucket:
    """One flat buffer and a shaped view of it (a *slot*) for each of its parameters; ``as_view``:
    gradient_as_bucket_view, where ``.grad`` becomes the slot instead of being copied into it.

    ``buffer``, if given, is this bucket's slice of its layout's storage (see :data:`Storage`).
    """

    def __init__(
        self,
        index: int,
        param_indices: list[int],
        params: Sequence[torch.Tensor],
        as_view: bool = False,
        buffer: torch.Tensor | None = None,
    ) -> None:
        self.index = index
        self.as_view = as_view
        self.assigned = list(param_indices)  # in launch-readiness order, as assign_buckets gave them (for messages)
        self.param_indices, n_large, n_vectors = order_in_bucket(param_indices, params)
        members = [params[i] for i in self.param_indices]
        self.params = members
        total = sum(p.numel() for p in members)
        # Uninitialised, as torch's bucket (at::empty): every slot is written before each reduction (a gradient, or
        # zeros for a parameter without one), so zero-filling would only touch the memory early.
        if buffer is None:
            buffer = torch.empty(total, dtype=members[0].dtype, device=members[0].device)
        if buffer.numel() != total:
            raise ValueError(f"bucket {index}: a buffer of {buffer.numel()} values for {total} gradient values")
        self.buffer = buffer
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in members:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.n_large = n_large  # slots [0, n_large) are large: taken one by one as they are ready
        self._small_params = members[n_large:]
        self._small_views = self.views[n_large:]
        self._small_region = self.buffer[sum(p.numel() for p in members[:n_large]) :]
        self._n_vectors = n_vectors
        self._vector_region = self._small_region[: sum(p.numel() for p in members[n_large : n_large + n_vectors])]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    # ------------------------------------------------------------------------------------------ gradients in
    # ``divisor`` (the world size, when gradsync itself averages): like torch's C++ reducer, gradients are averaged
    # on their way into the bucket, not copied and then divided again in the hook, and with torch's arithmetic:
    # multiplied by 1 / divisor as they are copied, divided where one already is its slot
    # (``Reducer::mark_variable_ready_dense``), so that 3 or 7 ranks round as torch's DDP does.

    def take(self, slot: int, divisor: int | None) -> None:
        """One large gradient into its slot, as soon as it is ready (zeros if it has none)."""
        param, view = self.params[slot], self.views[slot]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif not self.as_view:
            _move(grad, view, divisor)
        elif grad.data_ptr() != view.data_ptr():
            # gradient_as_bucket_view: .grad becomes the slot as soon as it is ready, so at most one extra gradient
            # is alive at a time (as torch's reducer does).
            _move(grad, view, divisor)
            param.grad = view
        elif divisor:
            view.div_(divisor)

    def gather(self, divisor: int | None, large_slots: Sequence[int] = ()) -> None:
        """Once the whole bucket is ready: the large gradients whose hooks were quiet (``large_slots``) into their
        slots, then all the small ones together, divided in one go."""
        for slot in large_slots:
            self.take(slot, divisor)
        if not self._small_params:
            return
        grads = [p.grad for p in self._small_params]
        if self.as_view:
            self._gather_into_views(grads, divisor)
        else:
            self._gather_copies(grads, divisor)

    def _gather_into_views(self, grads: list[torch.Tensor | None], divisor: int | None) -> None:
        # gradient_as_bucket_view: gradients already in their slot stay, the others are copied and .grad becomes the
        # slot; the small gradients' extra memory is held until the bucket fills, not one at a time.
        params, views = self._small_params, self._small_views
        moving = [k for k, g in enumerate(grads) if g is not None and g.data_ptr() != views[k].data_ptr()]
        if moving:
            torch_private.foreach_copy_([views[k] for k in moving], [grads[k] for k in moving])  # type: ignore[misc]
        for k in moving:
            params[k].grad = views[k]
        for k in (k for k, g in enumerate(grads) if g is None):
            views[k].zero_()
        if not divisor:
            return
        if not moving:  # the steady state: every small gradient already is its slot (one kernel over the region)
            self._small_region.div_(divisor)
        elif len(moving) == len(grads):
            self._small_region.mul_(1.0 / divisor)
        else:
            moved = set(moving)
            torch_private.foreach_mul_([views[k] for k in moving], 1.0 / divisor)
            for k in (k for k in range(len(grads)) if k not in moved):
                views[k].div_(divisor)

    def _gather_copies(self, grads: list[torch.Tensor | None], divisor: int | None) -> None:
        views = self._small_views
        if any(g is None for g in grads):
            for grad, view in zip(grads, views):
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
        else:
            k = self._n_vectors if self._n_vectors > 1 else 0  # a lone vector goes with the rest
            if k:
                torch.cat(grads[:k], out=self._vector_region)  # type: ignore[arg-type]
            if k < len(grads):
                torch_private.foreach_copy_(views[k:], grads[k:])  # type: ignore[arg-type]
        if divisor:
            self._small_region.mul_(1.0 / divisor)

    # ----------------------------------------------------------------------------------------- averages out
    def receive(self, result: torch.Tensor) -> None:
        """The reduced values (a hook may return another tensor than the buffer it was given)."""
        if result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result.view_as(self.buffer))

    def lend_back(self) -> bool:
        """The averages into ``.grad``, the large ones by lending their slots, the small ones in one fused copy.
        False, with nothing done, where a parameter has no gradient (:func:`write_back` handles it)."""
        small = [p.grad for p in self._small_params]
        if any(g is None for g in small) or any(p.grad is None for p in self.params[: self.n_large]):
            return False
        lend(self.params[: self.n_large], self.views[: self.n_large])  # holds no .grad: lending counts who holds each
        if small:
            torch_private.foreach_copy_(small, self._small_views)  # type: ignore[arg-type]
        return True


AnyBucket = Bucket | SparseBucket


def _move(grad: torch.Tensor, view: torch.Tensor, divisor: int | None) -> None:
    if divisor:
        torch.mul(grad, 1.0 / divisor, out=view)
    else:
        view.copy_(grad)


def write_back(
    globally_used: list[int] | None,
    params: Sequence[torch.Tensor],
    views: Sequence[torch.Tensor],
    indices: Sequence[int],
    as_view: bool,
) -> None:
    """Put the averaged bucket values into ``.grad``: one fused copy in the common case. A parameter no rank used
    (``globally_used[i] == 0``) keeps its ``.grad`` untouched, as in torch; one without a ``.grad`` gets the slot
    (``as_view``, gradient_as_bucket_view) or a copy of it."""
    grads = [p.grad for p in params]
    if globally_used is None and all(g is not None for g in grads):
        # The common case, one fused copy; with gradient_as_bucket_view every .grad already is its slot.
        if not as_view:
            torch_private.foreach_copy_(grads, list(views))  # type: ignore[arg-type]
        return
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for param, grad, view, i in zip(params, grads, views, indices):
        if globally_used is not None and not globally_used[i]:
            continue  # torch leaves .grad untouched when no rank used the parameter
        if grad is None:
            param.grad = view if as_view else view.to(param.dtype, copy=True)  # upcast under mixed precision
        elif grad.data_ptr() != view.data_ptr():
            targets.append(grad)
            sources.append(view)
    if targets:
        torch_private.foreach_copy_(targets, sources)


# ---------------------------------------------------------------------------------------------------- the layout
# Per (dtype, device): one flat tensor that every dense bucket of a layout is a slice of. Its size is the
# parameters' and not the bucketing's, so a rebuilt layout (and each of the tuner's trial layouts) can take over the
# one it replaces instead of allocating another copy of the gradients.
Storage = dict[tuple[torch.dtype, torch.device], torch.Tensor]


class BucketLayout:
    """Buckets for ``params`` taken in ``order`` under byte ``limits``; ``as_view``: gradient_as_bucket_view.

    >>> layout = BucketLayout([torch.zeros(4), torch.zeros(4)], order=[1, 0], limits=[16, 1 << 20], as_view=False)
    >>> [b.param_indices for b in layout.buckets]
    [[1], [0]]
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        order: Sequence[int],
        limits: Sequence[int],
        as_view: bool,
        sparse: Sequence[bool] | None = None,
        storage: Storage | None = None,
        reverse: bool = False,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        self.limits = list(limits)
        # Mixed precision: the buckets hold grad_dtype (the reduce dtype); .grad keeps its parameter's dtype, so it
        # is never a slot (no gradient_as_bucket_view, no lending) and averages are copied back, upcast.
        self.grad_dtype = grad_dtype
        self.casts = grad_dtype is not None and any(p.dtype != grad_dtype for p in params)
        self.as_view = as_view and not self.casts
        self.sparse = sparse
        self._params, self._order, self._reverse = params, list(order), reverse  # for moved()
        groups = assign_buckets(params, order, self.limits, sparse)
        if reverse:  # torch's initial assignment: sorted by first parameter, then reversed (see first())
            groups = sorted(groups, key=min)[::-1]
        dense = [group for group in groups if not (sparse and sparse[group[0]])]
        self.storage = _storage_for(params, dense, None if self.as_view else storage, grad_dtype)
        slices = _slices(params, dense, self.storage, grad_dtype)
        self.buckets: list[AnyBucket] = [
            SparseBucket(k, group[0], params)
            if sparse and sparse[group[0]]
            else Bucket(k, group, params, self.as_view, next(slices))
            for k, group in enumerate(groups)
        ]
        # Where parameter i's gradient goes: bucket_of[i], slot_of[i]; large_of[i]: whether it is copied in alone.
        self.bucket_of = [0] * len(params)
        self.slot_of = [0] * len(params)
        self.large_of = [False] * len(params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self.bucket_of[i], self.slot_of[i] = bucket.index, slot
                self.large_of[i] = slot < bucket.n_large  # a sparse bucket's one parameter is large
        # Dense buckets in order, flattened: their write-back is one fused copy over these.
        self.dense = [b for b in self.buckets if isinstance(b, Bucket)]
        self.sparse_buckets = [b for b in self.buckets if isinstance(b, SparseBucket)]
        self._flat_params = [p for b in self.dense for p in b.params]
        self._flat_views = [v for b in self.dense for v in b.views]
        self._flat_indices = [i for b in self.dense for i in b.param_indices]
        self.large_params = [p for b in self.dense for p in b.params[: b.n_large]]  # those whose slots may be lent

    @classmethod
    def first(
        cls,
        params: Sequence[torch.Tensor],
        limits: Sequence[int],
        as_view: bool,
        sparse: Sequence[bool] | None,
        grad_dtype: torch.dtype | None = None,
    ) -> BucketLayout:
        """Iteration 1's layout, as torch builds it (``DistributedDataParallel._ddp_init_helper``): parameters
        bucketed in registration order, the buckets sorted by their first parameter and then reversed, so the
        bucket of the last-registered parameters (whose gradients are guessed to be ready first) is launched first.
        Inside a bucket the parameters stay in registration order. Each gradient's place in its bucket decides the
        order in which a ring all-reduce of three or more ranks adds it up, so the layout is part of bit-for-bit
        parity with torch's DDP.

        >>> [b.param_indices for b in BucketLayout.first([torch.zeros(4)] * 3, [16, 1 << 20], False, None).buckets]
        [[1, 2], [0]]
        """
        return cls(params, range(len(params)), limits, as_view, sparse, reverse=True, grad_dtype=grad_dtype)

    def __len__(self) -> int:
        return len(self.buckets)

    def adopt_current_grads(self) -> None:
        """gradient_as_bucket_view: keep the gradients accumulated so far, but from now on ``.grad`` is the slot."""
        if not self.as_view:
            return
        for bucket in self.dense:
            for view, param in zip(bucket.views, bucket.params):
                if param.grad is not None:
                    view.copy_(param.grad)
                    param.grad = view

    def write_back(self, globally_used: list[int] | None, scale: float) -> None:
        """Every bucket's averages, times ``scale``, into ``.grad`` (one fused copy in the common case)."""
        if scale != 1.0:
            torch_private.foreach_mul_([b.buffer for b in self.dense], scale)
        write_back(globally_used, self._flat_params, self._flat_views, self._flat_indices, self.as_view)
        for bucket in self.sparse_buckets:
            bucket.write_back(scale)

    def write_back_bucket(self, bucket: AnyBucket, scale: float, lend: bool) -> None:
        """One bucket's averages into its parameters' ``.grad`` (when each bucket is handed on as it lands);
        ``lend``: its large slots may be lent to ``.grad`` instead of copied."""
        if isinstance(bucket, SparseBucket):
            bucket.write_back(scale)
            return
        if scale != 1.0:
            bucket.buffer.mul_(scale)
        if lend and bucket.lend_back():
            return
        write_back(None, bucket.params, bucket.views, bucket.param_indices, self.as_view)

    def moved(self) -> BucketLayout:
        """The same buckets on a storage of their own (the present one stays with whoever holds lent slots)."""
        return BucketLayout(
            self._params, self._order, self.limits, self.as_view, self.sparse, None, self._reverse, self.grad_dtype
        )


def _storage_for(
    params: Sequence[torch.Tensor], dense: list[list[int]], reuse: Storage | None, grad_dtype: torch.dtype | None
) -> Storage:
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for group in dense:
        for i in group:
            key = (grad_dtype or params[i].dtype, params[i].device)
            sizes[key] = sizes.get(key, 0) + params[i].numel()
    if reuse is not None and {k: t.numel() for k, t in reuse.items()} == sizes:
        return reuse
    return {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}


def _slices(
    params: Sequence[torch.Tensor], dense: list[list[int]], storage: Storage, grad_dtype: torch.dtype | None
) -> Iterator[torch.Tensor]:
    """Each dense bucket's buffer, in order: consecutive slices of its dtype's and device's storage."""
    offsets = dict.fromkeys(storage, 0)
    for group in dense:
        key = (grad_dtype or params[group[0]].dtype, params[group[0]].device)
        n = sum(params[i].numel() for i in group)
        yield storage[key][offsets[key] : offsets[key] + n]
        offsets[key] += n


# --------------------------------------------------------------------------------------------------- lending
class LendingChoice(enum.Enum):
    LEND = "the buckets' storage is free: this step lends its large slots to .grad"
    COPY = "averages are copied back (before the rebuild, gradient_as_bucket_view, or after a move)"
    MOVE = "a lent slot is still held: the buckets move to a storage of their own, and copy back from now on"


class Lending:
    """One reducer's lending: the baseline its buckets' storage counts with nothing lent, and whether it has
    given up (a loan still held once). ``enabled=False`` (``GRADSYNC_LENDING=0``) copies back from the start."""

    def __init__(self, enabled: bool = True) -> None:
        self._baseline: list[tuple[int, int]] | None = None
        self._gave_up = not enabled or not can_count_storage_uses()
        if not self._gave_up:
            calibrate()

    def before_step(self, storage: Sequence[torch.Tensor]) -> LendingChoice:
        """Before a synced backward writes into ``storage`` (the final layout's, after the rebuild): lend again,
        or move off a storage that someone still holds."""
        if self._gave_up or not storage:
            return LendingChoice.COPY
        uses = [storage_holders(t) for t in storage]
        if self._baseline is None:
            self._baseline = uses  # nothing was lent from this storage yet: the reducer's own views alone
            return LendingChoice.LEND
        if uses == self._baseline:
            return LendingChoice.LEND
        self._gave_up = True
        return LendingChoice.MOVE


def lend(params: Sequence[torch.Tensor], slots: Sequence[torch.Tensor]) -> None:
    """Each parameter's ``.grad`` gets its averaged slot: lent where the gradient and its memory are the parameter's
    alone and its layout the slot's, copied otherwise (torch's copy, seen by every alias). Holds no reference to a
    gradient while it asks who holds it: ``grad.set_(slot)`` lets go of the gradient's own memory, so anything that
    still read it would read freed memory."""
    for param, slot in zip(params, slots):
        if _lendable(param):
            param.grad.set_(slot)  # type: ignore[union-attr, call-overload]
        else:
            param.grad.copy_(slot)  # type: ignore[union-attr]


def _lendable(param: torch.Tensor) -> bool:
    grad = param.grad
    plain = type(grad) is torch.Tensor and not grad.requires_grad and grad.is_contiguous()
    del grad  # counted by who holds it, below
    return plain and gradient_held_by_its_parameter_alone(param)
