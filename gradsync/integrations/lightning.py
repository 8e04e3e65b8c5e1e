"""PyTorch Lightning: ``Trainer(strategy=GradsyncStrategy())`` and ``Fabric(strategy=GradsyncFabricStrategy())``.

Both are Lightning's own DDP strategies with one change: the model is wrapped in gradsync's DistributedDataParallel
instead of torch's. They take the same options as Lightning's ``DDPStrategy`` (``find_unused_parameters``,
``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``, ``ddp_comm_hook`` ... are passed through), plus
gradsync's own: ``monitor=True`` attaches a :class:`gradsync.observe.Monitor` (``strategy.monitor``), and bucket
tuning is on unless ``bucket_cap_mb`` is given, as with gradsync's DDP. Importing this module also registers the
names ``"gradsync"`` for the Trainer and for Fabric.

Lightning's DDP strategy tests ``isinstance(model, torch's DistributedDataParallel)`` in a few places; where that
matters (unwrapping at teardown, blocking gradient sync) these classes answer for gradsync's wrapper.

Example::

    import lightning as L
    from gradsync.integrations.lightning import GradsyncStrategy

    trainer = L.Trainer(strategy=GradsyncStrategy(), accelerator="cpu", devices=2, max_epochs=1)
    trainer.fit(model, loader)
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.nn import Module

from gradsync.ddp import DistributedDataParallel
from gradsync.errors import ConfigError
from gradsync.observe import Monitor
from gradsync.validate import require_bool


class GradsyncStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy``, wrapping the LightningModule in gradsync's DistributedDataParallel.

    Example::

        import lightning as L
        from gradsync.integrations.lightning import GradsyncStrategy

        strategy = GradsyncStrategy(find_unused_parameters=False, monitor=True)   # DDPStrategy's options, and a Monitor
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1)
        trainer.fit(model, loader)
    """

    strategy_name = "gradsync"

    def __init__(self, *args: Any, monitor: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._monitor_wanted = require_bool("GradsyncStrategy", "monitor", monitor)  # "false" would attach one
        self.monitor: Monitor | None = None

    def _setup_model(self, model: Module) -> DistributedDataParallel:  # type: ignore[override]
        wrapped = DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)
        if self._monitor_wanted:
            self.monitor = Monitor(wrapped)
        return wrapped

    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only (torch's old limit); gradsync's work on every device.
        if self._ddp_comm_hook is None:
            return
        hook = self._ddp_comm_hook if self._ddp_comm_wrapper is None else self._ddp_comm_wrapper(self._ddp_comm_hook)
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(self._ddp_comm_state, hook)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            raise ConfigError(
                "GradsyncStrategy supports automatic optimization; with manual optimization "
                "(automatic_optimization=False) use Lightning's strategy='ddp'."
            )

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module  # unwrap, as Lightning does for torch's wrapper
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Lightning's DDP with gradsync's DistributedDataParallel"
        )


class _GradsyncBackwardSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(
                f"Blocking backward sync needs a module wrapped by gradsync's DistributedDataParallel, got "
                f"{module.__class__.__name__}."
            )
        return module.no_sync()


class GradsyncFabricStrategy(FabricDDPStrategy):
    """Fabric's ``DDPStrategy``, wrapping modules in gradsync's DistributedDataParallel.

    Example::

        import lightning as L
        from gradsync.integrations.lightning import GradsyncFabricStrategy

        fabric = L.Fabric(strategy=GradsyncFabricStrategy(), accelerator="cpu", devices=2)  # or strategy="gradsync"
        fabric.launch()
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = dataset[:32]
        fabric.backward(loss_fn(model(x), y))
        optimizer.step()
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _GradsyncBackwardSyncControl()

    def setup_module(self, module: Module) -> DistributedDataParallel:  # type: ignore[override]
        return DistributedDataParallel(module=module, device_ids=self._determine_ddp_device_ids(), **self._ddp_kwargs)

    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return super().get_module_state_dict(module.module if isinstance(module, DistributedDataParallel) else module)

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        target = module.module if isinstance(module, DistributedDataParallel) else module
        super().load_module_state_dict(target, state_dict, strict=strict)


if GradsyncStrategy.strategy_name not in StrategyRegistry:
    GradsyncStrategy.register_strategies(StrategyRegistry)
if "gradsync" not in FABRIC_REGISTRY:
    FABRIC_REGISTRY.register("gradsync", GradsyncFabricStrategy, description="Fabric's DDP with gradsync's DDP")
