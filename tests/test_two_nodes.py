"""The trainer as two nodes for real: two launchers on this host (torchrun --nnodes 2, one per
node rank, as on two machines), the sampler connecting over TCP, the weights in the shared run
folder; it publishes the same adapter as the one-node, two-rank run."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import PROCESS_CONFIG, REPO
from helpers import free_tcp_address
from safetensors.torch import load_file
from test_sampling_worker import start_sampler

from grpo.run.ports import free_local_port
from grpo.weights.folder import read_latest, version_dir

BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
RUN = ["sampling.prompts_per_step=2", "sampling.group_size=8", "sampling.max_new_tokens=1", "lora.r=4",
       "rewards.names=[gsm8k_answer_lenient]", "rewards.weights=[1.0]", "training.learning_rate=0.05",
       "sampling.max_staleness=0", "training.steps=3", "transport.recv_timeout_s=300", "sampling.wait_timeout_s=300"]


def trainer_args(run_dir, model_dir, data_dir, address):
    return [str(REPO / "training_worker.py"), "--config", str(PROCESS_CONFIG), f"run.dir={run_dir}",
            f"model.name_or_path={model_dir}", f"data.path={data_dir}", f"transport.address={address}", *RUN]


def one_node(run_dir, model_dir, data_dir, address):
    command = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_local_port()),
               *trainer_args(run_dir, model_dir, data_dir, address)]
    return [subprocess.Popen(command, stdout=open(run_dir / "trainer.log", "ab"), stderr=subprocess.STDOUT, cwd=REPO,
                             env=ENV)]


def two_nodes(run_dir, model_dir, data_dir, address):
    """What each of two machines would run: node 0 hosts the rendezvous and rank 0 (which binds the
    samplers' address and publishes), node 1 joins it over TCP."""
    port = str(free_local_port())
    return [subprocess.Popen([str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                              "--master_addr", "127.0.0.1", "--master_port", port,
                              *trainer_args(run_dir, model_dir, data_dir, address)],
                             stdout=open(run_dir / f"trainer-node{node}.log", "ab"), stderr=subprocess.STDOUT, cwd=REPO,
                             env=ENV)
            for node in (0, 1)]


def run(start, run_dir, model_dir, data_dir):
    run_dir.mkdir()
    address = free_tcp_address()
    trainers = start(run_dir, model_dir, data_dir, address)
    sampler = start_sampler(run_dir, model_dir, data_dir, address, *RUN)
    try:
        codes = [p.wait(timeout=600) for p in trainers] + [sampler.wait(timeout=120)]
    finally:
        for p in [*trainers, sampler]:
            p.kill()
    logs = "".join(p.read_text()[-3000:] for p in sorted(run_dir.glob("*.log")))
    assert codes == [0] * len(codes), logs
    assert read_latest(run_dir / "weights") == 3, logs
    return load_file(version_dir(run_dir / "weights", 3) / "adapter_model.safetensors"), logs


def test_two_trainer_nodes_publish_the_adapter_of_one_node_with_two_ranks(tmp_path, digit_model_dir, tiny_gsm8k):
    one, _ = run(one_node, tmp_path / "one-node", digit_model_dir, tiny_gsm8k)
    two, logs = run(two_nodes, tmp_path / "two-nodes", digit_model_dir, tiny_gsm8k)
    assert "2 ranks" in (tmp_path / "two-nodes" / "trainer-node0.log").read_text()
    assert one.keys() == two.keys() and any(v.abs().max() > 0 for k, v in one.items() if "lora_B" in k)
    for name in one:
        assert torch.equal(two[name], one[name]), name  # gloo sums two ranks in either order to the same bits
