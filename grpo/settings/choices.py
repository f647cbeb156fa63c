"""Each choice list of the config, defined once: the settings declare them as a key's choices, and the
module that implements each choice imports its list from here."""

KL_ESTIMATORS = ("k1", "k2", "k3")  # training.kl_estimator
KL_PLACES = ("loss", "reward")  # training.kl_in
AGGREGATIONS = ("grpo", "dapo", "dr_grpo")  # training.aggregation
ADVANTAGE_SCALES = ("group", "batch", "none")  # training.advantage_scale (grpo's)
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "dr_grpo")  # training.advantage, or an import path
POLICY_LOSSES = ("ppo_clip", "cispo", "sapo")  # training.loss, or an import path
# training.importance_sampling
IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SCHEDULES = ("constant", "linear", "cosine")  # training.lr_schedule
OLD_LOGPS_SOURCES = ("recompute", "generation")  # sampling.old_logps
NETWORK_MODES = ("deny", "allow")  # env.network, rewards.network
TRACKERS = ("none", "wandb", "trackio")  # logging.backend
WANDB_MODES = ("offline", "online")  # logging.wandb_mode


def name_or_import_path_problem(key: str, value: str, names: tuple[str, ...]) -> str:
    """Why `value` is neither one of `names` nor an import path 'module:function' ("" when it is one): the
    settings a user's function may fill (training.advantage, training.loss), imported at the start."""
    if value in names or ":" in value:
        return ""
    return f"{key} must be one of {', '.join(names)} or an import path 'module:function'; got {value!r}"
