"""An environment for grpo-chat's test (tests/test_chat.py), importable by the grpo-chat it starts."""

from grpo_cli.environments import Reply


class Lookup:
    """Answers the model's first turn as a tool (a message of its own, role tool), says nothing
    after the second (the episode ends). Turns end at any printable character (a token or two),
    so an untrained model's turn ends and the environment is asked."""

    stop = [chr(c) for c in range(33, 127)]

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return None

    def step(self, text):
        self.turns += 1
        return Reply("looked up: 42", role="tool", tool_call=True) if self.turns == 1 else None
