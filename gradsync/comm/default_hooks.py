"""torch's default communication hooks, re-exported: they run unchanged on gradsync's :class:`GradBucket`.

``allreduce_hook`` (divide by the world size, then sum), ``fp16_compress_hook`` / ``bf16_compress_hook`` (the same
in half precision, half the bytes on the wire) and the ``*_compress_wrapper`` forms (compress around any other hook)
are torch's own functions (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``). They call only
``GradBucket``'s public methods, which gradsync's bucket has with torch's meanings, and under ``torch.compile`` they
switch to functional collectives themselves; ``tests/test_comm_hooks.py`` runs each on gradsync's DDP against
torch's DDP. So gradsync does not write them again.

Example::

    ddp.register_comm_hook(None, gradsync.comm.bf16_compress_hook)
"""

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]
