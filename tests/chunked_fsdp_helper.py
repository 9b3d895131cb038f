"""Run by tests/test_chunked_logprobs.py under torchrun (2 processes, gloo): a tiny model sharded by
FSDP2 (trainer.distributed=fsdp's shard_model: each decoder layer, then the root, which owns the
output layer) scores tokens chunked. Checked on every rank: the chunked path is taken (no tensor
of the whole vocabulary per token is made), and the log-probs and the gradients (gathered whole)
equal those of an unsharded copy of the model through its whole logits. Exits non-zero otherwise.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/chunked_fsdp_helper.py llama
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from test_architectures import batch, build  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import grpo_cli.logprobs as lp  # noqa: E402
from grpo_cli.distributed import shard_model  # noqa: E402

CHUNK = 4


class Largest(TorchDispatchMode):
    """The largest tensor made whose last dimension is the vocabulary (not the [V, H] weight)."""

    def __init__(self, V, H):
        super().__init__()
        self.V, self.H, self.largest = V, H, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(t, torch.Tensor)
                and t.dim()
                and t.shape[-1] == self.V
                and t.numel() != self.V * self.H
            ):
                self.largest = max(self.largest, t.numel())
        return out


def scores_and_grads(model, tensors, weights, chunk):
    scores = lp.score_tokens(model, *tensors, lp.ScoringOptions(0.7, with_entropy=True, chunk_size=chunk), 3)
    loss = (scores.logps * tensors[3].float() * weights[:, None]).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return scores, grads


def main(name: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    sharded = build(name).train()
    plain = build(name).train()
    plain.load_state_dict(sharded.state_dict())
    shard_model(sharded)
    _, _, tensors = batch(True)
    weights = torch.linspace(-1.0, 1.0, tensors[2].shape[0])
    V, H = plain.config.vocab_size, plain.config.hidden_size
    assert lp.chunkable(sharded), "an FSDP2-sharded model is not chunkable"
    with Largest(V, H) as seen:
        ours, g_ours = scores_and_grads(sharded, tensors, weights, CHUNK)
    assert seen.largest <= CHUNK * V, (seen.largest, CHUNK * V)
    theirs, g_theirs = scores_and_grads(plain, tensors, weights, 0)
    mask = tensors[3].bool()
    torch.testing.assert_close(ours.logps[mask], theirs.logps[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.entropy[mask], theirs.entropy[mask], rtol=1e-5, atol=1e-5)
    # FSDP2 averages the ranks' gradients: the same data on both, so the one-process gradient.
    total = torch.cat([g.flatten() for g in g_theirs.values() if g is not None]).norm()
    diff = torch.cat([(g_ours[k] - g).flatten() for k, g in g_theirs.items() if g is not None]).norm()
    assert float(diff) <= 1e-5 * float(total), (float(diff), float(total))
    assert g_ours[next(k for k in g_ours if "lm_head" in k or "embed_tokens" in k)] is not None
    print(f"rank {dist.get_rank()}: chunked under FSDP2 ok ({name})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llama")
