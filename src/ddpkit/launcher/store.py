"""The port of the workers' store: reserved by the agent for each round of the rendezvous.

The workers of a job meet through a TCPStore at MASTER_ADDR:MASTER_PORT (ddpkit's `dist.init`,
or torch's `env://`). torch's agent offers two ways to give them one, and in torch 2.13 each is
wrong in its own way:

- shared (torch's default): the agent hosts one store for the whole launch, kept from one
  attempt to the next, so restarted workers read the last attempt's keys: gloo dials peer
  addresses that closed with the old workers (pytorch/pytorch#135712; checked on 2.13 with a
  plain torchrun script whose rank 1 fails once under --max-restarts 1). And a store served by
  the agent's own process answers its workers from a thread while that process forks the next
  ones: a child forked while that thread held glibc's resolver lock (each new connection looks
  its peer's name up) waits for the lock forever (seen: a forked worker stuck in
  `getnameinfo` as it connected);
- not shared (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): rank 0 hosts a new store each attempt, on
  a port the agent found free by binding port 0 and closing it. Another program (another
  launch on the machine, or any outgoing connection's local port) can take the port before
  rank 0 binds it: "address already in use".

This rendezvous keeps the second way and closes its gap: torch's c10d rendezvous gathers the
nodes as always, then the node of rank 0 binds a socket on a port the OS picks, with
SO_REUSEADDR and without listening, and holds it until the next round. While it is bound, the
OS gives the port to no other socket that binds port 0 and to no outgoing connection, and
rank 0's TCPStore, which binds with SO_REUSEADDR too, binds it beside the held socket. The
round's own keys tell the other nodes the port.
"""

from __future__ import annotations

import functools
import os
import socket
import weakref
from typing import Any

BACKEND = "ddpkit-c10d"  # the name `LaunchConfig.rdzv_backend` gives to this rendezvous
UNSHARED = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # "1": torch's c10d hosts no store for the workers
PORT_KEY = "ddpkit/workers-store-port"  # in the round's store (torch prefixes it by run id and round)
_registered = False
_handlers: weakref.WeakSet = weakref.WeakSet()  # this process's, for `release_all`


def register() -> None:
    """Make BACKEND known to torch's rendezvous registry (once per process)."""
    global _registered
    if _registered:
        return
    # (torch's elastic rendezvous loads in the launching process only when it launches)
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create)
    _registered = True


def reserve_port() -> socket.socket:
    """A socket bound to a port the OS picks, on every address (IPv6 and IPv4 where the machine
    has IPv6, dual-stack whatever net.ipv6.bindv6only says, as torch's store servers bind;
    else IPv4), with SO_REUSEADDR, not listening: its port is held from other programs' binds
    of port 0 and outgoing connections, and a server that binds with SO_REUSEADDR (rank 0's
    TCPStore) can still bind it."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this machine
        pass
    else:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
            sock.bind(("::", 0))
            return sock
        except OSError:  # IPv6 switched off
            sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", 0))
    return sock


def release_all() -> None:
    """Let go of the port every handler of this process holds, when a launch has ended however
    it ended. torch shuts the rendezvous down after a launch that ended of itself, but not after
    a signal (its agent keeps the rendezvous open for other nodes): the port was held until the
    handler was garbage-collected."""
    for handler in list(_handlers):
        handler._release()


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
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

    class ReservedPortRendezvous(RendezvousHandler):
        """torch's c10d rendezvous, with the workers' port held each round (see the module)."""

        def __init__(self, c10d: Any):
            self._c10d = c10d
            self._held: socket.socket | None = None  # this round's port, when this node has rank 0
            _handlers.add(self)

        @property
        def use_agent_store(self) -> bool:
            return False  # rank 0 hosts each attempt's store: no keys of an earlier attempt

        def next_rendezvous(self) -> Any:
            if os.environ.get(UNSHARED) != "1":  # (set by elastic._launching)
                # torch's c10d would serve a store of its own from the agent, which forks
                raise RuntimeError(f"the {BACKEND} rendezvous needs {UNSHARED}=1")
            info = self._c10d.next_rendezvous()
            self._release()  # the last round's: its workers have stopped
            # The address of rank 0's node as the c10d rendezvous resolved it for every node.
            addr = info.bootstrap_store_info.master_addr
            if info.rank == 0:
                self._held = reserve_port()
                info.store.set(PORT_KEY, str(self._held.getsockname()[1]))
            port = int(info.store.get(PORT_KEY))
            return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(addr, port))

        def _release(self) -> None:
            if self._held is not None:
                self._held.close()
                self._held = None

        def shutdown(self) -> bool:
            self._release()
            try:
                return self._c10d.shutdown()
            except RuntimeError as err:
                # A signal between the start of the rendezvous' heartbeat thread and its first
                # step (Ctrl-C as the launch begins) leaves torch's shutdown joining a thread it
                # counts as not started: the RuntimeError would hide the interrupt (exit 1, not
                # 130), and the rendezvous would stay open. The thread's stop is set before the
                # join and the join is done once: a second call closes the rendezvous.
                if "before it is started" not in str(err):
                    raise
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

    return ReservedPortRendezvous
