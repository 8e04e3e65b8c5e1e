"""OverlappedOptimizer: step each bucket's parameters as soon as that bucket's average arrives.

After backward, plain DDP waits for the last all-reduce before ``optimizer.step()`` starts. Here the reducer hands
over each bucket as its average lands in ``.grad``, and that bucket's parameters are stepped while later buckets
are still on the wire. Each parameter has its own inner optimizer, so the result equals ``optimizer.step()``
after backward for optimizers that update every parameter from its own gradient and state (SGD, Adam, AdamW,
RMSprop...); not for those that look across parameters (LAMB's trust ratio over groups, global-norm clipping).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from gradsync import torch_private
from gradsync.errors import ConfigError
from gradsync.optim.saved_state import check_saved_state, prober
from gradsync.optim.sharded import require_optimizer_class, state_bytes
from gradsync.reducer.buckets import AnyBucket
from gradsync.validate import require_ddp


class OverlappedOptimizer(Optimizer):
    """Attach to a DDP model; ``backward()`` then also steps the optimizer, and :meth:`step` does nothing.

    Example::

        opt = OverlappedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)   # schedulers work on it as usual
        for x, y in loader:
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()   # each bucket's parameters are updated as its average arrives
            opt.step()                      # nothing left to do; kept so training loops need no change
            sched.step()
    """

    # GradScaler then hands its scale and found-inf flag to step() instead of unscaling the gradients itself, which
    # is how step() knows a scaler is in use (see _refuse_late_changes).
    _step_supports_amp_scaling = True

    def __init__(self, ddp: Any, optimizer_class: type[Optimizer], **defaults: Any) -> None:
        require_ddp("OverlappedOptimizer", ddp)
        require_optimizer_class("OverlappedOptimizer", optimizer_class)
        reducer = ddp.reducer
        params = list(reducer.params)
        super().__init__(params, defaults)
        self._inner = {p: optimizer_class([p], **defaults) for p in params}
        self._index = {p: i for i, p in enumerate(params)}
        self._stepped_versions: dict[torch.Tensor, int] = {}  # each .grad's version when it was stepped
        try:
            reducer.on_bucket_reduced(self._step_bucket)
        except ConfigError as error:
            raise ConfigError(f"OverlappedOptimizer: {error.message} Use a plain optimizer there.") from None

    @torch.no_grad()
    def _step_bucket(self, bucket: AnyBucket) -> None:
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        for p in bucket.params:
            inner = self._inner[p]
            inner.param_groups[0].update(hyper)  # learning-rate schedulers edit self.param_groups
            inner.step()
            if p.grad is not None:
                self._stepped_versions[p] = torch_private.grad_version(p.grad)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Nothing to do: backward already stepped every bucket. Returns the closure's loss if one is given.

        Refuses, by name, what would come too late: a ``GradScaler`` (the gradients it would unscale and check for
        inf were applied scaled, during backward) and gradients changed after backward (clipping, ``unscale_``)."""
        self._refuse_late_changes()
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None

    def _refuse_late_changes(self) -> None:
        if hasattr(self, "found_inf") or hasattr(self, "grad_scale"):  # set by GradScaler.step around step()
            raise ConfigError(
                "OverlappedOptimizer cannot be used with torch.amp.GradScaler: it steps each bucket inside "
                "backward, on the scaled gradients, before the scaler can unscale them or skip a step with inf. "
                "Use a plain optimizer with GradScaler (bf16 autocast needs no scaler)."
            )
        version = torch_private.grad_version
        changed = [p for p, v in self._stepped_versions.items() if p.grad is not None and version(p.grad) != v]
        self._stepped_versions.clear()
        if changed:
            raise ConfigError(
                f"OverlappedOptimizer: {len(changed)} gradient(s) were changed after backward (gradient clipping, "
                "GradScaler.unscale_ or another in-place edit), but each bucket was already stepped inside backward "
                "with the gradients as they arrived, so the change came too late. Use a plain optimizer when "
                "gradients are clipped or unscaled after backward."
            )

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (all of it: nothing is sharded)."""
        return state_bytes(s for inner in self._inner.values() for s in inner.state.values())

    def _hyperparameters(self) -> dict[str, Any]:
        """Every hyperparameter the class keeps (Adam's betas...), not only the ones given, as a plain
        ``optimizer_class``'s state dict has them; the values set on this optimizer's group win."""
        inner = [o.param_groups[0] for o in self._inner.values()][:1]
        return {k: v for g in (*inner, self.param_groups[0]) for k, v in g.items() if k != "params"}

    def state_dict(self) -> dict[str, Any]:
        """The state as one ``optimizer_class`` over all parameters would give it."""
        state = {}
        for p, inner in self._inner.items():
            own = inner.state_dict()["state"]
            if 0 in own:
                state[self._index[p]] = own[0]
        group = self._hyperparameters()
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self._index)))}]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (or from one ``optimizer_class`` over the same parameters), checked
        first: one saved by another model or another optimizer class is refused, and nothing is changed."""
        params = list(self._index)
        if params:
            probe = prober(type(self._inner[params[0]]), self.defaults)
            current = [self._hyperparameters()]
            state_dict = check_saved_state("OverlappedOptimizer.load_state_dict", state_dict, [params], probe, current)
        group = {k: v for k, v in state_dict["param_groups"][0].items() if k != "params"}
        self.param_groups[0].update(group)
        for p, inner in self._inner.items():
            i = self._index[p]
            own = {0: state_dict["state"][i]} if i in state_dict["state"] else {}
            inner.load_state_dict({"state": own, "param_groups": [{**group, "params": [0]}]})
