"""The bucket layout: which bucket and slot each parameter's gradient goes to. One value, built whole and replaced
whole (at the rebuild after iteration 1, and while the tuner's choice is checked), never edited in place."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from gradsync import torch_private
from gradsync.reducer.buckets import AnyBucket, Bucket, assign_buckets, make_bucket, write_back
from gradsync.reducer.sparse_bucket import SparseBucket


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
            else make_bucket(k, group, params, self.as_view, next(slices))
            for k, group in enumerate(groups)
        ]
        self.bucket_index_of = [0] * len(params)
        self.slot_of = [0] * len(params)
        # Per parameter: the bound method that moves a large gradient in as soon as it is ready, or None for a small
        # one (gathered when its bucket fills).
        self.take_of: list[Callable[[int, int | None], None] | None] = [None] * len(params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self.bucket_index_of[i] = bucket.index
                self.slot_of[i] = slot
                self.take_of[i] = bucket.take if bucket.eager[slot] else None
        # Dense buckets in order, flattened: their write-back is one fused copy over these.
        self.dense = [b for b in self.buckets if isinstance(b, Bucket)]
        self.sparse_buckets = [b for b in self.buckets if isinstance(b, SparseBucket)]
        self._flat_params = [p for b in self.dense for p in b.params]
        self._flat_views = [v for b in self.dense for v in b.views]
        self._flat_indices = [i for b in self.dense for i in b.param_indices]
        self._quiet: list[Bucket] = []  # the buckets with quiet parameters (quiet_hooks)

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

    def quiet_hooks(self, ready_order: Sequence[int]) -> dict[int, Bucket]:
        """Per bucket, the parameters whose hook the last-ready one stands for (:func:`quiet_parameters`), each with
        its bucket: the reducer makes their hooks ``bucket.heard.append``. With gradient_as_bucket_view the large
        ones keep their hooks, which move each gradient into its slot as it is ready and so free its memory."""
        quiet: dict[int, Bucket] = {}
        for bucket in self.dense:
            quiet.update(dict.fromkeys(bucket.stand_for_quiet(ready_order, include_eager=not self.as_view), bucket))
        self._quiet = [b for b in self.dense if b.quiet]
        return quiet

    def speak_up(self) -> None:
        """Every parameter reports through its own hook again."""
        for bucket in self._quiet:
            bucket.speak_up()
        self._quiet = []

    def clear_heard(self) -> None:
        """A new backward starts: no quiet parameter has fired yet (its hook appends to its bucket's list)."""
        for bucket in self._quiet:
            bucket.heard.clear()

    def heard(self) -> set[int]:
        """The quiet parameters that fired since :meth:`clear_heard`, as indices (for error messages)."""
        return {i for b in self._quiet for i in set(b.quiet).difference(b.unheard())}

    def write_back(self, globally_used: list[int] | None, scale: float) -> None:
        """Every bucket's averages, times ``scale``, into ``.grad`` (one fused copy in the common case)."""
        if scale != 1.0:
            torch_private.foreach_mul_([b.buffer for b in self.dense], scale)
        write_back(globally_used, self._flat_params, self._flat_views, self._flat_indices, self.as_view)
        for bucket in self.sparse_buckets:
            bucket.write_back(scale)

    def write_back_bucket(self, bucket: AnyBucket, scale: float, lend: bool) -> None:
        """One bucket's averages into its parameters' ``.grad`` (when each bucket is handed on as it lands);
        ``lend``: its large slots may be lent to ``.grad`` instead of copied (:mod:`.lending`)."""
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


# Per (dtype, device): one flat tensor that every dense bucket of a layout is a slice of. Its size is the
# parameters' and not the bucketing's, so a rebuilt layout (and each of the tuner's trial layouts) can take over the
# one it replaces instead of allocating another copy of the gradients.
Storage = dict[tuple[torch.dtype, torch.device], torch.Tensor]


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
