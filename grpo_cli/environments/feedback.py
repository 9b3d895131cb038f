"""The `feedback` environment: when the model's answer is wrong, a second user turn says so and
lets it try again (environment.max_turns attempts in all). The reward is the final answer's:
the rewards read the whole conversation, and the accuracy reward grades its last answer.

The answer is checked like the accuracy reward checks it (the row's `answer` column, or the
column reward.accuracy.answer_column names; its default extraction). Its reward() is 1.0 when the
final answer is right, and the attempt it took is counted (Feedback.attempts).
"""

from __future__ import annotations

from grpo_cli.environments import Reply
from grpo_cli.rewards.accuracy import accuracy

TRY_AGAIN = "That is not right. Try again, and answer with only the number."


class Feedback:
    """One environment per episode (copied for the G episodes of a prompt). Its own metric:
    first_try, logged as env/first_try, the share of episodes right at the first attempt."""

    metrics = ("first_try",)

    def __init__(self, answer_column: str = "answer", message: str = TRY_AGAIN):
        self.answer_column = answer_column
        self.message = message
        self.gold = None
        self.attempts = 0
        self.correct = False

    def reset(self, row: dict) -> None:
        if self.answer_column not in row:
            raise KeyError(
                f"the feedback environment needs the column {self.answer_column!r}; the row has "
                f"{', '.join(sorted(row))}"
            )
        self.gold = row[self.answer_column]
        return None  # the prompt as the data gives it

    def step(self, text: str) -> Reply:
        self.attempts += 1
        self.correct = accuracy([text], answer=[self.gold], timeout_s=None)[0] == 1.0
        if self.correct:
            return Reply(done=True, metrics={"first_try": float(self.attempts == 1)})
        return Reply(self.message, role="user")

    def reward(self) -> float:
        return 1.0 if self.correct else 0.0
