"""Only the run writes what the trainer trains on and resumes from: the run's secret, signed
batches on loopback too, spooled steps checked before they are sent again, checkpoints checked
against a signed manifest and loaded without unpickling code. Each attack is what a process that
can write the run folder (an environment's child, a tool before the jail) would try."""

import json
import os
import pickle
import threading

import pytest
import torch
from helpers import free_tcp_address, make_batch
from test_run_start import error_lines, process_settings, start_one_rank_trainer, train_together

from grpo.run.secret import read_or_make_secret, run_secret
from grpo.trainer.checkpoint_files import MANIFEST, CheckpointChanged, check_manifest, load_without_code, write_manifest
from grpo.wire.codec import encode_batch
from grpo.wire.delivery import Redelivery, Spool, SpoolError, TrainerState
from grpo.wire.transport import BatchReceiver, BatchSender, TransportTimeout


def test_the_run_secret_is_made_once_private_and_the_same_for_every_process(tmp_path):
    """Eight starts racing for it read one secret; the file is 0600; transport.secret and the
    environment's GRPO_TRANSPORT_SECRET come first."""
    found = []
    threads = [threading.Thread(target=lambda: found.append(run_secret(None, tmp_path))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(found)) == 1 and len(found[0]) == 64
    assert oct((tmp_path / "secret").stat().st_mode & 0o777) == "0o600"
    assert sorted(os.listdir(tmp_path)) == ["secret"]  # no temporary file left
    assert run_secret("given", tmp_path) == b"given"
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="is empty: delete it"):
        read_or_make_secret(tmp_path / "empty")


def test_a_batch_unsigned_or_signed_otherwise_is_refused_on_loopback(tmp_path):
    """What a process on the machine sends to the trainer's loopback port: an unsigned batch with
    advantages of 1e4, one signed with another key. Both are refused and counted; the run's own
    batch after them is taken."""
    address, secret = free_tcp_address(), run_secret(None, tmp_path)
    receiver = BatchReceiver(address)
    receiver.expect_secret(secret)
    forged = make_batch()
    forged.advantages = torch.full_like(forged.advantages, 1e4)
    senders = [BatchSender(address, secret=key) for key in (None, b"guessed")] + [BatchSender(address, secret=secret)]
    try:
        for rejected, sender in enumerate(senders[:2], start=1):
            sender.send(forged)
            with pytest.raises(TransportTimeout):
                receiver.receive_frames(1.0)
            assert receiver.rejected == rejected
        senders[2].send(make_batch())
        frames, batch = receiver.receive_frames(10.0)
        assert receiver.rejected == 2 and torch.equal(batch.advantages, make_batch().advantages)
    finally:
        for sender in senders:
            sender.close()
        receiver.close()


def test_a_spooled_step_changed_after_it_was_written_is_never_sent(tmp_path):
    """The spool holds signed steps 0-2; step 1's last eight bytes (a tensor's values) are rewritten
    in the file, its length kept. A new trainer's re-send sends step 0, then stops at step 1 naming
    the file (the sampler exits with that line): nothing of step 1 or after reaches the trainer."""
    secret = run_secret(None, tmp_path)
    spool, sent = Spool(tmp_path / "spool"), []
    sender = BatchSender(free_tcp_address(), secret=secret)
    try:
        for step in range(3):
            spool.put(step, encode_batch(make_batch(), secret))
        path = tmp_path / "spool" / "step00000001.batch"
        data = bytearray(path.read_bytes())
        data[-8:] = torch.full((2,), 1e4).numpy().tobytes()
        path.write_bytes(bytes(data))
        TrainerState(step=0, next_steps={0: 0}).save(tmp_path / "trainer_state.json")
        redelivery = Redelivery(spool, sent.append, tmp_path / "trainer_state.json", 0, sender.signature_problem)
        with pytest.raises(SpoolError, match=f"{path} was changed after this sampler wrote it"):
            redelivery.check(next_step=3)
        assert len(sent) == 1 and sent[0] == spool.get(0)
    finally:
        sender.close()


def test_a_spooled_step_of_an_earlier_schema_stops_the_resend_naming_the_folder_to_delete(tmp_path):
    """A run resumed after an upgrade: its spool holds a batch of the earlier schema, which the trainer
    could not read (it would count it as malformed and wait for it). The re-send stops at it instead,
    naming the file and the spool folder whose deletion has its steps made again."""
    secret = run_secret(None, tmp_path)
    spool, sent = Spool(tmp_path / "spool"), []
    sender = BatchSender(free_tcp_address(), secret=secret)
    try:
        signature, header, *tensors = encode_batch(make_batch(), secret)
        earlier = [json.dumps({**json.loads(header), "schema": "grpo.rollout/3"}).encode(), *tensors]
        spool.put(0, encode_batch(make_batch(), secret))
        spool.put(1, [hmac_of(secret, earlier), *earlier])
        TrainerState(step=0, next_steps={0: 0}).save(tmp_path / "trainer_state.json")
        redelivery = Redelivery(spool, sent.append, tmp_path / "trainer_state.json", 0, sender.signature_problem)
        with pytest.raises(SpoolError, match=r"step00000001.batch holds a batch of schema grpo.rollout/3, written "
                                             r"by an earlier release.*Delete the sampler's spool folder"):
            redelivery.check(next_step=2)
        assert len(sent) == 1
    finally:
        sender.close()


def hmac_of(secret: bytes, frames: list[bytes]) -> bytes:
    """The transport's signature of `frames` (grpo/wire/codec.py)."""
    from grpo.wire.codec import _signature

    return _signature(secret, frames)


class Planted:
    """What a process that can write the run folder leaves in a checkpoint: unpickling it runs code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_file_is_loaded_without_running_what_it_holds(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"module": {"w": torch.ones(2)}, "x": Planted(str(marker))}, tmp_path / "planted.pt")
    with pytest.raises(CheckpointChanged, match="holds something a safe load refuses"):
        load_without_code(str(tmp_path / "planted.pt"))
    assert not marker.exists()
    torch.save({"module": {"w": torch.ones(2)}, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}},
               tmp_path / "plain.pt")
    assert torch.equal(load_without_code(str(tmp_path / "plain.pt"))["module"]["w"], torch.ones(2))


def test_a_checkpoints_files_are_checked_against_its_signed_manifest(tmp_path):
    folder, secret = tmp_path / "step000003", b"run-secret"
    folder.mkdir()
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    write_manifest(folder, secret)
    assert check_manifest(folder, secret) is None
    assert json.loads((folder / MANIFEST).read_text())["files"]["mp_rank_00_model_states.pt"][0] == 7
    with pytest.raises(CheckpointChanged, match="is not signed with this run's secret"):
        check_manifest(folder, b"another-run")
    (folder / "extra.pt").write_bytes(b"planted")
    with pytest.raises(CheckpointChanged, match=r"added \['extra.pt'\], missing \[\]"):
        check_manifest(folder, secret)
    (folder / "extra.pt").unlink()
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"weighty")
    with pytest.raises(CheckpointChanged, match="mp_rank_00_model_states.pt was changed after the run wrote it"):
        check_manifest(folder, secret)
    (folder / MANIFEST).unlink()  # written before manifests: loaded (as data only), with a warning
    assert check_manifest(folder, secret).startswith(f"{folder} has no {MANIFEST} (written by an earlier version")


@pytest.mark.slow  # trains a step, then starts the trainer three times
def test_a_resume_from_a_checkpoint_with_a_planted_pickle_stops_and_runs_nothing(tmp_path, tiny_model_dir,
                                                                                  tiny_gsm8k):
    """Trained one step (a checkpoint at step 1); its model-states file is replaced by a pickle that
    would create a file when loaded. The trainer's start is refused in one line (exit 2) naming the
    file: first by the manifest; with a manifest remade for the planted file but not signed with the
    run's secret, by the signature; with one signed by the run's secret (as only the run could), by
    the safe load. The planted code never runs."""
    run_dir, marker = tmp_path / "run", tmp_path / "ran"
    run_dir.mkdir()
    train_together(run_dir, tiny_model_dir, tiny_gsm8k, 1, 4)
    folder = run_dir / "checkpoints" / "step000001"
    states = folder / "mp_rank_00_model_states.pt"
    state = torch.load(states, weights_only=True)
    torch.save({**state, "planted": Planted(str(marker))}, states)
    secret = (run_dir / "secret").read_text().strip().encode()
    for manifest_key, expected in ((None, "was changed after the run wrote it"), (b"guessed", "is not signed with "
                                   "this run's secret"), (secret, "holds something a safe load refuses")):
        if manifest_key is not None:
            write_manifest(folder, manifest_key)
        trainer = start_one_rank_trainer(run_dir, tiny_model_dir, tiny_gsm8k, free_tcp_address(),
                                         *process_settings(2, 4))
        assert trainer.returncode == 2, trainer.stdout + trainer.stderr
        assert len(error_lines(trainer)) == 1 and expected in error_lines(trainer)[0], error_lines(trainer)
        assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):
        torch.load(states, weights_only=True)
