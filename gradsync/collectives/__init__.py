"""The one path for every collective gradsync issues: :class:`Communicator` (named, numbered, desync-checked:
communicator.py, desync.py), collectives over lists of tensors, byte-packed (tensors.py), each rank's failure
posted and read through the store (peer_errors.py), the default group looked up at each use (groups.py), and NCCL
collectives in flight named when one fails or hangs (nccl_watch.py)."""

from gradsync.collectives.communicator import Communicator, Op
from gradsync.collectives.tensors import all_gather_shards, average_tensors, broadcast_tensors

__all__ = ["Communicator", "Op", "all_gather_shards", "average_tensors", "broadcast_tensors"]
