"""The teacher of on-policy distillation (teacher.name_or_path, loss.teacher_kl; docs/recipe.md):
where its weights come from, once its tokenizer is checked against the student's. The frozen model
itself loads as the reference does (frozen.load_frozen: the trainer's precision, sharded under
FSDP2). The loss's term is grpo_cli/loss/terms.py's teacher_term; the loop scores the teacher as it
scores the reference (roles.Learner.teacher_scores)."""

from __future__ import annotations

from grpo_cli.errors import UserError
from grpo_cli.models import load_tokenizer, resolve_source


def teacher_source(cfg, student_tokenizer, log):
    """Where teacher.name_or_path's weights come from, once its tokenizer is checked against the
    student's (UserError in one paragraph where the vocabularies differ: the teacher must score the
    student's own token ids); None without a teacher."""
    te = cfg.teacher
    if not te.name_or_path:
        return None
    source = resolve_source(
        te.name_or_path, te.gguf_file, offline_wheel=te.offline_wheel, offline_gguf=te.offline_gguf, log=log
    )
    tokenizer = load_tokenizer(source, revision=te.revision, trust_remote_code=te.trust_remote_code)
    theirs, ours = tokenizer.get_vocab(), student_tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:3]
        raise UserError(
            f"teacher.name_or_path={te.name_or_path!r}: its tokenizer's vocabulary differs from the student's "
            f"(model.name_or_path={cfg.model.name_or_path!r}: {len(theirs)} against {len(ours)} tokens; e.g. "
            f"{differ}). On-policy distillation scores the student's sampled token ids with the teacher, so "
            "both must share one tokenizer; choose a teacher of the student's family (a larger model of the "
            "same tokenizer, or a checkpoint of the student's own training)."
        )
    return source
