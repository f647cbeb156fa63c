"""A jailed call's own network with one way out (grpo/common/jail_warden.py): a call allowed one TCP port
(JailLimits.connect_port, an agent's endpoint) gets a network namespace of its own, whose loopback holds a
listener at 127.0.0.1:<port>; each connection to it is relayed to 127.0.0.1:<port> of the host. Nothing else
of any network is there: not the same port number on another address, not another host.

The relay is a process forked while the call is still in the host's network (and outside the PID namespace
the call then gets, so nothing the call runs can see or signal it). Once the call is in its own network, its
listener is handed to the relay, which accepts there and connects here: a socket keeps the network it was
made in, whichever process holds it. The relay is one more process of the call's budget (agent.max_processes).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import selectors
import signal
import socket
import struct
import sys

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
CHUNK = 2**16
HELD_BYTES = 2**20  # what one side may have sent that the other has not yet taken, before its reads wait


def start_relay(port: int) -> tuple[socket.socket, int]:
    """The relay process, to 127.0.0.1:`port` of the host's network; it dies with its parent. Returns our end of
    the pair `hand_over` gives it the listener through (closed without one: it exits), and its pid."""
    ours, theirs = socket.socketpair()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # never returns
        code = 0
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the signal was armed
                os._exit(0)
            keep = theirs.fileno()
            os.closerange(3, keep)  # the warden's pipes, the call's answer pipe: none held open here
            os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
            _, fds, _, _ = socket.recv_fds(theirs, 1, 1)
            if fds:
                relay_forever(socket.socket(fileno=fds[0]), ("127.0.0.1", port))
        except BaseException as e:  # on the call's output, where its log shows it
            sys.stderr.write(f"the relay to the endpoint's port {port} stopped: {type(e).__name__}: {e}\n")
            sys.stderr.flush()
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    return ours, pid


def own_loopback(port: int) -> socket.socket:
    """In the call's new network namespace: its loopback up (it starts down; the process that made the namespace
    may), and a listener at 127.0.0.1:`port`."""
    with socket.socket() as s:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))
    return socket.create_server(("127.0.0.1", port))


def hand_over(relay: socket.socket, listener: socket.socket) -> None:
    socket.send_fds(relay, [b"1"], [listener.fileno()])
    listener.close()
    relay.close()


class _Side:
    """One socket of a relayed pair: the bytes waiting to be written to it, and whether its peer has ended."""

    def __init__(self, sock: socket.socket, connecting: bool = False):
        self.sock, self.peer, self.waiting, self.connecting = sock, None, bytearray(), connecting
        self.peer_ended = self.read_ended = False


def relay_forever(listener: socket.socket, outside: tuple[str, int]) -> None:
    """Each connection accepted on `listener` gets one made to `outside`; every socket is non-blocking, so one
    side that stops reading holds up only its own pair (its peer's reads wait once HELD_BYTES are pending); a
    side's end is passed on as a half-close once what it sent is written; a pair is closed when both ended or
    either failed. An accept refused for want of descriptors waits for a pair to close."""
    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ, None)
    sides: set[_Side] = set()
    while True:
        for key, events in selector.select():
            if key.data is None:
                for side in _accept(listener, outside, selector):
                    sides.add(side)
                    _watch(selector, side)
                continue
            side: _Side = key.data
            if side not in sides:
                continue  # closed earlier in this round, with its peer
            try:
                if events & selectors.EVENT_WRITE:
                    _write(side)
                if events & selectors.EVENT_READ:
                    _read(side)
                done = side.read_ended and side.peer.read_ended and not side.waiting and not side.peer.waiting
            except OSError:
                done = True
            if done:
                for s in (side, side.peer):
                    sides.discard(s)
                    _watch(selector, s, closing=True)
                    s.sock.close()
                if listener not in selector.get_map():
                    selector.register(listener, selectors.EVENT_READ, None)  # accepting again
                continue
            _watch(selector, side)
            _watch(selector, side.peer)


def _watch(selector, side: _Side, closing: bool = False) -> None:
    """The side's registration set to what it waits for (none: unregistered)."""
    events = 0 if closing else _interest(side)
    registered = side.sock in selector.get_map()
    if registered and events:
        selector.modify(side.sock, events, side)
    elif registered:
        selector.unregister(side.sock)
    elif events:
        selector.register(side.sock, events, side)


def _accept(listener: socket.socket, outside: tuple[str, int], selector) -> tuple:
    """The two sides of a new pair (none where the accept or the connect failed)."""
    try:
        inside, _ = listener.accept()
    except BlockingIOError:
        return ()
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            selector.unregister(listener)  # until a pair closes
        return ()
    try:
        out = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        inside.close()
        selector.unregister(listener)
        return ()
    inside.setblocking(False)
    out.setblocking(False)
    if out.connect_ex(outside) not in (0, errno.EINPROGRESS):
        inside.close()
        out.close()
        return ()
    a, b = _Side(inside), _Side(out, connecting=True)
    a.peer, b.peer = b, a
    return a, b


def _interest(side: _Side) -> int:
    """Write while bytes wait for it (or its connect is under way); read while its peer has room for more."""
    events = selectors.EVENT_WRITE if side.waiting or side.connecting else 0
    if not side.read_ended and not side.connecting and len(side.peer.waiting) < HELD_BYTES:
        events |= selectors.EVENT_READ
    return events


def _write(side: _Side) -> None:
    if side.connecting:
        failed = side.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if failed:
            raise OSError(failed, os.strerror(failed))
        side.connecting = False
    if side.waiting:
        try:
            sent = side.sock.send(side.waiting)
        except BlockingIOError:  # full again since the selector looked
            return
        del side.waiting[:sent]
    if not side.waiting and side.peer_ended:
        side.sock.shutdown(socket.SHUT_WR)


def _read(side: _Side) -> None:
    try:
        data = side.sock.recv(CHUNK)
    except BlockingIOError:
        return
    if data:
        side.peer.waiting += data
        return
    side.read_ended = side.peer.peer_ended = True
    if not side.peer.waiting and not side.peer.connecting:
        side.peer.sock.shutdown(socket.SHUT_WR)
