"""torch's c10d rendezvous, its store listening on the endpoint's address only (``gradsync run`` without --elastic).

torch's own c10d backend (``_create_tcp_store`` in torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py)
makes the hosting node's TCPStore with a host name and a port, and torch's server then listens on every interface
(gradsync/runtime/store_server.py says why). This backend is torch's, registered under a name of its own through
torch's registry for custom rendezvous (``rendezvous_handler_registry``), with the store made by
``store_server.serve``: the same ``DynamicRendezvousHandler``, the same ``C10dRendezvousBackend`` and its keys, and
torch's choice of host (``is_host`` in --rdzv-conf, else whether the endpoint is an address of this node).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from gradsync.errors import ConfigError
from gradsync.runtime import endpoints, store_server

BACKEND = "gradsync-c10d"
RDZV_PORT = 29400  # torch's c10d default


class _Backend(C10dRendezvousBackend):
    """torch's c10d backend under gradsync's name (torch checks that a handler's backend is the one asked for)."""

    @property
    def name(self) -> str:
        return BACKEND


def register() -> str:
    """Make ``BACKEND`` a rendezvous backend torch elastic can be given; returns its name."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    store = _store(params)
    return create_handler(store, _Backend(store, params.run_id), params)


def _store(params: RendezvousParameters) -> dist.Store:
    """The rendezvous store: served here, on the endpoint's address, when this node hosts it; else a client."""
    host, port = endpoints.split(params.endpoint, f"--rdzv-endpoint {params.endpoint}", RDZV_PORT)
    timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    is_host = params.get_as_bool("is_host")
    if is_host is not False:
        try:
            return store_server.serve(host, port, params.max_nodes, timeout)
        except ConfigError:
            if is_host:
                raise
            # Not told to host: the endpoint is not an address of this node, or another launcher of the job on it
            # serves the store (torch's own fallback, in _create_tcp_store).
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)
