"""The typed config: YAML + overrides, coercion, and errors that name the problem."""

import re

import pytest
import yaml
from conftest import REPO, checked_config

from grpo.config import (
    Config,
    ConfigError,
    all_keys,
    load_config,
    parse_cli,
    reference_markdown,
    save_config,
    to_dict,
    validate,
)
from grpo.settings.foreign import FOREIGN_KEYS, FOREIGN_NAMES

REQUIRED_KEYS = [
    "model.name_or_path", "model.dtype", "lora.enabled", "lora.r", "data.path", "sampling.engine",
    "sampling.prompts_per_step", "sampling.group_size", "sampling.max_new_tokens", "sampling.temperature",
    "sampling.max_staleness", "training.steps", "training.use_gspo", "training.beta",
    "training.learning_rate", "transport.address", "run.dir", "seed",
]


def test_required_keys_exist_under_their_names():
    keys = set(all_keys())
    assert [k for k in REQUIRED_KEYS if k not in keys] == []


def test_default_config_yaml_loads_and_matches_documented_defaults():
    cfg = load_config(REPO / "config.yaml")
    assert cfg.model.name_or_path == "smollm2-135m-instruct"
    assert cfg.lora.enabled is True and cfg.training.use_gspo is False
    assert (cfg.training.clip_low, cfg.training.clip_high) == (0.2, 0.2)
    assert (cfg.training.beta, cfg.training.kl_estimator) == (0.04, "k3")
    # shaped for the embedded model (see the comments in config.yaml)
    assert cfg.data.prefill == "<think>\n" and cfg.training.learning_rate == 2e-4
    assert cfg.rewards.names == ["gsm8k_answer_lenient", "think_answer_format_partial"]
    assert str(cfg.run_dir) == "runs/gsm8k-lora-grpo"
    assert str(cfg.weights_dir) == "runs/gsm8k-lora-grpo/weights"


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "config":  # deepspeed.config is one pass-through value
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def test_config_yaml_and_the_built_in_defaults_are_the_same_run():
    """One source of defaults: every value in config.yaml is the dataclass default (deleting a line
    changes nothing), and docs/config.md's table is generated from the dataclasses."""
    shipped = _leaves(to_dict(load_config(REPO / "config.yaml")))
    built_in = _leaves(to_dict(validate(Config())))
    assert {k: (shipped[k], built_in[k]) for k in shipped if shipped[k] != built_in[k]} == {}
    written = _leaves(yaml.safe_load((REPO / "config.yaml").read_text()))
    assert {k: (v, built_in[k]) for k, v in written.items() if v != built_in[k]} == {}
    assert built_in["data.path"] == "gsm8k-embedded"  # the default run needs no network


def test_overrides_are_coerced_to_the_field_types():
    cfg = load_config(REPO / "config.yaml", [
        "training.use_gspo=true", "sampling.temperature=0.7", "sampling.group_size=4",
        "training.learning_rate=3e-6", "lora.target_modules=[q_proj,v_proj]", "rewards.weights=[2, 0.5]",
        "run.name=123", "run.dir=/tmp/x", "training.clip_high=1",
    ])
    assert cfg.training.use_gspo is True
    assert cfg.sampling.temperature == 0.7 and cfg.sampling.group_size == 4
    assert cfg.training.learning_rate == 3e-6
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.rewards.weights == [2.0, 0.5] and all(type(w) is float for w in cfg.rewards.weights)
    assert cfg.run.name == "123" and str(cfg.run_dir) == "/tmp/x"
    assert cfg.training.clip_high == 1.0 and type(cfg.training.clip_high) is float


def test_gspo_switch_sets_the_paper_clip_defaults_unless_explicit():
    cfg = load_config(None, ["training.use_gspo=true"])
    assert (cfg.training.clip_low, cfg.training.clip_high) == (3e-4, 4e-4)
    cfg = load_config(None, ["training.use_gspo=true", "training.clip_high=1e-3"])
    assert (cfg.training.clip_low, cfg.training.clip_high) == (3e-4, 1e-3)


def test_later_sources_win_file_then_cli(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sampling:\n  group_size: 4\n  temperature: 0.5\n")
    cfg = parse_cli(["--config", str(path), "sampling.group_size=6"])
    assert (cfg.sampling.group_size, cfg.sampling.temperature) == (6, 0.5)


def test_cli_ignores_deepspeed_local_rank_argument():
    assert parse_cli(["--local_rank=1", "seed=3"], default_path=None).seed == 3
    assert parse_cli(["--local_rank", "0", "seed=4"], default_path=None).seed == 4


def test_deepspeed_passthrough_takes_nested_dotted_keys():
    cfg = load_config(None, ["deepspeed.config.zero_optimization.offload_optimizer.device=cpu"])
    assert cfg.deepspeed.config == {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize("override, message", [
    ("sampling.group_szie=4", "unknown config key 'sampling.group_szie'; did you mean 'sampling.group_size'?"),
    ("trainig.beta=0.1", "unknown config key 'trainig.beta'; did you mean 'training.beta'?"),
    ("sampling.group_size.x=1", "unknown config key 'sampling.group_size.x'"),
    ("sampling.group_size=four", "sampling.group_size: expected int, got 'four' (str)"),
    ("sampling.group_size=2.5", "sampling.group_size: expected int, got 2.5 (float)"),
    ("training.use_gspo=yesplease", "training.use_gspo: expected bool, got 'yesplease' (str)"),
    ("sampling.temperature=[1]", "sampling.temperature: expected float, got [1] (list)"),
    ("sampling.temperature=warm", "sampling.temperature: expected float, got 'warm' (str)"),
    ("lora.target_modules=q_proj",
     "lora.target_modules must be a list of module names or all-linear alone; got 'q_proj'"),
    ("sampling=3", "sampling: expected a section (mapping), got 3"),
    ("novalue", "override 'novalue' is not of the form key=value"),
])
def test_bad_keys_and_types_name_the_key_value_and_type(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["sampling.group_size=1"], "sampling.group_size must be >= 2 (group-relative advantages need two); got 1"),
    (["sampling.temperature=0"], "sampling.temperature must be > 0"),
    (["sampling.top_p=1.5"], "sampling.top_p must be in (0, 1]; got 1.5"),
    (["sampling.max_staleness=-1"], "sampling.max_staleness must be >= 0"),
    (["sampling.max_staleness=1", "weights.publish_every=3"],
     "sampling.max_staleness=1 cannot hold with weights.publish_every=3: versions are published every 3 steps, "
     "so a step may be 2 versions behind; set sampling.max_staleness >= 2 or publish more often"),
    (["data.few_shot=-1"], "data.few_shot must be >= 0 (0 = none); got -1"),
    (["sampling.old_logps=cached"], "sampling.old_logps must be one of recompute, generation; got 'cached'"),
    (["sampling.in_flight_kv=reuse"], "sampling.in_flight_kv must be one of recompute, keep; got 'reuse'"),
    (["sampling.in_flight_updates=true", "sampling.old_logps=recompute"],
     "sampling.in_flight_updates needs sampling.continuous_batching=true and "
     "sampling.old_logps=generation (a recompute after generation would score every token with the newest "
     "weights); got continuous_batching=True, old_logps=recompute"),
    (["sampling.in_flight_updates=true", "sampling.engine=vllm", "sampling.in_flight_kv=keep"],
     "sampling.in_flight_updates on vllm needs lora.enabled=true (its requests move to each new adapter; full "
     "weights load between steps) and sampling.in_flight_kv in ['recompute'] (a moved request's prefix is "
     "prefilled again); got lora.enabled=True, in_flight_kv=keep"),
    (["training.reference_on=trainer", "lora.enabled=false"], "training.reference_on=trainer needs lora.enabled"),
    (["data.path=shapes", "sampling.engine=vllm"], "prompts with images (data.image_column, data.path=shapes) run on "
                                                   "sampling.engine=hf; vLLM takes text prompts here"),
    (["data.image_column=image", "env.tools=[grpo.environments.calculator:calculate]"],
     "prompts with images run as single completions"),
    (["data.path=shapes", "distill.teacher=smollm2-135m-instruct"], "prompts with images and distill.teacher"),
    (["data.path=shapes", "model.attn_implementation=flex_attention"], "prompts with images and "
     "model.attn_implementation=flex_attention: transformers' Qwen2-VL and Qwen2.5-VL do not take FlexAttention"),
    (["model.train_vision=true"], "model.train_vision trains a vision-language model's vision encoder, and this run's "
                                  "prompts hold no images (data.image_column, data.path: shapes)"),
    (["training.kl_in=reward", "training.beta=0"], "training.kl_in=reward with training.beta=0 puts no KL in the"),
    (["training.kl_in=reward", "training.kl_estimator=k1", "training.reference_on=trainer"],
     "training.kl_in=reward needs training.reference_on=sampler"),
    (["training.kl_in=reward", "training.reference_on=sampler"], "training.kl_in=reward needs "
     "training.kl_estimator=k1 (got k3): as a reward only k1's expectation has the KL's gradient"),
    (["training.kl_in=reward", "training.kl_estimator=k1", "training.reference_on=sampler", "distill.teacher=x"],
     "training.kl_in=reward puts the KL in the rewards' advantage, which distill.with_rewards=false leaves out"),
    (["training.kl_in=rewards"], "training.kl_in must be one of loss, reward; got 'rewards'"),
    (["distill.teacher=x", "sampling.dynamic_sampling=true"], "with distill.teacher and distill.with_rewards=false "
     "the rewards do not enter the advantages"),
    (["distill.coef=0"], "distill.coef must be > 0; got 0"),
    (["distill.teacher_url=http://h:8000/v1", "sampling.temperature=1.0"], "distill.teacher_url needs distill.teacher"),
    (["distill.teacher=x", "distill.teacher_url=h:8000/v1", "sampling.temperature=1.0"],
     "distill.teacher_url must be an http:// or https:// URL, e.g. http://host:8000/v1; got 'h:8000/v1'"),
    (["distill.teacher=x", "distill.teacher_url=http://h:8000/v1"], "distill.teacher_url: the server's prompt "
     "log-probs are the teacher's at temperature 1, and the student samples at sampling.temperature=0.9"),
    (["distill.timeout_s=0"], "distill.timeout_s must be > 0; got 0"),
    (["distill.teacher=x", "distill.served_name=y"], "distill.served_name names the teacher on its server: it needs "
     "distill.teacher_url"),
    (["training.max_token_age=-2"], "training.max_token_age must be >= 0 or -1 (-1 = off); got -2"),
    (["training.max_token_age=1", "weights.publish_every=3", "sampling.max_staleness=2"],
     "training.max_token_age=1 with weights.publish_every=3 would leave every token of some steps out of the loss"),
    (["training.aggregation=sum"], "training.aggregation must be one of grpo, dapo, dr_grpo; got 'sum'"),
    (["training.kl_estimator=k4"], "training.kl_estimator must be one of k1, k2, k3; got 'k4'"),
    (["model.dtype=fp8"], "model.dtype must be one of float32, bfloat16, float16; got 'fp8'"),
    (["deepspeed.zero_stage=4"], "deepspeed.zero_stage must be in [0, 3]; got 4"),
    (["rewards.weights=[1.0]"], "rewards.weights has 1 entries but rewards.names has 2; give one weight per"),
    (["rewards.names=[gsm8k_answer,nope]"],
     "rewards.names: unknown reward 'nope'; valid names: answer_format, env_reward, gsm8k_answer"),
    (["rewards.accuracy_reward=nope"], "rewards.accuracy_reward: unknown reward 'nope'; valid names: answer_format"),
    (["lora.target_modules=[]"], "lora.target_modules is empty"),
    (["transport.address=tcp://0.0.0.0:5555"], "is not loopback: set transport.secret"),
    (["transport.address=http://x"], "transport.address must start with one of tcp://, ipc://, inproc://"),
    (["training.max_bad_steps=0"], "training.max_bad_steps must be >= 1; got 0"),
    (["rewards.timeout_s=-1"], "rewards.timeout_s must be >= 0 (0 = no limit); got -1.0"),
    (["rewards.max_failed_steps=-1"], "rewards.max_failed_steps must be >= 0 (0 = never stop); got -1"),
    (["env.max_failed_steps=-1"], "env.max_failed_steps must be >= 0 (0 = never stop); got -1"),
    (["launch.max_minutes=-5"], "launch.max_minutes must be >= 0 (0 = no limit); got -5.0"),
    (["checkpoint.resume=true"], "checkpoint.resume must be auto, never or a checkpoint folder"),
    (["checkpoint.resume=runs/typo/checkpoints"], "got 'runs/typo/checkpoints'"),
    (["rewards.names=[env_reward]", "rewards.weights=[1.0]"], "env_reward is the reward an environment (or your "
                                                              "agent loop) gives its episodes, and env.name, "
                                                              "agent.entrypoint and agent.command are empty: set one"),
    (["agent.entrypoint=my_agent.solve"], "agent.entrypoint must be 'package.module:function' or "
                                          "'path/to/file.py:function'; got 'my_agent.solve'"),
    (["agent.entrypoint=my_agent:solve", "data.prefill=", "env.name=calculator"],
     "agent.entrypoint runs your own agent loop, and env.name=calculator runs episodes of an environment: set one "
     "of them"),
    (["agent.entrypoint=my_agent:solve"], "data.prefill starts each model turn with fixed text, and "
                                          "your agent's turns start where your loop's messages leave them: "
                                          "unset data.prefill"),
    (["agent.entrypoint=my_agent:solve", "data.prefill=", "agent.max_sessions=3", "sampling.group_size=4"],
     "agent.max_sessions=3 is under sampling.group_size=4: a group's sessions open together (they share its prompt); "
     "set it >= 4, or 0 for no limit"),
    (["env.name=calc"], "env.name: unknown environment 'calc'; valid: '' (off), calculator, tools, "
                        "openenv:package.module:Class, openenv+http://host:port, package.module:factory, "
                        "path/to/file.py:factory"),
    (["launch.trainer_ranks=7", "sampling.prompts_per_step=2"],
     "launch.trainer_ranks=7 is more than sampling.prompts_per_step=2: each rank trains whole groups, so 5 rank(s) "
     "would have nothing to do"),
])
def test_cross_field_rules_say_what_to_do(overrides, message):
    with pytest.raises(ConfigError) as e:
        checked_config(None, overrides)
    assert message in str(e.value)


MY_ENV = """\
from grpo.environments import Reply


class MyEnv:
    def __init__(self, row, tries: int = 3, size: int = 4):
        self.tries, self.size = tries, size

    def step(self, message):
        return Reply(done=True)


def anything(row, **settings):
    return MyEnv(row)
"""


def test_an_env_args_key_the_environment_does_not_take_is_a_config_error_naming_what_it_takes(tmp_path):
    """Read off the factory's signature at start: a user's class, the calculator, an OpenEnv class's init;
    a factory with **kwargs takes any key."""
    (tmp_path / "my_env.py").write_text(MY_ENV)
    my_env = f"{tmp_path}/my_env.py"
    openenv = f"{REPO}/tests/openenv_envs.py:GuessNumber"
    cases = [([f"env.name={my_env}:MyEnv", "env.args={trys: 4, size: 2}"],
              f"env.args key 'trys' is not a parameter of {my_env}:MyEnv (it takes: tries, size)"),
             (["env.name=calculator", "env.args={max_call: 2}"],
              "env.args key 'max_call' is not a parameter of the calculator environment (it takes: max_calls)"),
             ([f"env.name=openenv:{openenv}", "env.args={init: {trys: 5}}"],
              f"env.args.init key 'trys' is not a parameter of {openenv} (it takes: low, high, tries, closed_log)")]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as e:
            checked_config(None, overrides)
        assert str(e.value) == f"invalid config:\n  {message}"
    assert checked_config(None, [f"env.name={my_env}:anything", "env.args={trys: 4}"]).env.args == {"trys": 4}
    assert checked_config(None, [f"env.name={my_env}:MyEnv", "env.args={tries: 4}"]).env.args == {"tries": 4}


def test_all_errors_are_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sampling.group_size=1", "sampling.temperature=-1"])
    assert "group_size" in str(e.value) and "temperature" in str(e.value)


def test_every_unknown_key_and_bad_value_of_file_and_overrides_is_in_one_message(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sampling:\n  temprature: 0.5\n  group_size: many\ntraining:\n  lr: 1.0e-5\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["num_generations=4", "sampling.top_p=2", "checkpoint.resume=nevr"])
    assert str(e.value).splitlines() == [
        "invalid config:",
        "  unknown config key 'sampling.temprature'; did you mean 'sampling.temperature'?",
        "  sampling.group_size: expected int, got 'many' (str)",
        "  unknown config key 'training.lr'; did you mean 'training.learning_rate'?",
        "  unknown config key 'num_generations'; did you mean 'sampling.group_size'?",
        "  sampling.top_p must be in (0, 1]; got 2.0",
        "  checkpoint.resume must be auto, never or a checkpoint folder (one holding DeepSpeed's 'latest' file, e.g. "
        "runs/<name>/checkpoints); got 'nevr'",
    ]


@pytest.mark.parametrize("theirs, ours", [
    ("lr", "'training.learning_rate'"), ("training.lr", "'training.learning_rate'"),
    ("learning_rate", "'training.learning_rate'"), ("num_generations", "'sampling.group_size'"),
    ("max_completion_length", "'sampling.max_new_tokens'"), ("max_prompt_length", "'data.max_prompt_tokens'"),
    ("per_device_train_batch_size", "sampling.prompts_per_step (prompts, each with sampling.group_size completions)"),
    ("epsilon", "'training.clip_low'"), ("epsilon_high", "'training.clip_high'"),
    ("loss_type", "training.aggregation (grpo, dapo, dr_grpo), training.loss (cispo, sapo)"),
    ("use_vllm", "'sampling.engine=vllm'"),
    ("sampling.beta", "'training.beta'"), ("actor_rollout_ref.rollout.n", "'sampling.group_size'"),
    ("kl_loss_coef", "'training.beta'"), ("model_name_or_path", "'model.name_or_path'"),
])
def test_names_users_bring_from_trl_openrlhf_and_verl_are_mapped_to_ours(theirs, ours):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{theirs}=1"])
    assert f"unknown config key '{theirs}'; did you mean {ours}?" in str(e.value)


@pytest.mark.parametrize("theirs, message", [
    # veRL (verl/trainer/config/ppo_trainer.yaml)
    ("actor_rollout_ref.model.path", "did you mean 'model.name_or_path'?"),
    ("trainer.save_freq", "did you mean 'checkpoint.every'?"),
    ("trainer.n_gpus_per_node", "grpo train places the processes on the GPUs it sees (CUDA_VISIBLE_DEVICES); "
                                "launch.trainer_ranks sets how many of them train, the rest sample"),
    ("actor_rollout_ref.actor.optim.lr", "did you mean 'training.learning_rate'?"),
    ("actor_rollout_ref.actor.clip_ratio_high", "did you mean 'training.clip_high'?"),
    ("actor_rollout_ref.actor.loss_agg_mode", "did you mean training.aggregation (token-mean: dapo, "
                                              "seq-mean-token-mean: grpo, seq-mean-token-sum-norm: dr_grpo)?"),
    ("actor_rollout_ref.rollout.response_length", "did you mean 'sampling.max_new_tokens'?"),
    ("trainer.test_freq", "did you mean 'eval.every'?"),
    ("trainer.experiment_name", "did you mean 'run.name'?"),
    ("data.train_files", "did you mean data.path (a Hub dataset id, or a folder with train.jsonl and test.jsonl "
                         "or parquet files)?"),
    ("data.max_prompt_length", "did you mean 'data.max_prompt_tokens'?"),
    ("data.prompt_key", "did you mean 'data.prompt_column'?"),
    ("reward_model.model.path", "did you mean rewards.names=[reward_model:<folder or Hub id>]?"),
    # OpenRLHF (openrlhf/cli/train_ppo_ray.py), flat and dotted flags
    ("pretrain", "did you mean 'model.name_or_path'?"),
    ("n_samples_per_prompt", "did you mean 'sampling.group_size'?"),
    ("eps_clip", "did you mean training.clip_low and training.clip_high (set separately)?"),
    ("ckpt.save_steps", "did you mean 'checkpoint.every'?"),
    ("rollout.batch_size", "did you mean 'sampling.prompts_per_step'?"),
    ("use_wandb", "did you mean 'logging.backend=wandb'?"),
])
def test_verl_and_openrlhf_names_get_the_key_that_does_their_job(theirs, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{theirs}=1"])
    assert str(e.value).splitlines()[1] == f"  unknown config key '{theirs}'; {message}"


@pytest.mark.parametrize("theirs", [
    "actor_rollout_ref.model.use_remove_padding", "trainer.balance_batch", "critic.optim.lr",
    "algorithm.kl_ctrl.target_kl", "reward_model.micro_batch_size", "data.custom_cls.path", "actor_init_on_gpu",
])
def test_foreign_names_without_a_counterpart_get_no_guess(theirs):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{theirs}=1"])
    assert str(e.value).splitlines()[1] == \
        f"  unknown config key '{theirs}'; see --help-config or docs/config.md for every key"


def test_every_suggested_key_exists():
    named = {re.match(r"[a-z_.]*", hint).group() for hint in [*FOREIGN_KEYS.values(), *FOREIGN_NAMES.values()]}
    assert sorted(k for k in named if "." in k and k not in all_keys()) == []


def test_non_loopback_address_is_allowed_with_a_secret_or_explicit_opt_in():
    assert load_config(None, ["transport.address=tcp://0.0.0.0:5555", "transport.secret=s3cret"])
    assert load_config(None, ["transport.address=tcp://0.0.0.0:5555", "transport.allow_insecure=true"])
    assert load_config(None, ["transport.address=tcp://[::1]:5555"])


def test_bad_yaml_files_are_named(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match="config file .*missing.yaml does not exist"):
        load_config(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("sampling: [1, 2")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections, got list"):
        load_config(listy)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("sampling:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError, match="did you mean 'sampling.temperature'"):
        load_config(unknown)


def test_resolved_config_round_trips_through_the_run_folder(tmp_path):
    cfg = load_config(REPO / "config.yaml", ["training.use_gspo=true", "seed=7"])
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["training"]["clip_low"] == 3e-4 and saved["seed"] == 7
    assert load_config(tmp_path / "config.yaml") == cfg


def test_docs_config_documents_every_config_key():
    reference = (REPO / "docs" / "config.md").read_text()
    assert reference_markdown() in reference, "docs/config.md is stale: paste grpo.config.reference_markdown()"


def test_every_help_is_at_most_two_lines():
    """`--help-config` wraps each key's help (with its declared bound) at 100 columns, indented by 4:
    no help takes more than two lines there; what more there is to say goes to docs/config.md's Details."""
    import textwrap

    from grpo.settings.tree import _leaves as help_of_every_key

    long = [key for key, _, help in help_of_every_key(Config, Config())
            if len(textwrap.wrap(help, width=100, initial_indent="    ", subsequent_indent="    ")) > 2]
    assert long == []


def test_defaults_are_not_shared_between_instances():
    a, b = Config(), Config()
    a.lora.target_modules.append("x")
    assert "x" not in b.lora.target_modules


def test_an_engine_setting_that_moved_names_its_new_key_and_a_saved_config_reads_it_there(tmp_path):
    """The vLLM engine's settings are sampling.vllm.*: a config with an old flat key is told the new
    one; a run's saved config of an earlier version (flat keys) resumes with them in their new place."""
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["sampling.vllm_gpu_memory_utilization=0.3", "launch.vllm_python=/x/python"])
    assert "config key 'sampling.vllm_gpu_memory_utilization' is now 'sampling.vllm.gpu_memory_utilization'" in \
        str(raised.value)
    assert "config key 'launch.vllm_python' is now 'sampling.vllm.python'" in str(raised.value)
    saved = tmp_path / "config.yaml"
    saved.write_text("sampling: {vllm_gpu_memory_utilization: 0.3, vllm_kv_cache_gb: 1.5}\n"
                     "launch: {vllm_python: /x/python}\n")
    cfg = load_config(saved, written_by_a_run=True)
    assert (cfg.sampling.vllm.gpu_memory_utilization, cfg.sampling.vllm.kv_cache_gb, cfg.sampling.vllm.python) == \
        (0.3, 1.5, "/x/python")


def declared(meta: str) -> list[tuple[str, object, object]]:
    """(key, what the field declares under `meta`, its type annotation) of every field that declares it."""
    import dataclasses
    import typing

    from grpo.settings import Config

    found = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            elif f.metadata.get(meta):
                found.append((prefix + f.name, f.metadata[meta], hints[f.name]))

    walk(Config, "")
    return found


def declared_bounds() -> list[tuple[str, str, type]]:
    """(key, bound, type) of every field that declares one."""
    import typing

    return [(key, bound, float if float in typing.get_args(hint) or hint is float else int)
            for key, bound, hint in declared("bound")]


def edges(bound: str) -> tuple[list[float], list[float]]:
    """(values just inside `bound`, values just outside it), worked out by hand per form."""
    rest, _, other = bound.partition(" or ")
    extra = [float(other)] if other else []
    if rest.startswith(">="):
        a = float(rest[2:])
        return [a, a + 1, *extra], [a - 2 if a - 1 in extra else a - 1, float("nan")]
    if rest.startswith(">"):
        a = float(rest[1:])
        return [a + 0.5, *extra], [a, a - 1]
    low, high = (float(x) for x in rest[4:-1].split(","))
    inside = [low] if rest[3] == "[" else [(low + high) / 2]
    inside += [high] if rest[-1] == "]" else []
    outside = [low - 1, high + 1] + ([low] if rest[3] == "(" else []) + ([high] if rest[-1] == ")" else [])
    return inside, outside


def test_every_declared_bound_is_checked_at_its_edges_with_one_text():
    """Each field's own range is declared on it (grpo/settings) and checked in one place: a value
    just outside is refused as `key must be <bound>...; got <value>`, a value at the edge is not."""
    from grpo.settings.tree import field_problems, set_key

    bounds = declared_bounds()
    assert len(bounds) >= 50 and ("sampling.temperature", "> 0", float) in bounds
    for key, bound, number in bounds:
        inside, outside = edges(bound)
        for value in inside:
            if number is int and value != int(value):
                continue
            cfg = Config()
            set_key(cfg, key.split("."), number(value) if value == value else value, False, key, Config)
            assert not [p for p in field_problems(cfg) if p.startswith(f"{key} ")], (key, value)
        for value in outside:
            if number is int and (value != value or value != int(value)):
                continue
            cfg = Config()
            set_key(cfg, key.split("."), number(value) if value == value else value, False, key, Config)
            assert [p for p in field_problems(cfg) if p.startswith(f"{key} must be {bound}")], (key, value)


def test_every_declared_choice_refuses_other_values_with_one_text():
    """Each choice list is declared on its field: every listed value passes; a value outside, or a
    listed one in the wrong case, is refused as `key must be one of a, b; got 'c'`."""
    from grpo.settings.tree import field_problems, get_key

    choices = {key: options for key, options, _ in declared("choices")}
    assert len(choices) == 23 and choices["training.aggregation"] == ("grpo", "dapo", "dr_grpo")
    for key, options in choices.items():
        *parents, leaf = key.split(".")
        for value in options:
            cfg = Config()
            setattr(get_key(cfg, ".".join(parents)), leaf, value)
            assert not field_problems(cfg), (key, value)
        for value in ("nope", options[-1].swapcase()):
            cfg = Config()
            setattr(get_key(cfg, ".".join(parents)), leaf, value)
            assert field_problems(cfg) == [f"{key} must be one of {', '.join(options)}; got {value!r}"]


def test_the_rules_and_what_the_config_names_are_reported_at_once():
    """A process loads its config with the checks of what it names: a wrong choice, an unknown reward
    and an unknown environment come back in one error, not one per start."""
    with pytest.raises(ConfigError) as e:
        checked_config(None, ["training.kl_estimator=k9", "rewards.names=[nope]", "rewards.weights=[1.0]",
                              "env.name=nope"])
    lines = str(e.value).splitlines()[1:]
    assert lines[0] == "  training.kl_estimator must be one of k1, k2, k3; got 'k9'"
    assert any(line.startswith("  rewards.names: unknown reward 'nope'") for line in lines)
    assert any(line.startswith("  env.name: unknown environment 'nope'") for line in lines)


def test_the_advantage_and_the_loss_take_a_name_or_an_import_path_each_checked():
    from grpo.run.preflight import named_code_problems

    cfg = load_config(None, ["training.advantage=rloo", "training.loss=cispo"])
    assert (cfg.training.advantage, cfg.training.loss, cfg.training.clip_low, cfg.training.clip_high) == \
        ("rloo", "cispo", 1.0, 4.0)  # CISPO's own clip defaults: no lower bound, the weight capped at 5
    with pytest.raises(ConfigError) as e:
        load_config(None, ["training.advantage=rlooo", "training.loss=cisp", "training.advantage_scale=batch"])
    assert str(e.value).splitlines()[1:] == [
        "  training.advantage must be one of grpo, rloo, reinforce_pp, dr_grpo or an import path "
        "'module:function'; got 'rlooo'",
        "  training.loss must be one of ppo_clip, cispo, sapo or an import path 'module:function'; got 'cisp'",
        "  training.advantage_scale=batch scales grpo's advantages; training.advantage=rlooo scales its own: leave "
        "training.advantage_scale at group"]
    with pytest.raises(ConfigError, match=r"training.loss: cannot import 'no_such_module:loss'"):
        load_config(None, ["training.loss=no_such_module:loss"], checks=[named_code_problems])
    assert load_config(None, ["training.advantage=tests/test_advantages.py:double_the_centred"],
                       checks=[named_code_problems]).training.advantage.endswith(":double_the_centred")
