"""Running the model: the transformers forward made uniform across architectures (model_logits),
positions from the attention mask, the columns that are padding in every row, the prompt prefill into
a KV cache, and _forward_logits: the logits (or, within chunked.hidden_states_out, the final hidden
states) that score a batch's completion tokens, with the causal shift, padding, the shared-prompt KV
cache and the temperature handled here (ref 000.2, 000.3, 000.4). Imports nothing else of the package.
"""

from __future__ import annotations

import inspect

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left padding shifts where real tokens start; positions count real tokens only (ref 000.3)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]


def forward_model(model):
    """The transformers model that runs the forward: a PEFT model's wrapped model (its LoRA layers
    are injected in place, so the adapters run), whose own signature decides the keywords below."""
    from grpo_cli.adapters import is_adapted

    return model.get_base_model() if is_adapted(model) else model


def model_logits(model, *, logits_to_keep: int | None = None, **kwargs) -> torch.Tensor:
    """model(**kwargs).logits, made uniform across architectures (every forward pass here and in
    the sampler goes through it):

    - logits_to_keep=k: the last k positions, [B, k, V]. OPT, GPT-Neo, GPT-J, CodeGen,
      GPTBigCode, ... (transformers 4.57) swallow the keyword in **kwargs and return every
      position; the extra ones are cut here.
    - keywords the forward does not take are dropped (Bart-style decoders have neither
      position_ids nor logits_to_keep, nor **kwargs): such a model computes its own positions.
    """
    return _run(model, logits_to_keep, kwargs)[0]


def _run(model, logits_to_keep: int | None, kwargs: dict):
    """model_logits' forward: (the logits, the output's cache: None when the model returned none)."""
    model = forward_model(model)
    if logits_to_keep is not None:
        kwargs["logits_to_keep"] = logits_to_keep
    params = inspect.signature(model.forward).parameters
    if "past_key_values" in kwargs and "cache" in params and "past_key_values" not in params:
        kwargs["cache"] = kwargs.pop(
            "past_key_values"
        )  # its name since transformers 5.2x (the old one warns)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    out = model(**kwargs)
    logits = out.logits  # [B, L, V], or [B, k, V] when the model honours logits_to_keep
    if logits_to_keep is not None and logits.shape[1] > logits_to_keep:
        logits = logits[:, -logits_to_keep:]  # [B, k, V]
    cache = out.get("cache", None) if hasattr(out, "get") else None
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    return logits, cache


def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """Run each (left-padded) prompt [B, P] once into a fresh KV cache: (the cache, the logits
    [B, 1, V] of the last position, which score the first completion token). The training forward
    and the sampler share prompts this way. A model with recurrent or convolution layers
    (models.recurrent) builds its own cache (its states beside the keys and values): the one
    its forward returns."""
    from transformers import DynamicCache

    from grpo_cli.models import recurrent

    if not recurrent(model):
        cache = DynamicCache()  # (filled in place by the forward)
        logits = model_logits(
            model,
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=position_ids_from_mask(prompt_mask),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )  # [B, 1, V]
        return cache, logits
    logits, cache = _run(
        model,
        1,
        dict(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=position_ids_from_mask(prompt_mask),
            use_cache=True,
        ),
    )  # [B, 1, V]
    if cache is None:
        from grpo_cli.errors import UserError

        raise UserError(
            f"model type {getattr(forward_model(model).config, 'model_type', None)!r}: its forward returned "
            "no cache, which the built-in sampler's decode needs (the states of its recurrent or "
            "convolution layers beside its attention's keys and values). Use a transformers release whose "
            "class for it returns its own cache with use_cache=True, or sampler=vllm."
        )
    return cache, logits


def prompt_runs_once(model) -> bool:
    """Whether a scoring forward of this model may run a group's prompt once and share its KV cache.
    Not under checkpointing (the model recomputes its layers in the backward and keeps no cache),
    nor for a model with recurrent or convolution layers (models.recurrent: their states are not
    shared by repeating the cache): those run full rows. The one place this is decided: the forward
    below and the scoring plan (packing.scoring_plan) read it."""
    from grpo_cli.models import recurrent

    return not checkpointing(model) and not recurrent(model)


def checkpointing(model) -> bool:
    """Whether gradient (activation) checkpointing is on: transformers 5 renamed the attribute
    and warns on the old name."""
    model = forward_model(model)
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def padding_bounds(prompt_mask: torch.Tensor, attention_mask: torch.Tensor) -> tuple[int, int]:
    """(first prompt column holding a real token in some row, completion columns up to the last
    attended one of any row): the columns outside are padding in every row, no work to spend on.
    (A completion's attended tokens need not be a contiguous prefix.)"""
    first = int(prompt_mask.any(0).long().argmax())
    attended = attention_mask.bool().any(0)  # [C]
    used = int(attended.nonzero().max()) + 1 if bool(attended.any()) else 1
    return first, used


def _forward_logits(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    attention_mask,
    group_size: int = 1,
    temperature: float = 1.0,
    buckets: list[list[int]] | None = None,
) -> torch.Tensor:
    """(Within hidden_states_out: the final hidden states [B, C, H] at those positions, and the
    temperature is the caller's.) Logits [B, C, V] that score the C completion tokens, divided by the temperature (ref
    000.4): logits at position t score token t+1 (ref 000.2), so they are the ones from the last
    prompt position to the second-to-last completion position; only those are materialised.
    attention_mask [B, C]: the completion-side tokens the model sees (rollout.Rollout: it may have
    holes). The temperature divides the fresh logits in place: no second [B, C, V] tensor. (In
    place is safe here: the output layer's backward and a soft-capping's final scaling keep no
    copy of their output; an architecture whose last op did would make autograd raise, not
    compute a wrong gradient.)

    The rows come in groups of group_size (G) consecutive rows that share one prompt (a
    rollout's contract, G = num_generations); with G > 1 each prompt is run once and its KV cache
    is shared by its G completions (gradients flow back into the prompt's pass through the
    cache). Same numbers as running every [prompt, completion] row in full, up to float rounding
    (tested), at a fraction of the cost: prompts are often most of the tokens. group_size=1 runs
    the plain full rows (ScoringOptions.shared_prompt=False: for an architecture not tested here).

    buckets (length_buckets; ScoringOptions.length_buckets): the rows' indices in buckets of similar
    length, each bucket's completions run as a batch of its own, as wide as its longest row (under
    the shared prompt's KV cache, sliced to the bucket's rows), so a group's short completions stop
    paying for its long one. Columns past a row's length hold zeros.
    """
    B, C = completion_ids.shape
    G = group_size
    if B % G:
        raise ValueError(f"_forward_logits: {B} rows are not groups of num_generations={G}")
    if has_holes(attention_mask) and _recurrent(model):
        return _compacted(
            model, prompt_ids, prompt_mask, completion_ids, attention_mask, G, temperature, buckets
        )
    use_cache = G > 1 and prompt_runs_once(model)
    if buckets is not None and (len(buckets) > 1 or use_cache):
        return _tempered(
            _bucketed(
                model, prompt_ids, prompt_mask, completion_ids, attention_mask, G if use_cache else 1, buckets
            ),
            temperature,
        )
    if not use_cache:
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P+C]
        mask = torch.cat([prompt_mask, attention_mask], dim=1).long()  # [B, P+C]
        logits = model_logits(
            model,
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            logits_to_keep=C + 1,
            use_cache=False,
        )  # [B, C+1, V]
        return _tempered(
            logits[:, :-1, :], temperature
        )  # [B, C, V]: logits[:, i] predicts completion token i
    cache, first = prefill(model, prompt_ids[::G], prompt_mask[::G].long())  # [B/G, 1, V]
    first_logits = first.repeat_interleave(G, dim=0)  # [B, 1, V]: scores completion token 0
    if C == 1:
        return _tempered(first_logits, temperature)
    cache.batch_repeat_interleave(G)  # [B/G, ...] -> [B, ...], differentiable
    mask = torch.cat([prompt_mask, attention_mask[:, :-1]], dim=1).long()  # [B, P+C-1]
    rest = model_logits(
        model,
        input_ids=completion_ids[:, :-1],
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask)[:, prompt_ids.shape[1] :],
        past_key_values=cache,
        use_cache=True,
    )  # [B, C-1, V]
    return _tempered(torch.cat([first_logits, rest], dim=1), temperature)  # [B, C, V]


def has_holes(attention_mask: torch.Tensor) -> bool:
    """Whether some row's attended completion tokens [B, C] are not a prefix (a 0 before a 1)."""
    m = attention_mask.bool()
    return bool((m[:, 1:] & ~m[:, :-1]).any())


def _recurrent(model) -> bool:
    from grpo_cli.models import recurrent

    return recurrent(model)


def _compacted(model, prompt_ids, prompt_mask, completion_ids, attention_mask, G, temperature, buckets):
    """_forward_logits for rows with holes on a model with recurrent or convolution layers: a hole is
    hidden from attention by the mask, but a recurrent state still decays over it (its input is
    zeroed, its decay is not), so each row's attended tokens are moved together first, scored as a
    row without holes, and the results put back in their columns (a hole's column gets logits of
    the row's padding: no trained token sits there). Positions count attended tokens
    (ref 000.3), so for attention this is the same computation."""
    order = torch.sort((attention_mask == 0).long(), dim=1, stable=True).indices  # [B, C]: attended first
    ids, mask = completion_ids.gather(1, order), attention_mask.gather(1, order)  # [B, C]
    if buckets is not None:  # (each row's length is its attended count now)
        buckets = length_buckets(row_lengths(mask))
    out = _forward_logits(model, prompt_ids, prompt_mask, ids, mask, G, temperature, buckets)  # [B, C, D]
    back = torch.argsort(order, dim=1)  # [B, C]: where each column went
    return out.gather(1, back.unsqueeze(-1).expand(-1, -1, out.shape[-1]))  # [B, C, D]


def row_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Each row's length [B]: its last attended completion column + 1 (0 for a row with none); the
    columns past it are padding (a completion's holes inside it are not)."""
    C = attention_mask.shape[1]
    last = torch.where(attention_mask.bool(), torch.arange(1, C + 1, device=attention_mask.device), 0)
    return last.max(dim=1).values.tolist()


# A forward pass's fixed cost in tokens (per bucket: the layers' launch and Python overhead, and the
# shared prompt's KV read again): a bucket is split off only when it saves more padded tokens than this.
BUCKET_OVERHEAD_TOKENS = 128


def length_buckets(lengths: list[int], overhead: int | None = None) -> list[list[int]]:
    """The rows' indices in buckets of similar length: a partition of the rows sorted by length into
    consecutive runs that minimises sum(rows x longest) + overhead per run (the padded tokens the
    completion passes run, plus each pass's fixed cost), by dynamic programming over the sorted
    lengths (O(B^2): B is a micro-batch's rows). One bucket when splitting saves nothing."""
    overhead = BUCKET_OVERHEAD_TOKENS if overhead is None else overhead
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    L = [max(1, lengths[i]) for i in order]
    best, cut = [0] + [None] * len(L), [0] * (len(L) + 1)
    for j in range(1, len(L) + 1):  # best[j]: the cheapest split of the j shortest rows
        for i in range(j):  # (the last bucket: sorted rows i..j-1, as wide as L[j - 1])
            cost = best[i] + (j - i) * L[j - 1] + overhead
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], len(L)
    while j:
        runs.append(order[cut[j] : j])
        j = cut[j]
    return runs[::-1]


def _common_prefix(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """How many first real tokens every row of the left-padded ids [g, P] shares (a chat template's
    system prompt, an environment's tool instructions), leaving each row one of its own."""
    rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
    k = min(len(r) for r in rows) - 1
    for i in range(max(k, 0)):
        if any(r[i] != rows[0][i] for r in rows):
            return i
    return max(k, 0)


def _windowed(model, span: int) -> bool:
    """Whether the model's attention has a sliding window shorter than `span` columns: its masks
    measure distances in cache columns, so a hole in the cache would move tokens out of the window."""
    window = getattr(forward_model(model).config.get_text_config(), "sliding_window", None)
    return window is not None and window < span


def _prefill_common(
    model, ids: torch.Tensor, mask: torch.Tensor, embeds: torch.Tensor, completion_width: int
):
    """prefill of the prompts ids/mask [g, P] (left-padded; embeds [g, P, H]: their input
    embeddings), with the real tokens they all begin with run once, where that saves more than a
    pass costs: (the KV cache, the last position's logits [g, 1, D], the cache's mask [g, P']: the
    shared prefix's k columns, then each prompt's remaining columns, its left padding a hole between
    them). Positions count real tokens (ref 000.3), so each prompt's remainder sits at the positions
    it has in the full prompt. Not under a sliding window narrower than the rows (_windowed)."""
    from transformers import DynamicCache

    g, P = ids.shape
    k = _common_prefix(ids, mask) if g > 1 and not _windowed(model, P + completion_width) else 0
    cache = DynamicCache()
    if (g - 1) * k > BUCKET_OVERHEAD_TOKENS:
        start = int(mask[0].argmax())  # (row 0's first real column)
        shared = DynamicCache()
        model_logits(
            model,
            inputs_embeds=embeds[:1, start : start + k],
            attention_mask=mask[:1, start : start + k],
            position_ids=torch.arange(k, device=ids.device).unsqueeze(0),
            past_key_values=shared,
            use_cache=True,
            logits_to_keep=1,
        )
        for layer_idx, layer in enumerate(shared.layers):  # the prefix's keys for every prompt
            cache.update(layer.keys.expand(g, -1, -1, -1), layer.values.expand(g, -1, -1, -1), layer_idx)
        cols = torch.arange(P - k, device=ids.device).unsqueeze(0)  # [1, P-k]
        starts = mask.long().argmax(-1, keepdim=True)  # [g, 1]
        src = torch.where(cols < starts, cols, cols + k)  # [g, P-k]: each row's padding, then its rest
        side = torch.cat([mask[:, :k].new_ones(g, k), mask.gather(1, src)], dim=1)  # [g, k+P-k]
        embeds = embeds.gather(1, src.unsqueeze(-1).expand(-1, -1, embeds.shape[-1]))  # [g, P-k, H]
    else:
        k, side = 0, mask
    first = model_logits(
        model,
        inputs_embeds=embeds,
        attention_mask=side,
        position_ids=position_ids_from_mask(side)[:, k:],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )  # [g, 1, D]
    return cache, first, side


def _bucketed(
    model, prompt_ids, prompt_mask, completion_ids, attention_mask, G: int, buckets
) -> torch.Tensor:
    """_forward_logits' rows, bucket by bucket (untempered): [B, C, D], zeros past each bucket's
    width. G > 1: the prompts [B/G, P] run once into a KV cache, and each bucket's completions run
    under that cache's rows of their groups (a differentiable gather: the prompt's gradient sums over
    its rows, as with batch_repeat_interleave). G = 1: each bucket's full rows, without the columns
    that are padding in every row of the bucket. Every token is embedded in one call, and the passes
    take slices of it (inputs_embeds): one embedding backward, whose weight gradient is as large as
    the vocabulary, instead of one per pass."""
    from transformers import DynamicCache

    B, C = completion_ids.shape
    widths = row_lengths(attention_mask)
    prompts = prompt_ids[::G]  # [B/G, P]: each group's prompt (G = 1: every row's)
    table = forward_model(model).get_input_embeddings()(
        torch.cat([prompts.flatten(), completion_ids.flatten()])
    )
    p_emb = table[: prompts.numel()].view(*prompts.shape, -1)  # [B/G, P, H]
    c_emb = table[prompts.numel() :].view(B, C, -1)  # [B, C, H]
    if G > 1:  # prompt_mask: now the prompts' side of the cache, [B/G, P'] (_prefill_common)
        cache, first, prompt_mask = _prefill_common(model, prompts, prompt_mask[::G].long(), p_emb, C)
    parts, order = [], []
    for rows in buckets:
        idx = torch.tensor(rows, device=completion_ids.device)
        w = max(1, max(widths[i] for i in rows))  # the bucket's columns
        if G > 1:
            head = first[idx // G]  # [b, 1, D]: scores completion token 0
            if w > 1:
                sub = DynamicCache()
                for layer_idx, layer in enumerate(cache.layers):  # the bucket's rows of the prompts' cache
                    sub.update(layer.keys[idx // G], layer.values[idx // G], layer_idx)
                mask = torch.cat(
                    [prompt_mask[idx // G], attention_mask[idx, : w - 1]], dim=1
                ).long()  # [b, P'+w-1]
                rest = model_logits(
                    model,
                    inputs_embeds=c_emb[idx, : w - 1],
                    attention_mask=mask,
                    position_ids=position_ids_from_mask(mask)[:, prompt_mask.shape[1] :],
                    past_key_values=sub,
                    use_cache=True,
                )  # [b, w-1, D]
                head = torch.cat([head, rest], dim=1)  # [b, w, D]
        else:
            first_col, _ = padding_bounds(prompt_mask[idx], attention_mask[idx])
            mask = torch.cat([prompt_mask[idx, first_col:], attention_mask[idx, :w]], dim=1).long()
            head = model_logits(
                model,
                inputs_embeds=torch.cat([p_emb[idx, first_col:], c_emb[idx, :w]], dim=1),
                attention_mask=mask,
                position_ids=position_ids_from_mask(mask),
                logits_to_keep=w + 1,
                use_cache=False,
            )[:, :-1]  # [b, w, D]
        parts.append(torch.nn.functional.pad(head, (0, 0, 0, C - w)))  # [b, C, D]
        order.extend(rows)
    inverse = torch.empty(B, dtype=torch.long, device=completion_ids.device)
    inverse[torch.tensor(order, device=completion_ids.device)] = torch.arange(B, device=completion_ids.device)
    return torch.cat(parts)[inverse]  # [B, C, D], the rows in their order


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, in place (the same values and gradient as out of place)."""
    return logits if temperature == 1.0 else logits.div_(temperature)
