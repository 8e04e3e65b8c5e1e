"""A process's own concerns: finding rank, world and backend and initialising the group (env.py), and a worker's side
of the launcher's watchdog (progress.py); and what the launchers and ``gradsync doctor`` share below them:
``gradsync run``'s flags and their rules (run_flags.py), ``HOST:PORT`` with IPv6 (endpoints.py), a TCPStore that
listens on one address (store_server.py). The launchers live in gradsync/launch/, checkpoints in
gradsync/checkpoint.py."""

from gradsync.runtime.env import DistInfo, discover, init, shutdown

__all__ = ["DistInfo", "discover", "init", "shutdown"]
