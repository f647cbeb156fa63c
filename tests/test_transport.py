"""The transport (grpo/wire/transport.py): bit-exact batches over real ZeroMQ sockets, garbage skipped,
timeouts that name the address, back-pressure, and nothing that arrives unpickled."""

import ast
import threading

import pytest
import torch
import zmq
from conftest import REPO
from helpers import assert_batches_equal, free_tcp_address, make_batch
from test_codec import malformed_messages

from grpo.config import load_config
from grpo.wire.codec import encode_batch
from grpo.wire.transport import BatchReceiver, BatchSender, TransportTimeout


def test_a_real_batch_through_real_sockets_arrives_bit_exact():
    address = free_tcp_address()
    receiver = BatchReceiver(address)
    sender = BatchSender(address, send_timeout_s=10)
    try:
        sent = [make_batch(step=i, seed=i) for i in range(3)]
        for b in sent:
            sender.send(b)
        for b in sent:
            assert_batches_equal(receiver.receive_frames(timeout_s=10)[1], b)
    finally:
        sender.close()
        receiver.close()


def test_receiver_skips_garbage_and_keeps_working():
    address = free_tcp_address()
    receiver = BatchReceiver(address)
    context = zmq.Context()
    raw = context.socket(zmq.PUSH)
    raw.connect(address)
    try:
        raw.send_multipart([b"garbage"])
        raw.send_multipart(malformed_messages()["unknown schema"][0])
        raw.send_multipart(encode_batch(make_batch(step=4)))
        batch = receiver.receive_frames(timeout_s=10)[1]
        assert batch.step == 4 and receiver.rejected == 2
    finally:
        raw.close(linger=0)
        context.term()
        receiver.close()


def test_timeouts_name_the_address_and_what_to_check():
    address = free_tcp_address()
    receiver = BatchReceiver(address)
    try:
        with pytest.raises(TransportTimeout, match=f"no valid batch arrived on {address} in 0.2 s"):
            receiver.receive_frames(timeout_s=0.2)[1]
    finally:
        receiver.close()
    sender = BatchSender(free_tcp_address(), high_water_mark=1, send_timeout_s=0.3)
    try:
        with pytest.raises(TransportTimeout, match="no trainer is receiving on tcp://127.0.0.1:.* after 0.3 s"):
            for step in range(10):  # nobody listens: the queue fills, then the send times out
                sender.send(make_batch(step=step))
    finally:
        sender._frames._socket.setsockopt(zmq.LINGER, 0)
        sender.close()


def test_high_water_mark_applies_back_pressure():
    address = free_tcp_address()
    receiver = BatchReceiver(address, high_water_mark=1)
    sender = BatchSender(address, high_water_mark=1, send_timeout_s=30)
    sent = []

    big = make_batch()
    big.completion_ids[0] = torch.zeros(1_000_000, dtype=torch.long)  # 8 MB: beyond the kernel's socket buffers
    big.old_logps[0] = big.ref_logps[0] = torch.zeros(1_000_000)
    big.token_versions[0] = torch.zeros(1_000_000, dtype=torch.int32)

    def produce():
        for step in range(6):
            big.step = step
            sender.send(big)
            sent.append(step)

    thread = threading.Thread(target=produce, daemon=True)
    try:
        thread.start()
        thread.join(timeout=2.0)
        assert thread.is_alive() and len(sent) < 6  # blocked: nobody is receiving
        got = [receiver.receive_frames(timeout_s=10)[1].step for _ in range(6)]
        thread.join(timeout=10)
        assert got == list(range(6)) and sent == list(range(6))
    finally:
        sender.close()
        receiver.close()


def test_nothing_that_arrives_over_a_socket_is_unpickled():
    """The receive path (sockets and pipes -> decode -> trainer / sampler) imports no unpickler
    and calls none: read from the code itself, not from its comments."""
    unpicklers = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
    pickling_calls = {"recv_pyobj", "recv_serialized", "recv", "unsafe_load"}  # Connection.recv unpickles
    loaders = {"torch", "np", "numpy", "yaml"}  # their .load() can unpickle
    wire = REPO / "grpo" / "wire"
    paths = [wire / "transport.py", wire / "codec.py", wire / "zmq_transport.py", wire / "batch.py",
             wire / "delivery.py", REPO / "grpo" / "workers" / "trainer.py",
             REPO / "grpo" / "trainer" / "loop.py", REPO / "grpo" / "trainer" / "ranks.py",
             REPO / "grpo" / "workers" / "sampler.py", REPO / "rewards" / "sandbox.py",
             *(REPO / "grpo" / "common" / f"{name}.py" for name in ("child", "child_boot", "jail", "jail_warden")),
             REPO / "grpo" / "environments" / "pool.py", *(REPO / "rewards" / f"{name}.py" for name in
                                                            ("http_json", "remote", "judge")),
             REPO / "scripts" / "reward_server.py"]  # the HTTP rewards' client and the example server
    hits = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else \
                [(node.module or "").split(".")[0]] if isinstance(node, ast.ImportFrom) else []
            if unpicklers & set(names):
                hits.append(f"{path.name}:{node.lineno} imports {names}")
            if isinstance(node, ast.Attribute) and (node.attr in pickling_calls or (
                    node.attr == "load" and isinstance(node.value, ast.Name) and node.value.id in loaders)):
                hits.append(f"{path.name}:{node.lineno} uses .{node.attr}")
    assert hits == []
    assert "recv_multipart" in (wire / "zmq_transport.py").read_text()  # the one way bytes come in


def test_the_secret_can_come_from_the_environment(monkeypatch):
    """GRPO_TRANSPORT_SECRET signs and checks messages on real sockets, and lets a non-loopback
    address start; an unsigned sender is rejected by such a receiver."""
    monkeypatch.setenv("GRPO_TRANSPORT_SECRET", "from-env")
    assert load_config(None, ["transport.address=tcp://0.0.0.0:5555"]).transport.secret is None
    address = free_tcp_address()
    receiver = BatchReceiver(address)
    signed = BatchSender(address, send_timeout_s=10)
    monkeypatch.delenv("GRPO_TRANSPORT_SECRET")
    unsigned = BatchSender(address, send_timeout_s=10)
    try:
        unsigned.send(make_batch(step=1))
        with pytest.raises(TransportTimeout):
            receiver.receive_frames(timeout_s=2)[1]  # it arrives and is rejected
        assert receiver.rejected == 1
        signed.send(make_batch(step=2))
        assert receiver.receive_frames(timeout_s=10)[1].step == 2
    finally:
        for socket in (signed, unsigned, receiver):
            socket.close()
