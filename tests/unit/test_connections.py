"""Cutting a set of this process's connections (runtime/connections.py) on real sockets: the
set holds the connections opened since a snapshot, less the spared address and the listeners;
a cut wakes a thread blocked reading one of them; a descriptor closed and reused since is left
alone."""

from __future__ import annotations

import socket
import threading

from oobleck_elastic.runtime.connections import SocketSet, open_sockets


def listener() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def connect(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return client, accepted


def test_the_set_is_the_connections_opened_since_less_listeners_and_the_spared_address():
    store = listener()
    before = open_sockets()
    peers, spared = listener(), listener()
    client, accepted = connect(peers)
    store_client, store_accepted = connect(spared)
    made = SocketSet.opened_since(before, spare=[("127.0.0.1", spared.getsockname()[1])])
    fds = {fd for fd, _ in made.sockets}
    try:
        assert {client.fileno(), accepted.fileno(), store_accepted.fileno()} <= fds
        assert store_client.fileno() not in fds, "the store's connection is spared"
        assert peers.fileno() not in fds and spared.fileno() not in fds, "listeners are never cut"
        assert store.fileno() not in fds, "opened before the snapshot"
    finally:
        for s in (store, peers, spared, client, accepted, store_client, store_accepted):
            s.close()


def test_a_cut_wakes_a_reader_blocked_on_a_silent_peer():
    server = listener()
    before = open_sockets()
    mine, silent_peer = connect(server)  # the peer never writes and never closes
    made = SocketSet.opened_since(before)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(mine.recv(1)))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive(), "nothing arrives from the silent peer"
    assert made.cut() >= 1
    reader.join(30)
    try:
        assert not reader.is_alive() and got == [b""], "the blocked read ends once the connection is cut"
    finally:
        for s in (server, mine, silent_peer):
            s.close()


def test_a_descriptor_reused_since_the_snapshot_is_not_cut():
    server = listener()
    before = open_sockets()
    old, old_peer = connect(server)
    made = SocketSet.opened_since(before)
    fd = old.fileno()
    old.close()
    old_peer.close()
    reused = socket.socket()  # takes the lowest free descriptor: the one just closed
    accepted = None
    try:
        assert reused.fileno() == fd
        reused.connect(server.getsockname())
        accepted, _ = server.accept()
        made.cut()
        accepted.sendall(b"x")
        assert reused.recv(1) == b"x", "the new connection on the reused descriptor still works"
    finally:
        for s in (server, reused, accepted):
            if s is not None:
                s.close()
