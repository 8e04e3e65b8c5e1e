"""Process-level concerns: environment discovery and group initialisation, the launcher, checkpoints."""

from gradsync.runtime.env import DistInfo, discover, init, shutdown

__all__ = ["DistInfo", "discover", "init", "shutdown"]
