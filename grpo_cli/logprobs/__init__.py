"""Per-token log-probs of completion tokens: the one place the causal shift, padding and
temperature are handled (ref 000.2, 000.3, 000.4).

Two paths to the same numbers. Chunked (trainer.logprob_chunk_size: null, the default, or N > 0):
the forward stops at the final hidden states [B, C, H], and the output layer runs on chunks of
tokens, each chunk's logits [n, V] taken to log-probs and freed before the next, so no [B, C, V]
tensor is ever alive (_LinearHeadScores: its own backward, which keeps d log p / d hidden per
token). With logprob_chunk_size=0, the model's own logits [B, C, V].

The modules, by level (each imports only those above it):

- forward: running the model (model_logits, positions, padding bounds, the prompt prefill and
  the shared-prompt KV cache, the temperature: _forward_logits);
- whole: scores from whole logits (token_scores, selective_logprobs, TokenScores), the scoring
  settings (ScoringOptions) and the
  sampler's top-k/top-p filter the trainer replays (filter_logits);
- chunked: the chunked path (hidden_states_out, chunkable, chunked_scores, _LinearHeadScores);
- score: the entry points (score_tokens, token_logprobs, TokenLogprobs).

The names below are the package's own: import them from grpo_cli.logprobs. (A test that
monkeypatches a function must patch the module that calls it, e.g. forward.prefill.)
"""

from grpo_cli.logprobs.chunked import (
    AUTO_CHUNK_BYTES,
    OutputLayer,
    chunk_tokens,
    chunkable,
    chunked_scores,
    hidden_states_out,
)
from grpo_cli.logprobs.forward import (
    _forward_logits,
    checkpointing,
    forward_model,
    length_buckets,
    model_logits,
    padding_bounds,
    position_ids_from_mask,
    prefill,
    prompt_runs_once,
    row_lengths,
)
from grpo_cli.logprobs.score import (
    TokenLogprobs,
    groups_share_prompts,
    score_tokens,
    shared_prompt_groups,
    token_logprobs,
)
from grpo_cli.logprobs.whole import (
    ScoringOptions,
    TokenScores,
    filter_logits,
    selective_logprobs,
    token_scores,
    truncates,
)

__all__ = [
    "AUTO_CHUNK_BYTES",
    "OutputLayer",
    "ScoringOptions",
    "TokenLogprobs",
    "TokenScores",
    "_forward_logits",
    "checkpointing",
    "chunk_tokens",
    "chunkable",
    "chunked_scores",
    "filter_logits",
    "forward_model",
    "hidden_states_out",
    "length_buckets",
    "model_logits",
    "padding_bounds",
    "position_ids_from_mask",
    "prefill",
    "prompt_runs_once",
    "row_lengths",
    "score_tokens",
    "groups_share_prompts",
    "shared_prompt_groups",
    "selective_logprobs",
    "token_logprobs",
    "token_scores",
    "truncates",
]
