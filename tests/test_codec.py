"""The codec (grpo/wire/codec.py): batches bit-exact through encode and decode, every malformed kind and
every forgery rejected with its reason, and the versions a batch carries on its tokens."""

import json
import random
import time

import pytest
import torch
from helpers import assert_batches_equal, make_batch

from grpo.wire.codec import MessageError, decode_batch, encode_batch


def test_codec_round_trip_is_bit_exact_with_and_without_reference():
    for batch in (make_batch(), make_batch(with_ref=False)):
        frames = encode_batch(batch)
        assert all(isinstance(f, bytes) for f in frames)
        assert_batches_equal(decode_batch(frames), batch)


def with_rows(segments=None, first_token_context=True):
    """A batch whose second sample holds two rows: its last 2 tokens (the first of them context) a row of their own."""
    batch = make_batch()
    lengths = [len(c) for c in batch.completion_ids]
    batch.completion_ids[1] = torch.arange(6)
    batch.old_logps[1], batch.ref_logps[1] = -torch.rand(6), -torch.rand(6)
    batch.model_mask = [torch.ones(n, dtype=torch.bool) for n in [lengths[0], 6, *lengths[2:]]]
    batch.model_mask[1][4] = not first_token_context
    batch.segments = [torch.zeros(len(c), dtype=torch.int32) for c in batch.completion_ids]
    batch.segments[1] = torch.tensor(segments or [0, 0, 0, 0, 1, 1], dtype=torch.int32)
    batch.token_versions = [torch.where(m, 0, -1).int() for m in batch.model_mask]
    return batch


def test_a_sample_of_several_rows_round_trips_and_malformed_rows_are_refused():
    batch = with_rows()
    assert_batches_equal(decode_batch(encode_batch(batch)), batch)
    for segments, context, message in (
            ([0, 0, 0, 0, 2, 2], True, "sample 1's row indices must start at 0 and grow by one at a time"),
            ([1, 1, 1, 1, 1, 1], True, "sample 1's row indices must start at 0"),
            ([0, 0, 1, 1, 0, 0], True, "grow by one at a time"),
            ([0, 0, 0, 0, 1, 1], False, "sample 1 has a row that begins with a model token")):
        with pytest.raises(MessageError, match=message):
            decode_batch(encode_batch(with_rows(segments, context)))
    without_mask = with_rows()
    without_mask.model_mask, without_mask.token_versions = None, None
    without_mask.__post_init__()
    with pytest.raises(MessageError, match="segments: a sample of several rows needs model_mask"):
        decode_batch(encode_batch(without_mask))


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


def _without_tensor(frames, name):
    specs = _header(frames)["tensors"]
    i = [spec["name"] for spec in specs].index(name)
    return _with_header(frames[:1 + i] + frames[2 + i:], tensors=specs[:i] + specs[i + 1:])


def malformed_messages():
    good = encode_batch(make_batch())
    nan_logps = make_batch()
    nan_logps.old_logps[0][0] = float("nan")
    unversioned = make_batch()
    unversioned.token_versions[1][0] = -1
    episodes = make_batch()  # the environment wrote each completion's last token, and it claims a version
    episodes.model_mask = [torch.arange(len(c)) < len(c) - 1 for c in episodes.completion_ids]
    return {
        "empty message": ([], "non-empty list of byte frames"),
        "not json": ([b"\x80garbage"] + good[1:], "header is not JSON"),
        "json but not an object": ([b"[1, 2]"] + good[1:], "header must be a JSON object"),
        "unknown schema": (_with_header(good, schema="grpo.sampler.rollout/99"),
                           "unknown schema 'grpo.sampler.rollout/99'"),
        "a batch without token versions": (_with_header(good, schema="grpo.rollout/1"),
                                           "a batch of schema grpo.rollout/1, from a sampler older than this trainer, "
                                           "which speaks grpo.rollout/5 .*run the sampler of the same version"),
        "a batch without its totals": (_with_header(good, schema="grpo.rollout/3"),
                                       "a batch of schema grpo.rollout/3, from a sampler older than this trainer"),

        "policy_version not the oldest token's": (_with_header(good, policy_version=3),
                                                  "policy_version 3 is not the oldest token's version 0"),
        "a model token without a version": (encode_batch(unversioned),
                                            "token_versions: a model token without a version"),
        "an environment token with a version": (encode_batch(episodes),
                                                "token_versions: an environment's token must be -1"),
        "missing field": ([json.dumps({k: v for k, v in _header(good).items() if k != "step"}).encode()] + good[1:],
                          "missing field 'step'"),
        "wrong field type": (_with_header(good, step="7"), "field 'step' must be int"),
        "bool as int": (_with_header(good, policy_version=True), "field 'policy_version' must be int"),
        "dtype outside allow-list": (_mutate_spec(good, 0, dtype="<f8"), "prompt_ids: dtype '<f8' not allowed"),
        "pickle dtype": (_mutate_spec(good, 3, dtype="|O"), "old_logps: dtype '|O' not allowed"),
        "shape does not match bytes": (_mutate_spec(good, 1, lengths=[1, 1, 1, 1, 1]),
                                       "completion_ids: .* bytes do not match its shape"),
        "truncated frame": (good[:2] + [good[2][:-4]] + good[3:], "bytes do not match its shape"),
        "frame count mismatch": (good[:-1], "header lists 11 tensors but 10 frames follow"),
        "missing tensor field": (_without_tensor(good, "token_versions"), "missing tensor field 'token_versions'"),
        "unknown tensor field": (_mutate_spec(good, 0, name="weights"), "unknown tensor field 'weights'"),
        "duplicate tensor field": (_mutate_spec(good, 1, name="prompt_ids",
                                                lengths=_header(good)["tensors"][0]["lengths"],
                                                nbytes=len(good[1])) [:2] + [good[1]] + good[3:],
                                   "appears twice"),
        "group sizes disagree": (_with_header(good, group_sizes=[2, 2]), "5 completions but group sizes sum to 4"),
        "reward names disagree": (_with_header(good, reward_names=["a"]),
                                  "rewards has shape \\[5, 2\\], expected \\[5, 1\\]"),
        "non-finite values": (encode_batch(nan_logps), "old_logps: holds NaN or infinite values"),
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


def _random_json(rng, depth=0):
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    if kind == 6:
        return {str(rng.randrange(9)): _random_json(rng, depth + 1) for _ in range(rng.randrange(3))}
    return [None, rng.randint(-2**70, 2**70), rng.random() * 1e9, "x" * rng.randrange(5), rng.random() < 0.5][kind]


def _mutated(rng, frames: list[bytes]) -> list[bytes]:
    """One random structural or byte-level change to a message (never a no-op)."""
    out = list(frames)
    kind = rng.randrange(7)
    if kind == 0:  # header bytes flipped
        header = bytearray(out[-len(frames)])
        for _ in range(rng.randrange(1, 5)):
            header[rng.randrange(len(header))] = rng.randrange(256)
        out[-len(frames)] = bytes(header)
    elif kind in (1, 2, 3):  # a header field or tensor-spec field replaced by random JSON, or deleted
        index = next(i for i, f in enumerate(out) if f.startswith(b"{"))
        header = json.loads(out[index])
        target = header if kind == 1 else rng.choice(header["tensors"])
        key = rng.choice(list(target))
        if kind == 3:
            del target[key]
        else:
            target[key] = _random_json(rng)
        out[index] = json.dumps(header).encode()
    elif kind == 4:  # a frame cut short or extended
        i = rng.randrange(len(out))
        out[i] = out[i][:rng.randrange(len(out[i]))] if rng.random() < 0.5 else out[i] + bytes(rng.randrange(1, 9))
    elif kind == 5:  # a frame dropped, duplicated or moved
        i, j = rng.randrange(len(out)), rng.randrange(len(out))
        [lambda: out.pop(i), lambda: out.insert(i, out[j]), lambda: out.insert(j, out.pop(i))][rng.randrange(3)]()
    else:  # one data byte changed
        i = rng.randrange(len(out))
        if out[i]:
            k = rng.randrange(len(out[i]))
            out[i] = out[i][:k] + bytes([out[i][k] ^ rng.randrange(1, 256)]) + out[i][k + 1:]
    return out if out != frames else _mutated(rng, frames)


def test_fuzzed_messages_never_crash_or_hang_and_each_rejection_names_its_reason():
    """6000 seeded messages: random garbage, and random mutations of a valid message, unsigned
    and signed. Garbage and signed mutations are all rejected; an unsigned mutation is either
    rejected or still a well-formed batch (a changed number is still a number)."""
    rng, secret = random.Random(0), b"fuzz"
    good, signed = encode_batch(make_batch()), encode_batch(make_batch(), secret=secret)
    outcomes = {"garbage": 0, "signed": 0, "unsigned rejected": 0, "unsigned valid": 0}
    slowest = 0.0
    for n in range(6000):
        kind = ["garbage", "signed", "unsigned"][n % 3]
        if kind == "garbage":
            frames = [rng.randbytes(rng.randrange(64)) for _ in range(rng.randrange(1, 6))]
        else:
            frames = _mutated(rng, signed if kind == "signed" else good)
        started = time.perf_counter()
        try:
            batch = decode_batch(frames, secret=secret if kind == "signed" else None)
        except MessageError as e:
            assert not str(e).startswith("malformed message ("), (kind, frames[:1], e)  # a specific reason
            outcomes[kind if kind != "unsigned" else "unsigned rejected"] += 1
        else:
            assert kind == "unsigned", (kind, frames[:1])
            assert sum(batch.group_sizes) == len(batch.completion_ids) == len(batch.advantages)
            outcomes["unsigned valid"] += 1
        slowest = max(slowest, time.perf_counter() - started)
    assert outcomes["garbage"] == outcomes["signed"] == 2000
    assert outcomes["unsigned rejected"] > 1500  # most mutations break something the decoder checks
    assert slowest < 1.0  # no pathological input (a hang would trip this, or the test timeout)


def test_a_batch_sampled_with_one_version_carries_it_on_every_model_token_and_none_on_the_environments():
    from grpo.wire.batch import one_version

    versions = one_version(4, [torch.tensor([7, 8, 9]), torch.tensor([5])],
                           [torch.tensor([True, False, True]), torch.tensor([True])])
    assert [v.tolist() for v in versions] == [[4, -1, 4], [4]] and versions[0].dtype == torch.int32
    batch = make_batch(step=3)
    assert all(v.tolist() == [2] * len(c) for v, c in zip(decode_batch(encode_batch(batch)).token_versions,
                                                           batch.completion_ids))


def test_token_staleness_is_the_age_of_each_model_tokens_weights_at_training():
    """Trainer at version 5; completion 1 sampled by v3 then v4 (an environment token between), completion 2
    by v5: ages 2, 1, 0 over the three model tokens (mean 1, max 2); one of two completions spans versions."""
    from grpo.wire.staleness import token_staleness

    metrics = token_staleness(5, [torch.tensor([3, -1, 4], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)])
    assert metrics == {"staleness/token_mean": 1.0, "staleness/token_max": 2.0,
                       "staleness/multi_version_fraction": 0.5}
