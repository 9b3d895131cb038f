"""TRL's documented environment classes, as TRL's GRPO guide prints them, for grpo-cli to run as
they are (environment.style=trl; tests/test_trl_environments.py).

Source: huggingface/trl, docs/source/grpo_trainer.md, section "Agent Training" ->
"Environments", "Providing an external dataset (optional)" and "Multiple environments" (commit
f2cd57710, 2026-12; the same classes as TRL 1.16's guide). The classes are TRL's; only the names
of the second IncrementEnv (IncrementEnvFromData) and the reward for the multi-environment example
(the guide leaves it as `reward_func`, "it can branch on the environment type") are this file's.
"""

import random


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class IncrementEnvFromData:
    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:  # exposed as a tool (see the full docstring above)
        self.counter += step
        return self.counter


class CodingEnv:
    def reset(self, **kwargs) -> str:
        n = random.randint(1, 20)
        return f"Compute the {n}th Fibonacci number."

    def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        ...


class GameEnv:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        ...


def reward_func(completions, environments, **kwargs):
    """The multi-environment example's reward: branches on the environment type, as the guide
    suggests (a game episode that moved earns 1; a coding episode, its completion's length)."""
    return [
        min(1.0, len(str(c)) / 100) if isinstance(env, CodingEnv) else 1.0 if "move" in str(c) else 0.0
        for c, env in zip(completions, environments)
    ]
