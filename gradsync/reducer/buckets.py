"""Bucket assignment (pure) and the flat Bucket that holds one group of gradients.

Li et al. (VLDB 2020, section 3.2.3): all-reducing many small tensors is far slower than a few large ones, so
gradients are packed into flat buffers ("buckets") of about ``bucket_cap_mb`` each and reduced together.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

from gradsync import torch_private
from gradsync.reducer.lending import lend
from gradsync.reducer.sparse_bucket import SparseBucket

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25.0
# torch's dist._DEFAULT_FIRST_BUCKET_BYTES: the first-launched bucket is small so communication starts early.
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB
# Gradients at least this large are copied into the bucket as soon as they are ready (spreading the copying over
# backward, so the bucket launches right after its last gradient); smaller ones are copied together, in one fused
# copy when the bucket is full (a copy call per tiny gradient would cost more than the copying).
EAGER_COPY_NUMEL = 4096


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


def order_in_bucket(param_indices: list[int], params: Sequence[torch.Tensor]) -> tuple[list[int], int, int]:
    """The bucket's members in buffer order, with how many are large and how many of the small ones are vectors.

    Large gradients first, then all the small ones side by side at the end of the buffer, so the small ones are
    divided by a single kernel over one range, not a kernel launch per tensor; among those, vectors (biases, norm
    weights) first, so that one torch.cat copies them in, cheaper for them than _foreach_copy_. Membership is what
    assign_buckets decided; only the order inside the bucket changes, identically on every rank.
    """
    large = [i for i in param_indices if params[i].numel() >= EAGER_COPY_NUMEL]
    small = [i for i in param_indices if params[i].numel() < EAGER_COPY_NUMEL]
    vectors = [i for i in small if params[i].dim() == 1]
    return large + vectors + [i for i in small if params[i].dim() != 1], len(large), len(vectors)


class Bucket:
    """One flat buffer and a shaped view of it for each of its parameters.

    gradient_as_bucket_view is the subclass (:func:`make_bucket`): :meth:`take` and :meth:`gather_grads`
    either make ``.grad`` the slot or copy into it, with no per-gradient test of the flag.
    """

    def __init__(
        self, index: int, param_indices: list[int], params: Sequence[torch.Tensor], buffer: torch.Tensor | None = None
    ) -> None:
        self.index = index
        self.assigned = list(param_indices)  # in launch-readiness order, as assign_buckets gave them (for messages)
        self.param_indices, n_large, n_vectors = order_in_bucket(param_indices, params)
        members = [params[i] for i in self.param_indices]
        self.params = members
        total = sum(p.numel() for p in members)
        # Uninitialised, as torch's bucket (at::empty): every slot is written before each reduction (a gradient, or
        # zeros for a parameter without one), so zero-filling would only touch the memory early.
        # ``buffer``, if given, is this bucket's slice of its layout's storage (see layout.Storage).
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
        # Parameters whose gradient hook only notes that it fired (see quiet_parameters): their hook is
        # ``self.heard.append``, a C function, so no Python frame runs for them; the last-ready parameter's hook
        # stands for them all, and :meth:`unheard` checks that they did fire. Bounded: the notes of backwards no
        # synced forward clears (a second wrapper of the same module training) cannot pile up.
        self.quiet: list[int] = []
        self.heard: collections.deque[torch.Tensor] = collections.deque(maxlen=0)
        self._quiet_eager: list[int] = []  # slots of quiet large gradients, copied in with the small ones
        self.quiet_params: list[torch.Tensor] = []
        self.eager = [p.numel() >= EAGER_COPY_NUMEL for p in members]
        self._n_large = n_large
        self._small_params = members[n_large:]
        self._small_views = self.views[n_large:]
        self._small_region = self.buffer[sum(p.numel() for p in members[:n_large]) :]
        self._n_vectors = n_vectors
        self._vector_region = self._small_region[: sum(p.numel() for p in members[n_large : n_large + n_vectors])]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def hooked_count(self) -> int:
        """How many of this bucket's parameters report through their own hook (all but the quiet ones)."""
        return len(self.param_indices) - len(self.quiet)

    def stand_for_quiet(self, order: Sequence[int], include_eager: bool) -> list[int]:
        """Let the last-ready parameter's hook (in the ready ``order``) stand for the others of this bucket (see
        :func:`quiet_parameters`); returns the quiet ones, whose hooks the reducer makes ``self.heard.append``.
        ``include_eager``: large gradients too, copied in when the bucket fills instead of as each is ready."""
        self.quiet = quiet_parameters(self, order, include_eager)
        self.heard = collections.deque(maxlen=len(self.quiet))
        slot = {i: s for s, i in enumerate(self.param_indices)}
        self._quiet_eager = [slot[i] for i in self.quiet if self.eager[slot[i]]]
        self.quiet_params = [self.params[slot[i]] for i in self.quiet]  # the tensors their hooks note
        return self.quiet

    def speak_up(self) -> None:
        """Every parameter reports through its own hook again (the ready order changed: :meth:`unheard`)."""
        self.quiet, self.heard, self._quiet_eager, self.quiet_params = [], collections.deque(maxlen=0), [], []

    def unheard(self) -> list[int]:
        """The quiet parameters whose gradient has not been accumulated since :attr:`heard` was last cleared.

        Autograd runs each parameter's hook once per backward, so when the count matches, every one of them has
        fired (the fast path: no per-parameter work). Otherwise the ready order changed: name the missing ones by
        identity, for the step to wait for them."""
        if len(self.heard) == len(self.quiet):
            return []
        heard = {id(t) for t in self.heard}
        return [i for i, p in zip(self.quiet, self.quiet_params) if id(p) not in heard]

    def receive(self, result: torch.Tensor) -> None:
        """The reduced values (a hook may return another tensor than the buffer it was given)."""
        if result.data_ptr() != self.buffer.data_ptr():
            self.buffer.copy_(result.view_as(self.buffer))

    # ``divisor`` (the world size, when gradsync itself averages): like torch's C++ reducer, gradients are averaged
    # on their way into the bucket (one pass over memory), not copied and then divided again in the hook, and with
    # torch's arithmetic: multiplied by 1 / divisor as they are copied, divided where one already is its slot
    # (``Reducer::mark_variable_ready_dense``), so that 3 or 7 ranks round as torch's DDP does.

    def take(self, slot: int, divisor: int | None) -> None:
        """One ready gradient into its slot: :meth:`_copy_grad` or :meth:`_adopt_grad`, as the subclass says."""
        raise NotImplementedError

    def lend_back(self) -> bool:
        """The averages into ``.grad``, the large ones by lending their slots (:mod:`.lending`), the small ones in
        one fused copy. False, with nothing done, where a parameter has no gradient (:func:`write_back` handles it)."""
        if any(p.grad is None for p in self.params):
            return False
        n = self._n_large
        lend(self.params[:n], self.views[:n])  # holding no .grad: lending counts who holds each
        if n < len(self.params):
            torch_private.foreach_copy_([p.grad for p in self._small_params], self._small_views)  # type: ignore[misc]
        return True

    def _gather(self, grads: list[torch.Tensor | None], divisor: int | None) -> None:
        raise NotImplementedError

    def _adopt_grad(self, slot: int, divisor: int | None) -> None:
        """gradient_as_bucket_view: move one fresh gradient into its slot and make ``.grad`` that slot, as soon as
        it is ready, so at most one extra gradient is alive at a time (as torch's reducer does)."""
        param, view = self.params[slot], self.views[slot]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            _move(grad, view, divisor)
            param.grad = view
        elif divisor:
            view.div_(divisor)

    def _copy_grad(self, slot: int, divisor: int | None) -> None:
        """Copy one parameter's gradient into its slot (zeros if it has none)."""
        grad = self.params[slot].grad
        if grad is None:
            self.views[slot].zero_()
        else:
            _move(grad, self.views[slot], divisor)

    def gather_grads(self, divisor: int | None) -> None:
        """Once the whole bucket is ready: the quiet large gradients into their slots, then all the small ones
        together, divided in one go."""
        for slot in self._quiet_eager:
            self.take(slot, divisor)
        if not self._small_params:
            return
        self._gather([p.grad for p in self._small_params], divisor)

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


class CopyBucket(Bucket):
    """``.grad`` and the bucket are separate tensors: gradients are copied in, averages copied back."""

    take = Bucket._copy_grad
    _gather = Bucket._gather_copies


class ViewBucket(Bucket):
    """gradient_as_bucket_view: ``.grad`` is the bucket's slot."""

    take = Bucket._adopt_grad
    _gather = Bucket._gather_into_views


def make_bucket(
    index: int,
    param_indices: list[int],
    params: Sequence[torch.Tensor],
    as_view: bool,
    buffer: torch.Tensor | None = None,
) -> Bucket:
    """A bucket whose view-or-copy choice is its class: chosen once, with no per-gradient test, and without the
    reference cycle a bound method kept on the bucket would make (its buffer would then wait for the garbage
    collector after a rebuild replaced the layout)."""
    return (ViewBucket if as_view else CopyBucket)(index, param_indices, params, buffer)


AnyBucket = Bucket | SparseBucket


def quiet_parameters(bucket: Bucket, order: Sequence[int], include_eager: bool) -> list[int]:
    """The parameters of ``bucket`` whose hook need not run Python once the ready ``order`` is known: all but the
    bucket's last-ready one (and, unless ``include_eager``, its large ones, which keep their hooks so that their
    copies spread over backward and, with gradient_as_bucket_view, free each gradient's memory as it is ready).

    Autograd's engine runs the same graph in the same order every time (AccumulateGrad nodes run as soon as they
    are ready, in a deterministic priority order), so once the bucket's last-ready parameter fires, every earlier
    one has usually accumulated its gradient: that one hook stands for the others, which only note that they fired
    (:meth:`Bucket.unheard` checks it, so a changed order costs a wait, never a wrong average). Saves one Python
    call per quiet parameter per backward.
    """
    position = {i: k for k, i in enumerate(order)}
    last = max(bucket.param_indices, key=position.__getitem__)
    return [i for i, eager in zip(bucket.param_indices, bucket.eager) if (include_eager or not eager) and i != last]


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
