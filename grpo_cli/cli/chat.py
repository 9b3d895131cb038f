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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    except UserError as exc:
        report_and_exit("grpo-chat", [str(exc)])
    import torch

    torch.manual_seed(
        cfg.trainer.seed if args.seed is None else args.seed
    )  # (after loading: the first reply's draw)
    if args.prompt is not None:
        text = prompt_text([{"role": "user", "content": args.prompt}], tokenizer, cfg)
        reply(model, tokenizer, text, device, settings, sys.stdout)
        return 0
    templated = bool(getattr(tokenizer, "chat_template", None)) and cfg.data.use_chat_template
    console.print(
        f"up to {settings['max_new_tokens']} tokens a reply, "
        + ("greedy" if settings["temperature"] <= 0 else f"temperature {settings['temperature']:g}")
        + ("" if templated else "; no chat template: each message alone, no history")
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
        messages.append({"role": "user", "content": line})
        answer = reply(model, tokenizer, prompt_text(messages, tokenizer, cfg), device, settings, sys.stdout)
        messages.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    sys.exit(main())
