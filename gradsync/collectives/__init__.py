"""Every collective gradsync issues goes through :class:`Communicator` (named, numbered, desync-checked)."""

from gradsync.collectives.communicator import Communicator, Op
from gradsync.collectives.tensors import all_gather_shards, average_tensors, broadcast_tensors

__all__ = ["Communicator", "Op", "all_gather_shards", "average_tensors", "broadcast_tensors"]
