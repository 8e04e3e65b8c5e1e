"""Pipeline parallelism with gradsync's data parallelism: torch.distributed.pipelining's stage for a stage module
wrapped in gradsync's DistributedDataParallel (change ``from torch.distributed.pipelining import PipelineStage`` to
this import; the schedules stay torch's). See :mod:`gradsync.pipelining.stage`."""

from gradsync.pipelining.stage import PipelineStage

__all__ = ["PipelineStage"]
