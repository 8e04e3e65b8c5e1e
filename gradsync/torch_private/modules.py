"""torch.nn's private names: the base class of torch's batch norms, and the module attribute torch's DDP reads for
the parameters and buffers to leave alone."""

from __future__ import annotations

from torch import nn

PARAMS_AND_BUFFERS_TO_IGNORE = "_ddp_params_and_buffers_to_ignore"  # torch DDP's module attribute; 2.4.0-2.13.0
BatchNormBase = nn.modules.batchnorm._BatchNorm  # torch's batch norms' base class; checked 2.4.0-2.13.0
