"""The relay that is a jailed agent's only way out of its own network (grpo/common/jail_relay.py), run here in a
thread between two loopback addresses: bytes both ways with half-closes, a side that stops reading holds up only
its own connection, and every descriptor of a finished connection is closed. What a jailed program reaches
through it: tests/test_agent_command.py."""

import os
import socket
import threading
import time

from grpo.common.jail_relay import HELD_BYTES, relay_forever


def relayed_to(serve) -> tuple[str, int]:
    """A server at 127.0.0.1 running `serve(connection)` per connection in a thread, and a relay to it from a
    listener at 127.0.0.2 on the same port (the jail's layout: the same port number on either side)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def accept_forever():
        while True:
            connection, _ = server.accept()
            threading.Thread(target=serve, args=(connection,), daemon=True).start()

    threading.Thread(target=accept_forever, daemon=True).start()
    listener = socket.create_server(("127.0.0.2", port))
    threading.Thread(target=relay_forever, args=(listener, ("127.0.0.1", port)), daemon=True).start()
    return "127.0.0.2", port


def read_all(connection: socket.socket) -> bytes:
    chunks = []
    while chunk := connection.recv(2**16):
        chunks.append(chunk)
    return b"".join(chunks)


def reversed_after_the_end(connection: socket.socket) -> None:
    """Reads until its client's half-close, then answers with what it read reversed and closes."""
    with connection:
        connection.sendall(read_all(connection)[::-1])


def test_a_connection_is_relayed_both_ways_through_its_half_close():
    address = relayed_to(reversed_after_the_end)
    sent = os.urandom(3 * HELD_BYTES + 12345)  # more than the relay holds for a side: its reads wait in between
    with socket.create_connection(address, timeout=10) as client:
        threading.Thread(target=lambda: (client.sendall(sent), client.shutdown(socket.SHUT_WR)), daemon=True).start()
        assert read_all(client) == sent[::-1]


def test_a_side_that_stops_reading_holds_up_no_other_connection():
    def serve(connection):
        with connection:
            if connection.recv(4) == b"big?":
                try:
                    connection.sendall(b"x" * 64 * HELD_BYTES)  # never read: blocks this thread alone
                except OSError:  # until the test ends and its client goes
                    pass
            else:
                connection.sendall(b"pong")

    address = relayed_to(serve)
    with socket.create_connection(address, timeout=10) as stalled:
        stalled.sendall(b"big?")
        time.sleep(0.5)  # the relay fills what it may hold for the stalled side, and waits
        with socket.create_connection(address, timeout=5) as other:
            other.sendall(b"ping")
            assert other.recv(4) == b"pong"


def test_every_descriptor_of_a_finished_connection_is_closed():
    address = relayed_to(reversed_after_the_end)
    with socket.create_connection(address, timeout=10) as client:  # the relay's own descriptors now made
        client.sendall(b"ab")
        client.shutdown(socket.SHUT_WR)
        assert read_all(client) == b"ba"
    time.sleep(0.2)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(50):
        with socket.create_connection(address, timeout=10) as client:
            client.sendall(str(i).encode())
            client.shutdown(socket.SHUT_WR)
            assert read_all(client) == str(i).encode()[::-1]
    deadline = time.monotonic() + 5
    while len(os.listdir("/proc/self/fd")) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) == before
