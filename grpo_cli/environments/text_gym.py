"""skyrl-gym's text environments as they are (environment.style=text_gym): a `BaseTextEnv`
(skyrl_gym/envs/base_text_env.py, skyrl-gym 0.4: `init(prompt) -> (prompt, metadata)`,
`step(action) -> BaseTextEnvStepOutput {observations, reward, done, metadata,
postprocessed_action?}`, `close()`), named by its registered id or by import path:

    environment.style=text_gym environment.fn=gsm8k
    environment.style=text_gym environment.fn=my_pkg.envs:MyTextEnv

What grpo-cli does with it, as skyrl's own generator does:
- one environment per episode, constructed at reset with the row: `skyrl_gym.make(id,
  env_config=..., extras=...)` for an id, `Class(env_config=..., extras=...)` for a class, where
  env_config is environment.env_config (a DictConfig, as skyrl passes its per-env section) and
  extras the row's columns (skyrl's dataset passes every column but the prompt), with a
  `reward_spec` built from the row where it has none: {"method": "rule", "ground_truth": the
  `answer` column} (and the same as `reward_model`, the key verl-format datasets and skyrl's
  aime env read);
- `init(prompt messages)` at reset; the messages it returns are the prompt;
- `step(text)` each turn: its observations are the reply (their contents joined, the first
  one's role), `done` ends the episode, its rewards are summed (environment.reward_turns=sum)
  or the last one kept (last) as the episode's environment reward; a `postprocessed_action`
  that is a strict prefix of the turn's text cuts the turn's sampled tokens there (Reply.keep_text;
  counted as env/action_not_cut where no token prefix decodes to it exactly);
- `close()` after the episode, however it ended.
"""

from __future__ import annotations

from collections.abc import Callable

from grpo_cli.environments import ACTION_NOT_CUT, Reply, load_object
from grpo_cli.errors import UserError

INSTALL = "pip install -e '.[skyrl-gym]' in grpo-cli's folder"
#: The column whose value is the reward spec's ground truth, where a row carries no reward_spec.
ANSWER_COLUMN = "answer"


def _skyrl_gym():
    try:
        import skyrl_gym
        from skyrl_gym.envs.base_text_env import BaseTextEnv
    except ImportError as exc:
        raise UserError(
            f"environment.style=text_gym needs the skyrl-gym package, which is not installed ({exc}); "
            f"install it with {INSTALL}, or choose another environment.style (native, trl)."
        ) from None
    return skyrl_gym, BaseTextEnv


def env_creator(path: str) -> Callable:
    """environment.fn as a function of (env_config, extras) making a BaseTextEnv: a registered id
    (skyrl_gym.make) or a BaseTextEnv subclass by import path. UserError naming how to pick one."""
    skyrl_gym, base = _skyrl_gym()
    if ":" in path:
        cls = load_object(path, "environment.fn")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise UserError(
                f"environment.fn={path!r} is not a skyrl-gym BaseTextEnv subclass (environment.style="
                "text_gym takes one by import path, or a registered id such as gsm8k); subclass "
                "skyrl_gym.envs.base_text_env.BaseTextEnv, or choose environment.style=native or trl."
            )
        return lambda env_config, extras: cls(env_config=env_config, extras=extras)
    ids = sorted(skyrl_gym.registry)
    if path not in ids:
        raise UserError(
            f"environment.fn={path!r} is not a registered skyrl-gym environment; pick one of "
            f"{', '.join(ids)} (offline and safe: gsm8k, aime), or give a BaseTextEnv subclass by import "
            "path (environment.fn=my_pkg.envs:MyTextEnv)."
        )
    return lambda env_config, extras: skyrl_gym.make(path, env_config=env_config, extras=extras)


def extras(row: dict) -> dict:
    """skyrl's extras for a row: its columns but the prompt, with a rule reward spec from the
    `answer` column where the row has no reward_spec (also as reward_model, where absent)."""
    out = {k: v for k, v in row.items() if k != "prompt"}
    if "reward_spec" not in out and ANSWER_COLUMN in out:
        out["reward_spec"] = {"method": "rule", "ground_truth": str(out[ANSWER_COLUMN])}
    if "reward_model" not in out and "reward_spec" in out:
        out["reward_model"] = out["reward_spec"]
    return out


class TextGymEnv:
    """One episode's skyrl-gym text environment, as grpo-cli's environment interface."""

    metrics = (ACTION_NOT_CUT,)

    def __init__(self, creator: Callable, env_config: dict, reward_turns: str = "sum"):
        self.creator = creator
        self.env_config = env_config
        self.reward_turns = reward_turns
        self.env = None
        self.rewards: list[float] = []

    def reset(self, row: dict) -> list[dict]:
        from omegaconf import OmegaConf

        self.env = self.creator(OmegaConf.create(dict(self.env_config)), extras(row))
        prompt = row["prompt"]
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        messages, _metadata = self.env.init(messages)
        return list(messages)

    def step(self, text: str) -> Reply:
        out = self.env.step(text)
        self.rewards.append(float(out.get("reward") or 0.0))
        keep = out.get("postprocessed_action")
        keep = None if keep is None or keep == text else str(keep)
        observations = list(out.get("observations") or [])
        if out.get("done") or not observations:
            return Reply(done=True, keep_text=keep)
        content = "\n".join(str(m.get("content", "")) for m in observations)
        return Reply(content, role=observations[0].get("role", "user"), keep_text=keep)

    @property
    def instance(self):
        """The skyrl-gym environment itself: what the rewards get as `environments`."""
        return self.env

    def reward(self) -> float | None:
        if not self.rewards:
            return None
        return self.rewards[-1] if self.reward_turns == "last" else sum(self.rewards)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


def text_gym_factory(cfg, path: str) -> Callable[[], TextGymEnv]:
    """A function making one episode's environment: `path` (environment.fn, or one entry of its
    mapping) with cfg's (config.EnvironmentConfig) env_config and reward_turns."""
    from omegaconf import OmegaConf

    creator = env_creator(path)
    env_config = cfg.env_config or {}
    env_config = OmegaConf.to_container(env_config) if OmegaConf.is_config(env_config) else dict(env_config)
    return lambda: TextGymEnv(creator, env_config, cfg.reward_turns)
