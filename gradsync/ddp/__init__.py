"""The front of data parallelism: the DistributedDataParallel module (module.py) and what it is built from: its
constructor's arguments (arguments.py), the steps around each forward's call of the module (forward_steps.py) and
their collectives (forward_collectives.py), the buffers' broadcast (buffers.py), both sides of ``join()``
(join_protocol.py, join.py), the model checks across ranks (replicas.py), tensors in nested inputs and outputs
(tree.py), the ``torch.compile`` seam (compiled.py), and the mixed-precision policy (mixed_precision.py)."""

from gradsync.ddp.module import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
