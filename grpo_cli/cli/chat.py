"""`grpo-chat`: ask a model or a grpo-cli checkpoint something, its reply streamed as it is made.

    grpo-chat outputs/2026-12-07/10-00-00 -p "What is 17 + 25?"     # a run: its best, else last checkpoint
    grpo-chat outputs/.../checkpoints/step-000064                   # a checkpoint: an interactive session
    grpo-chat qwen0.5b -p "Hello"                                   # a preset, a hub id or a model folder
    grpo-chat                                                       # the default model

A checkpoint (or a run's) is loaded as grpo-eval loads it: its saved config (the chat template,
model.chat_template_kwargs, data.system_prompt, the sampler's temperature, top_p, top_k and
max_new_tokens) with the overrides on top, a LoRA checkpoint as its adapter on the base model
(nothing merged). The reply comes from transformers' `generate` with a `TextStreamer` (a chat needs
no bit-exact sampler); `--greedy` takes the most likely token each step. Without a chat template
each message is the model's whole prompt (no history). In a session: /reset clears the history,
/exit (or Ctrl-D) quits.

With an environment (`--environment calculator`, a preset, or `--environment my_pkg.envs:MyEnv`,
as environment.fn; or the checkpoint's own, from its config) each message starts an episode, run as
training runs it (the sampler and the environment's turns: environments.episodes), then shown turn
by turn, each marked with who wrote it: `[assistant]` the model, `[tool]` a tool's result or an
environment's reply inline, `[user]` an environment's message of its own. An episode is not
streamed token by token, and has no history across messages.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpo_cli.environments import environment_factory
from grpo_cli.errors import UserError, report_and_exit


def resolve_target(target: str | None) -> tuple[list[str], str | None]:
    """(overrides, checkpoint) for MODEL_OR_CHECKPOINT: a checkpoint folder (its config.yaml), a
    run folder (its checkpoints/best, else its last checkpoint), a preset (model=NAME), or a hub id
    or model folder (model.name_or_path); None: the default model."""
    from grpo_cli import checkpoint as ckpt
    from grpo_cli import memory

    if target is None:
        return [], None
    path = Path(target)
    if (path / "config.yaml").is_file() and not (path / "checkpoints").is_dir():
        return [], str(path)
    if (path / "checkpoints").is_dir():
        best = path / "checkpoints" / "best"
        saved = [best] if (best / "config.yaml").is_file() else ckpt.list_checkpoints(path)
        if not saved:
            raise UserError(
                f"{target} is a run folder without a checkpoint to talk to (its checkpoints/ is empty); "
                "name a checkpoint folder, or let the run save one (trainer.save_steps)."
            )
        return [], str(saved[-1])
    if memory.preset_source(target) is not None:
        return [f"model={target}"], None
    return [f"model.name_or_path={target}"], None


def load(cfg, log):
    """The model (eval, in the config's precision; a LoRA checkpoint's adapter on its base), its
    tokenizer (with model.chat_template_kwargs) and the device."""
    from grpo_cli.build import build_tokenizer, load_policy
    from grpo_cli.precision import resolve_device, resolve_precision

    device = resolve_device(cfg.trainer.device)
    precision = resolve_precision(cfg.trainer.precision, device, adapted=cfg.adapter.name != "none")
    source, tokenizer = build_tokenizer(cfg, log)
    log(f"grpo-chat device={device} precision={precision.name} model: {source.description}")
    model = load_policy(cfg, source, device, precision, trainable=False)
    model.eval()
    return model, tokenizer, device


def prompt_text(messages: list[dict], tokenizer, cfg) -> str:
    """The text the model continues: the conversation through the chat template (with
    data.system_prompt), or, without a template, the last message alone (data.format_prompt)."""
    from grpo_cli.data import format_prompt

    d = cfg.data
    if getattr(tokenizer, "chat_template", None) and d.use_chat_template:
        return format_prompt(messages, tokenizer, system_prompt=d.system_prompt, use_chat_template=True)
    return format_prompt(
        messages[-1]["content"], tokenizer, system_prompt=d.system_prompt, use_chat_template=False
    )


def reply(model, tokenizer, text: str, device, settings: dict, stream) -> str:
    """One reply to `text`, its tokens written to `stream` as they are made; the reply's text.
    settings: max_new_tokens, temperature (0: greedy), top_p, top_k (0: off)."""
    import torch
    from transformers import TextStreamer

    from grpo_cli.build import eos_token_ids

    class _To(TextStreamer):  # (TextStreamer prints to stdout; this one to `stream`)
        def on_finalized_text(self, piece: str, stream_end: bool = False) -> None:
            stream.write(piece + ("\n" if stream_end else ""))
            stream.flush()

    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(device)
    greedy = settings["temperature"] <= 0
    sampling = (
        {}
        if greedy
        else {
            "temperature": settings["temperature"],
            "top_p": settings["top_p"],
            "top_k": settings["top_k"] or None,
        }
    )
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=settings["max_new_tokens"],
            do_sample=not greedy,
            eos_token_id=eos_token_ids(tokenizer, model),
            pad_token_id=tokenizer.pad_token_id,
            streamer=_To(tokenizer, skip_prompt=True, skip_special_tokens=True),
            **sampling,
        )
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def environment_override(name: str) -> str:
    """--environment NAME: a preset (environment=calculator) or, with a dot or colon, a class by
    import path (environment.fn=my_pkg.envs:MyEnv)."""
    return f"environment.fn={name}" if ("." in name or ":" in name) else f"environment={name}"


def episode(cfg, model, tokenizer, prompt: str, settings: dict, seed: int, stream) -> list[dict]:
    """One episode of cfg's environment on `prompt` (a row whose prompt column is it), drawn by the
    built-in sampler with `settings` and the environment's own turns, then written to `stream` turn
    by turn, each marked with its writer; the turns as {role, content} messages."""
    import dataclasses

    from grpo_cli.build import eos_token_ids
    from grpo_cli.data import Formatting, to_examples
    from grpo_cli.environments.episodes import environment_episodes
    from grpo_cli.environments.path import RolloutPath
    from grpo_cli.precision import resolve_precision
    from grpo_cli.rewards import conversation
    from grpo_cli.samplers import Context, build_sampler

    greedy = settings["temperature"] <= 0
    sampling = dataclasses.replace(
        cfg.sampler,
        backend="builtin",  # (a chat needs no engine of its own)
        options={},
        max_new_tokens=settings["max_new_tokens"],
        temperature=1.0 if greedy else settings["temperature"],
        num_generations=1,
    )
    eos = eos_token_ids(tokenizer, model)
    device = next(model.parameters()).device
    precision = resolve_precision(cfg.trainer.precision, device, adapted=cfg.adapter.name != "none")
    context = Context(
        model, eos_ids=eos, pad_id=tokenizer.pad_token_id, precision=precision, seed=seed, tokenizer=tokenizer
    )
    sampler = build_sampler(sampling, context)
    episodes = environment_episodes(  # (each turn's budget: --max-new-tokens)
        dataclasses.replace(cfg, sampler=sampling),
        tokenizer=tokenizer,
        eos_ids=eos,
        pad_id=tokenizer.pad_token_id,
    )
    examples = to_examples(
        [{cfg.data.prompt_column: prompt}],
        tokenizer,
        Formatting.of(cfg.data, cfg.sampler.max_prompt_length),
        "the prompt",
    )
    try:
        rollout = RolloutPath(sampler, episodes).draw(
            examples, seeds=[seed], num_generations=1, greedy=greedy
        )
    finally:
        sampler.close()
    turns = conversation(tokenizer, rollout.completion_ids[0], rollout.roles[0])
    for turn in turns:
        stream.write(f"[{turn['role']}] {turn['content']}\n")
    stream.flush()
    return turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="grpo-chat",
        description="Talk to a model or a grpo-cli checkpoint: one prompt (-p) or an interactive session, "
        "the reply streamed as it is made, with the run's chat template and sampling settings.",
    )
    parser.add_argument(
        "target",
        nargs="?",
        help="a checkpoint folder, a run folder (its checkpoints/best, else its last checkpoint), a "
        "preset (qwen0.5b, tiny, ...), a hub id or a model folder (default: the default model)",
    )
    parser.add_argument("-p", "--prompt", help="one prompt: print the reply and exit (else a session)")
    parser.add_argument("--max-new-tokens", type=int, help="reply length (default: sampler.max_new_tokens)")
    parser.add_argument("--temperature", type=float, help="default: sampler.temperature")
    parser.add_argument("--greedy", action="store_true", help="the most likely token each step")
    parser.add_argument("--seed", type=int, help="the sampling seed (default: trainer.seed)")
    parser.add_argument(
        "--environment",
        help="run each message as an episode of this environment, shown turn by turn: a preset "
        "(calculator, feedback) or a class by import path (default: the checkpoint's own, if any)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra key=value overrides as for grpo-train (e.g. data.system_prompt=...)",
    )
    args = parser.parse_args(argv)
    from rich.console import Console

    from grpo_cli.cli.common import typed_config

    console = Console(stderr=True)
    try:
        if args.max_new_tokens is not None and args.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens {args.max_new_tokens} must be at least 1, e.g. 256.")
        if args.temperature is not None and args.temperature < 0:
            raise UserError(f"--temperature {args.temperature:g} must be >= 0 (0: greedy).")
        chosen, checkpoint = resolve_target(args.target)
        if args.environment:
            chosen.append(environment_override(args.environment))
        cfg = typed_config(chosen + list(args.overrides), checkpoint=checkpoint)
        s = cfg.sampler
        settings = {
            "max_new_tokens": args.max_new_tokens or s.max_new_tokens,
            "temperature": 0.0
            if args.greedy
            else (s.temperature if args.temperature is None else args.temperature),
            "top_p": s.top_p,
            "top_k": s.top_k,
        }
        model, tokenizer, device = load(cfg, console.print)
        multi_turn = environment_factory(cfg.environment) is not None
        seed = cfg.trainer.seed if args.seed is None else args.seed
        if multi_turn and args.prompt is not None:
            episode(cfg, model, tokenizer, args.prompt, settings, seed, sys.stdout)
            return 0
    except UserError as exc:
        report_and_exit("grpo-chat", [str(exc)])
    import torch

    torch.manual_seed(seed)  # (after loading: the first reply's draw)
    if args.prompt is not None:
        text = prompt_text([{"role": "user", "content": args.prompt}], tokenizer, cfg)
        reply(model, tokenizer, text, device, settings, sys.stdout)
        return 0
    templated = bool(getattr(tokenizer, "chat_template", None)) and cfg.data.use_chat_template
    console.print(
        f"up to {settings['max_new_tokens']} tokens a reply, "
        + ("greedy" if settings["temperature"] <= 0 else f"temperature {settings['temperature']:g}")
        + ("" if templated or multi_turn else "; no chat template: each message alone, no history")
        + ("; each message an episode of the environment, shown turn by turn" if multi_turn else "")
        + ". /reset clears the history, /exit or Ctrl-D quits."
    )
    messages: list[dict] = []
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = []
            continue
        if not line.strip():
            continue
        if multi_turn:
            try:
                episode(cfg, model, tokenizer, line, settings, seed, sys.stdout)
            except UserError as exc:  # (an environment that raises: said, and the session goes on)
                console.print(f"grpo-chat: {exc}")
            continue
        messages.append({"role": "user", "content": line})
        answer = reply(model, tokenizer, prompt_text(messages, tokenizer, cfg), device, settings, sys.stdout)
        messages.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    sys.exit(main())
