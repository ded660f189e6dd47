"""The workers' store: a new one for each round of the rendezvous, hosted by the agent.

The workers of a job meet through a TCPStore at MASTER_ADDR:MASTER_PORT (torch's `env://`, and
ddpkit's own groups). torch's agent offers two ways to give them one, and in torch 2.13 each is
wrong in its own way:

- shared (torch's default): the agent hosts one store for the whole launch, kept from one
  attempt to the next, so restarted workers read the last attempt's keys: gloo dials peer
  addresses that closed with the old workers (pytorch/pytorch#135712; checked on 2.13 with a
  plain torchrun script whose rank 1 fails once under --max-restarts 1);
- not shared (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): the agent binds port 0 for a free port,
  closes it, and tells the workers, and rank 0 binds it later. Another program (another
  launch on the machine) can take the port in between, and the job fails with "address
  already in use".

This rendezvous does what torch's maintainers chose in that issue's discussion: torch's c10d
rendezvous gathers the nodes as always (with sharing off, so it hosts no store of its own),
and then the node of rank 0 binds a fresh TCPStore on a port the OS picks and holds it while
that round's workers run, and publishes the port under the round's own keys for the other
nodes. Nothing is picked and let go, and no round sees an earlier round's keys. The workers
see TORCHELASTIC_USE_AGENT_STORE=True and connect to it as clients.
"""

from __future__ import annotations

import functools
from typing import Any

BACKEND = "ddpkit-c10d"  # the name `LaunchConfig.rdzv_backend` gives to this rendezvous
PORT_KEY = "ddpkit/workers-store-port"  # in the round's store (torch prefixes it by run id and round)
_registered = False


def register() -> None:
    """Make BACKEND known to torch's rendezvous registry (once per process)."""
    global _registered
    if _registered:
        return
    # (torch's elastic rendezvous loads in the launching process only when it launches)
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create)
    _registered = True


def _create(params: Any) -> Any:
    """torch's c10d handler for the same parameters, wrapped."""
    # (loaded already: torch's registry calls this)
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    c10d = RendezvousParameters(
        backend="c10d",
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        **params.config,
    )
    return _handler_class()(rendezvous_handler_registry.create_handler(c10d))


@functools.cache
def _handler_class() -> type:
    # Made on first use: torch's elastic rendezvous loads in the launching process only when it
    # launches (see elastic.py).
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

    class WorkersStoreRendezvous(RendezvousHandler):
        """torch's c10d rendezvous, plus a fresh workers' store each round (see the module)."""

        def __init__(self, c10d: Any):
            self._c10d = c10d
            self._store: Any = None  # this round's workers' store, when this node hosts it

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> Any:
            info = self._c10d.next_rendezvous()
            self._store = None  # the last round's: its workers have stopped
            # The address of rank 0's node as the c10d rendezvous resolved it for every node.
            addr = info.bootstrap_store_info.master_addr
            if info.rank == 0:
                self._store = TCPStore(addr, 0, is_master=True, wait_for_workers=False, multi_tenant=True)
                info.store.set(PORT_KEY, str(self._store.port))
            port = int(info.store.get(PORT_KEY))
            return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(addr, port))

        def shutdown(self) -> bool:
            self._store = None
            return self._c10d.shutdown()

        def get_backend(self) -> str:
            return BACKEND  # torch's registry checks that a handler is the one it was asked for

        def is_closed(self) -> bool:
            return self._c10d.is_closed()

        def set_closed(self) -> None:
            self._c10d.set_closed()

        def num_nodes_waiting(self) -> int:
            return self._c10d.num_nodes_waiting()

        def get_run_id(self) -> str:
            return self._c10d.get_run_id()

    return WorkersStoreRendezvous
