"""`store`: the port of the workers' store, held by the launcher from the round's start until
rank 0's store binds it (the launches themselves: tests/launcher/test_elastic.py)."""

from __future__ import annotations

import errno
import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddpkit.launcher.store import reserve_port

from ..cli.helpers import free_port

pytestmark = pytest.mark.unit


def test_a_held_port_is_refused_to_other_programs_and_taken_by_the_store():
    held = reserve_port()
    port = held.getsockname()[1]
    try:
        other = socket.socket()
        with pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))  # a program that did not hold it
        other.close()
        assert refused.value.errno == errno.EADDRINUSE
        for libuv in (True, False):  # both of torch's store servers bind beside the held socket
            timeout = timedelta(seconds=10)
            server = dist.TCPStore("127.0.0.1", port, 1, True, timeout, wait_for_workers=False, use_libuv=libuv)
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
            server.set("key", "value")
            assert client.get("key") == b"value"
            del client, server
    finally:
        held.close()


def test_without_ipv6_the_port_is_held_on_ipv4(monkeypatch):
    plain = socket.socket

    def no_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return plain(family, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", no_ipv6)
    held = reserve_port()
    try:
        assert held.family == socket.AF_INET
        other = plain()
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", held.getsockname()[1]))
        other.close()
    finally:
        held.close()


def test_an_interrupt_as_the_heartbeat_starts_leaves_the_interrupt_and_a_closed_rendezvous(monkeypatch):
    # Ctrl-C lands as the rendezvous starts its heartbeat thread, before the thread counts as
    # started (seen once in a whole run of the suite): the KeyboardInterrupt is what the launch
    # raises, and the shutdown that follows it closes the rendezvous instead of failing to join
    # the thread.
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    from ddpkit.launcher import store

    store.register()
    monkeypatch.setenv(store.UNSHARED, "1")
    params = RendezvousParameters(store.BACKEND, f"127.0.0.1:{free_port()}", "interrupted", 1, 1)
    handler = rendezvous_handler_registry.create_handler(params)
    start = threading.Thread.start

    def interrupted(thread):
        if thread.name.startswith("RendezvousKeepAliveTimer"):
            raise KeyboardInterrupt  # the signal's exception, before the thread ran
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        handler.next_rendezvous()
    monkeypatch.undo()
    assert handler.shutdown() is True
    assert handler.is_closed()
