"""A reward for the learnable band's tests (tests/test_sft.py): it passes every completion of a
prompt whose answer is even and none of one whose answer is odd, so each prompt's pass rate is
exactly 1 or 0 whatever the model writes."""


def even_answer(completions, answer, **kwargs):
    return [1.0 if int(a) % 2 == 0 else 0.0 for a in answer]


def every_other(completions, **kwargs):
    """Passes completions 0, 2, 4, ... of each call: a pass rate of one half for every prompt
    graded in groups of an even size."""
    return [1.0 if i % 2 == 0 else 0.0 for i in range(len(completions))]
