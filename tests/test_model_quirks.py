"""Architectures that do things their own way: dropout rates outside nn.Dropout, and models
that ignore `logits_to_keep`. Tiny random-init models, built offline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grpo_cli import models
from grpo_cli.logprobs import token_logprobs
from grpo_cli.models import ModelSource, disable_dropout, load_model
from grpo_cli.samplers.builtin import left_pad, sample

# ----------------------------------------------------------------------------- (A) dropout

PAD = 0


def _left_padded_batch():
    """Three rows, different prompt and completion lengths (one completion of length 1)."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    completions = [[20, 21, 22], [23], [24, 25, 26, 27]]
    return _batch(prompts, completions)


def _batch(prompts, completions):
    p_ids, p_mask = left_pad(prompts, PAD, "cpu")  # [B, P]
    C = max(len(c) for c in completions)
    c_ids = torch.full((len(completions), C), PAD)  # [B, C]
    c_mask = torch.zeros((len(completions), C), dtype=torch.long)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)] = torch.tensor(c)
        c_mask[i, : len(c)] = 1
    return p_ids, p_mask, c_ids, c_mask


def _save(model, path):
    model.save_pretrained(path, safe_serialization=True)
    return ModelSource(str(path), None, "test")


def _tiny_qwen2(path, **kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.1,
        pad_token_id=PAD,
        **kw,
    )
    torch.manual_seed(0)
    return _save(Qwen2ForCausalLM(config), path)


def _only_nn_dropout(model):
    """What load_model did before: zero nn.Dropout's p, nothing else."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _two_train_mode_passes(model):
    assert model.training  # the policy is trained in train mode (gradient checkpointing needs it)
    batch = _left_padded_batch()
    torch.manual_seed(1)
    first = token_logprobs(model, *batch, temperature=1.0)
    second = token_logprobs(model, *batch, temperature=1.0)
    return first, second, batch[3].bool()


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_qwen2_attention_dropout_is_off_in_train_mode(tmp_path, monkeypatch, gradient_checkpointing):
    """Qwen2 (like Llama, Mistral) keeps config.attention_dropout in a float attribute and applies
    it whenever self.training: two train-mode passes must still give the same log-probs."""
    source = _tiny_qwen2(tmp_path)
    model = load_model(
        source, device=torch.device("cpu"), trainable=True, gradient_checkpointing=gradient_checkpointing
    )
    assert model.is_gradient_checkpointing == gradient_checkpointing
    assert model.config.attention_dropout == 0.0
    assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in model.modules())
    first, second, valid = _two_train_mode_passes(model)
    assert torch.equal(first, second)

    # The test has power: zeroing only nn.Dropout (the old load_model) leaves the passes apart.
    monkeypatch.setattr(models, "disable_dropout", _only_nn_dropout)
    old = load_model(
        source, device=torch.device("cpu"), trainable=True, gradient_checkpointing=gradient_checkpointing
    )
    first, second, valid = _two_train_mode_passes(old)
    assert (first - second)[valid].abs().max() > 1e-3


def test_gpt2_dropout_rates_are_zero_in_modules_and_config(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        attn_pdrop=0.1,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        summary_first_dropout=0.1,
    )
    torch.manual_seed(0)
    model = load_model(_save(GPT2LMHeadModel(config), tmp_path), device=torch.device("cpu"), trainable=True)
    for key in ("attn_pdrop", "resid_pdrop", "embd_pdrop", "summary_first_dropout"):
        assert getattr(model.config, key) == 0.0, key  # nothing rebuilt from the config brings it back
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    first, second, _ = _two_train_mode_passes(model)
    assert torch.equal(first, second)


def test_disable_dropout_reaches_float_attributes_and_sub_configs():
    from transformers import PretrainedConfig

    config = PretrainedConfig(attention_dropout=0.1, layerdrop=0.2, hidden_size=32)
    config.text_config = PretrainedConfig(hidden_dropout=0.3, attn_pdrop=0.1, token_dropout=True)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = config
            self.attention_dropout = 0.1  # read at forward time as `p if self.training else 0`
            self.resid_pdrop = 0.1
            self.embed_dropout = torch.nn.Dropout1d(0.1)
            self.scale = 0.5  # not a dropout rate: untouched

    model = torch.nn.Sequential(Block())
    disable_dropout(model)
    block = model[0]
    assert (block.attention_dropout, block.resid_pdrop, block.embed_dropout.p, block.scale) == (
        0.0,
        0.0,
        0.0,
        0.5,
    )
    assert (config.attention_dropout, config.layerdrop, config.hidden_size) == (0.0, 0.0, 32)
    assert (config.text_config.hidden_dropout, config.text_config.attn_pdrop) == (0.0, 0.0)
    assert config.text_config.token_dropout is True  # a switch, not a rate


# ----------------------------------------------------------------------------- (B) logits_to_keep


def _tiny_opt():
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=64,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=64,
        pad_token_id=PAD,
        init_std=0.3,
    )
    return OPTForCausalLM(config)


def _tiny_gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        max_position_embeddings=64,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
        initializer_range=0.3,
    )
    return GPTNeoForCausalLM(config)


@pytest.fixture(scope="module", params=[_tiny_opt, _tiny_gpt_neo], ids=["opt", "gpt_neo"])
def ignores_logits_to_keep(request):
    torch.manual_seed(0)
    model = request.param().eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    if model(input_ids=ids, logits_to_keep=1).logits.shape[1] != 4:
        # transformers 5 taught these models logits_to_keep; wrap the forward so that it swallows
        # the keyword again, as 4.57's (and other models') do: the slicing is what is tested.
        forward = model.forward
        model.forward = lambda *args, logits_to_keep=None, **kwargs: forward(*args, **kwargs)
    # The precondition of the test: this model returns every position despite logits_to_keep.
    assert model(input_ids=ids, logits_to_keep=1).logits.shape[1] == 4
    return model


def _reference(model, p_ids, p_mask, c_ids, c_mask, temperature):
    """The plain computation: the full padded [prompt, completion] rows, every position's logits,
    log_softmax(logits / T) at position t gathered at token t+1, the completion's slice."""
    input_ids = torch.cat([p_ids, c_ids], 1)  # [B, L]
    mask = torch.cat([p_mask, c_mask], 1)  # [B, L]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # both models take position_ids
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits.float()
    logp = F.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return logp[:, -c_ids.shape[1] :]  # [B, C]


def _unpadded_reference(model, prompt, completion, temperature):
    """One row alone, no padding, no mask: the textbook computation."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature  # [L, V]
    return F.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)[-len(completion) :]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


@pytest.mark.parametrize("grouped", [False, True], ids=["distinct", "shared_prompt"])
@pytest.mark.parametrize(
    "completions",
    [[[20, 21, 22], [23], [24, 25, 26, 27, 28]], [[20], [23], [24]]],
    ids=["mixed_lengths", "all_length_1"],
)
def test_logprobs_of_models_that_ignore_logits_to_keep(ignores_logits_to_keep, grouped, completions):
    model = ignores_logits_to_keep
    if grouped:  # G=3 completions of each of two prompts: the shared-prompt KV-cache path
        prompts = [p for p in PROMPTS[:2] for _ in range(3)]
        completions = completions * 2
    else:
        prompts = PROMPTS
    batch = _batch(prompts, completions)
    valid = batch[3].bool()
    with torch.no_grad():
        logps = token_logprobs(model, *batch, temperature=0.7, num_generations=3 if grouped else 1)
    assert logps.shape == batch[2].shape
    expected = _reference(model, *batch, temperature=0.7)
    torch.testing.assert_close(logps[valid], expected[valid], atol=1e-5, rtol=1e-5)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        torch.testing.assert_close(
            logps[i, : len(c)], _unpadded_reference(model, p, c, 0.7), atol=1e-5, rtol=1e-5
        )


def test_greedy_sampling_with_a_model_that_ignores_logits_to_keep(ignores_logits_to_keep):
    model = ignores_logits_to_keep
    r = sample(
        model,
        PROMPTS,
        num_generations=2,
        max_new_tokens=5,
        temperature=1.0,
        greedy=True,
        eos_ids=[],
        pad_id=PAD,
    )
    assert r.prompt_ids.shape == (6, 7) and r.completion_ids.shape == (6, 5)
    assert r.sampler_logps.shape == (6, 5) and r.truncated.all()
    # Greedy: the two rows of a prompt agree, and each token is the argmax given the row so far.
    assert torch.equal(r.completion_ids[::2], r.completion_ids[1::2])
    for i, prompt in enumerate(PROMPTS):
        ids = list(prompt)
        for _ in range(5):
            with torch.no_grad():
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert r.completion_ids[2 * i].tolist() == ids[len(prompt) :]
    logps = token_logprobs(model, *r.inputs(), temperature=1.0, num_generations=r.num_generations)
    torch.testing.assert_close(logps, r.sampler_logps, atol=1e-5, rtol=1e-5)


def test_model_without_position_ids_or_logits_to_keep_keywords():
    """BartForCausalLM's forward has neither keyword nor **kwargs (passing either is a TypeError):
    they are dropped, and the model places tokens by its own rule (past length + arange, the same
    in the full pass, the cached pass and the sampler)."""
    from transformers import BartConfig, BartForCausalLM

    # encoder_layers == decoder_layers: transformers sizes the decoder's cache by encoder_layers.
    config = BartConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        init_std=0.3,
        pad_token_id=PAD,
        is_decoder=True,
        is_encoder_decoder=False,
    )
    torch.manual_seed(0)
    model = BartForCausalLM(config).eval()
    import inspect

    params = inspect.signature(model.forward).parameters
    if "position_ids" not in params and all(p.kind is not p.VAR_KEYWORD for p in params.values()):  # 4.57
        with pytest.raises(TypeError):
            model(input_ids=torch.tensor([[5, 6]]), position_ids=torch.tensor([[0, 1]]))
    completions = [[20, 21, 22], [23], [24, 25]]
    for prompts, G in ((PROMPTS, 1), ([PROMPTS[0]] * 3, 3)):  # distinct, then one shared prompt
        batch = _batch(prompts, completions)
        valid = batch[3].bool()
        with torch.no_grad():
            logps = token_logprobs(model, *batch, temperature=1.0, num_generations=G)
            input_ids, mask = torch.cat([batch[0], batch[2]], 1), torch.cat([batch[1], batch[3]], 1)  # [B, L]
            logits = model(input_ids=input_ids, attention_mask=mask).logits  # [B, L, V]
        expected = F.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)[:, -3:]
        torch.testing.assert_close(logps[valid], expected[valid], atol=1e-5, rtol=1e-5)
    r = sample(
        model,
        PROMPTS,
        num_generations=2,
        max_new_tokens=3,
        temperature=1.0,
        greedy=True,
        eos_ids=[],
        pad_id=PAD,
    )
    assert r.completion_ids.shape == (6, 3)
    with torch.no_grad():
        logps = token_logprobs(model, *r.inputs(), temperature=1.0, num_generations=r.num_generations)
    torch.testing.assert_close(logps, r.sampler_logps, atol=1e-5, rtol=1e-5)
