"""The wire: bit-exact batches over real ZeroMQ sockets, and every malformed kind rejected."""

import json
import threading

import pytest
import torch
import zmq

from grpo.transport import (BatchReceiver, BatchSender, MessageError, TransportTimeout, decode_batch,
                            encode_batch)
from helpers import assert_batches_equal, free_tcp_address, make_batch


def test_codec_round_trip_is_bit_exact_with_and_without_reference():
    for batch in (make_batch(), make_batch(with_ref=False)):
        frames = encode_batch(batch)
        assert all(isinstance(f, bytes) for f in frames)
        assert_batches_equal(decode_batch(frames), batch)


def test_a_real_batch_through_real_sockets_arrives_bit_exact():
    address = free_tcp_address()
    receiver = BatchReceiver(address)
    sender = BatchSender(address, send_timeout_s=10)
    try:
        sent = [make_batch(step=i, seed=i) for i in range(3)]
        for b in sent:
            sender.send(b)
        for b in sent:
            assert_batches_equal(receiver.receive(timeout_s=10), b)
    finally:
        sender.close()
        receiver.close()


def _header(frames):
    return json.loads(frames[0])


def _with_header(frames, **changes):
    header = _header(frames)
    header.update(changes)
    return [json.dumps(header).encode()] + frames[1:]


def _mutate_spec(frames, index, **changes):
    header = _header(frames)
    header["tensors"][index].update(changes)
    return [json.dumps(header).encode()] + frames[1:]


def malformed_messages():
    good = encode_batch(make_batch())
    nan_logps = make_batch()
    nan_logps.old_logps[0][0] = float("nan")
    return {
        "empty message": ([], "non-empty list of byte frames"),
        "not json": ([b"\x80garbage"] + good[1:], "header is not JSON"),
        "json but not an object": ([b"[1, 2]"] + good[1:], "header must be a JSON object"),
        "unknown schema": (_with_header(good, schema="grpo.rollout/99"), "unknown schema 'grpo.rollout/99'"),
        "missing field": ([json.dumps({k: v for k, v in _header(good).items() if k != "step"}).encode()] + good[1:],
                          "missing field 'step'"),
        "wrong field type": (_with_header(good, step="7"), "field 'step' must be int"),
        "bool as int": (_with_header(good, policy_version=True), "field 'policy_version' must be int"),
        "dtype outside allow-list": (_mutate_spec(good, 0, dtype="<f8"), "prompt_ids: dtype '<f8' not allowed"),
        "pickle dtype": (_mutate_spec(good, 3, dtype="|O"), "old_logps: dtype '|O' not allowed"),
        "shape does not match bytes": (_mutate_spec(good, 1, lengths=[1, 1, 1, 1, 1]),
                                       "completion_ids: .* bytes do not match its shape"),
        "truncated frame": (good[:2] + [good[2][:-4]] + good[3:], "bytes do not match its shape"),
        "frame count mismatch": (good[:-1], "header lists 7 tensors but 6 frames follow"),
        "missing tensor field": (_with_header(good[:-1], tensors=_header(good)["tensors"][:-1]),
                                 "missing tensor field 'truncated'"),
        "unknown tensor field": (_mutate_spec(good, 0, name="weights"), "unknown tensor field 'weights'"),
        "duplicate tensor field": (_mutate_spec(good, 1, name="prompt_ids", lengths=_header(good)["tensors"][0]["lengths"],
                                                nbytes=len(good[1])) [:2] + [good[1]] + good[3:],
                                   "appears twice"),
        "group sizes disagree": (_with_header(good, group_sizes=[2, 2]), "5 completions but group sizes sum to 4"),
        "reward names disagree": (_with_header(good, reward_names=["a"]), "rewards has shape \\[5, 2\\], expected \\[5, 1\\]"),
        "non-finite values": (encode_batch(nan_logps), "old_logps: holds NaN or infinite values"),
        "denominators out of range": (_with_header(good, num_sequences=99), "num_sequences / num_tokens out of range"),
        "NaN literal in header": ([_header_text(good).replace('"a": 1.5', '"a": NaN').encode()] + good[1:],
                                  "header holds NaN"),
    }


def _header_text(frames):
    return frames[0].decode()


@pytest.mark.parametrize("kind", list(malformed_messages()))
def test_each_malformed_message_kind_is_rejected_with_its_reason(kind):
    frames, message = malformed_messages()[kind]
    with pytest.raises(MessageError, match=message):
        decode_batch(frames)


def test_oversize_messages_are_rejected_before_parsing():
    frames = encode_batch(make_batch())
    with pytest.raises(MessageError, match="exceeds the cap of 100"):
        decode_batch(frames, max_bytes=100)


def test_signed_messages_verify_and_forgeries_are_rejected():
    secret = b"s3cret"
    frames = encode_batch(make_batch(), secret=secret)
    assert_batches_equal(decode_batch(frames, secret=secret), make_batch())
    with pytest.raises(MessageError, match="bad or missing signature"):
        decode_batch(encode_batch(make_batch()), secret=secret)  # unsigned
    with pytest.raises(MessageError, match="bad or missing signature"):
        decode_batch(encode_batch(make_batch(), secret=b"other"), secret=secret)  # wrong key
    tampered = list(frames)
    tampered[-1] = bytes([tampered[-1][0] ^ 1]) + tampered[-1][1:]
    with pytest.raises(MessageError, match="bad or missing signature"):
        decode_batch(tampered, secret=secret)


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
        batch = receiver.receive(timeout_s=10)
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
            receiver.receive(timeout_s=0.2)
    finally:
        receiver.close()
    sender = BatchSender(free_tcp_address(), high_water_mark=1, send_timeout_s=0.3)
    try:
        with pytest.raises(TransportTimeout, match="no trainer is receiving on tcp://127.0.0.1:.* after 0.3 s"):
            for step in range(10):  # nobody listens: the queue fills, then the send times out
                sender.send(make_batch(step=step))
    finally:
        sender._socket.setsockopt(zmq.LINGER, 0)
        sender.close()


def test_high_water_mark_applies_back_pressure():
    address = free_tcp_address()
    receiver = BatchReceiver(address, high_water_mark=1)
    sender = BatchSender(address, high_water_mark=1, send_timeout_s=30)
    sent = []

    big = make_batch()
    big.completion_ids[0] = torch.zeros(1_000_000, dtype=torch.long)  # 8 MB: beyond the kernel's socket buffers
    big.old_logps[0] = big.ref_logps[0] = torch.zeros(1_000_000)
    big.num_tokens = sum(len(c) for c in big.completion_ids)

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
        got = [receiver.receive(timeout_s=10).step for _ in range(6)]
        thread.join(timeout=10)
        assert got == list(range(6)) and sent == list(range(6))
    finally:
        sender.close()
        receiver.close()
