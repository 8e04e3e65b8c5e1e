"""A process's own concerns: finding rank, world and backend and initialising the group (env.py), and a worker's side
of the launcher's watchdog (progress.py). The launchers live in gradsync/launch/, checkpoints in
gradsync/checkpoint.py."""

from gradsync.runtime.env import DistInfo, discover, init, shutdown

__all__ = ["DistInfo", "discover", "init", "shutdown"]
