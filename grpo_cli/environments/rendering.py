"""The text side of an environment's episodes: a prompt rendered from the messages an
environment's reset returns, a reply's tokens where it joins the sequence (inline, or as a chat
message of its own after the model's end of turn: the chat template's text between the two
turns), and a turn cut at the token that completes a stop string. Never a re-rendering of the
history: the episode's sequence is its tokens, concatenated (environments.episodes).
"""

from __future__ import annotations

from grpo_cli.chat_template import render
from grpo_cli.data import format_prompt
from grpo_cli.environments import Reply
from grpo_cli.errors import UserError


class Rendering:
    """tokenizer: the model's (carrying model.chat_template_kwargs: chat_template.render);
    eos_ids: its end-of-turn ids; data: config.DataConfig (the prompt's system prompt), or None;
    describe: the environment, as its errors name it."""

    def __init__(self, tokenizer, eos_ids: list[int], *, data=None, describe: str = "environment"):
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.data = data
        self.describe = describe
        self._message_affixes: dict[str, tuple[str, str]] = {}

    def message_affixes(self, role: str) -> tuple[str, str]:
        """The chat template's text around a `role` message that follows an assistant turn's end
        of turn, up to the next assistant turn: (before the content, after it)."""
        if role not in self._message_affixes:
            t = self.tokenizer
            eos_text = t.decode([min(self.eos_ids)]) if self.eos_ids else ""
            marker, answer = "\u2063CONTENT\u2063", "\u2063ANSWER\u2063"
            convo = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": answer}]
            text = render(t, convo + [{"role": role, "content": marker}])
            # After the model's end of turn (its EOS, sampled): the template's text that follows it.
            # A template that ends a turn without the EOS token: the text after the answer.
            start, skip = text.find(answer + eos_text), len(answer) + len(eos_text)
            if start < 0 or not eos_text:
                start, skip = text.find(answer), len(answer)
            if start < 0 or marker not in text[start:]:
                raise UserError(
                    f"environment {self.describe}: the model's chat template does not render a {role!r} "
                    "message after an assistant turn (or the end-of-turn token is not where it ends "
                    "one); reply with role='user', or give the model a chat template that renders it."
                )
            after = text[start + skip :]
            before, _, rest = after.partition(marker)
            self._message_affixes[role] = (before, rest)
        return self._message_affixes[role]

    def reply_tokens(self, reply: Reply, ended_turn: bool) -> list[int]:
        """The reply's tokens: inline after a turn a stop string ended, else a message of its own."""
        text = reply.content
        if ended_turn:  # the model ended its message: the reply is a message of its own
            before, after = self.message_affixes(reply.role)
            text = before + text + after
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def cut_at_stop(self, ids: list[int], stop: list[str]) -> tuple[list[int], bool]:
        """The turn's tokens up to the one that completes a stop string (kept), and whether it did."""
        if not stop or not any(s in self.tokenizer.decode(ids) for s in stop):
            return ids, False
        for j in range(1, len(ids) + 1):
            if any(s in self.tokenizer.decode(ids[:j]) for s in stop):
                return ids[:j], True
        return ids, False

    def kept_tokens(self, ids: list[int], keep: str) -> int | None:
        """How many of a turn's tokens to keep for Reply.keep_text: the shortest prefix whose text
        starts with `keep`, where that text is exactly `keep` and shorter than the turn's (a cut
        that drops text); None where no prefix decodes to it exactly (a token straddles its end,
        or `keep` is not a strict prefix of the turn's text)."""
        text = self.text(ids)
        if keep == text or not text.startswith(keep):
            return None
        for j in range(len(ids)):
            head = self.text(ids[:j])
            if head.startswith(keep):
                return j if head == keep else None
        return None

    def prompt_ids(self, example, messages, tools=None) -> list[int]:
        """The episode's prompt: the example's own, or the messages reset returned, rendered like
        the data's (with the tools a chat template lists, under environment.protocol=native)."""
        if messages is None and not tools:
            return list(example.prompt_ids)
        d = self.data
        text = format_prompt(
            messages if messages is not None else example.prompt,
            self.tokenizer,
            system_prompt=d.system_prompt if d else None,
            use_chat_template=True,
            tools=tools,
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def text(self, ids: list[int]) -> str:
        """A turn's text as the environment's step reads it (special tokens left out)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)
