"""One plug-in shape (grpo_cli/plugins.py): a throwaway plug-in of each kind, written the way a
user writes one (one module in a folder on the import path, one preset in a config folder of
their own on Hydra's search path, nothing inside grpo_cli/ or conf/), runs in a real grpo-train
run. The test counts the files each kind took and checks that the package and the shipped
presets were not touched: 1 module + 1 preset (a tracker: 1 module, chosen by name in
trainer.report_to) and 0 edits elsewhere."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import pytest
from conftest import CONF, ROOT, grpo, tiny

from grpo_cli import plugins
from grpo_cli.errors import UserError

# kind -> (module name, its source, its preset's config group or None, the preset's text).
# `{marks}` is the folder where each plug-in leaves a mark when it runs.
PLUGINS = {
    "sampler": (
        "my_sampler",
        """
        from dataclasses import dataclass
        from pathlib import Path

        from grpo_cli.plugins import Plugin
        from grpo_cli.samplers import Facts, builtin


        @dataclass(frozen=True)
        class Options:
            mark: str = ""


        def build(cfg, context):
            Path(context.options.mark).write_text("built")
            return builtin.PLUGIN.build(cfg, context)  # draws as the built-in one does


        PLUGIN = Plugin(name="my_sampler", build=build, options=Options, facts=Facts(exact_draw=True))
        """,
        "sampler",
        "backend: my_sampler:PLUGIN\noptions:\n  mark: {marks}/sampler\n",
    ),
    "reward": (
        "my_reward",
        """
        def my_reward(completions, answer, **kwargs):
            return [float(answer[i] in str(c)) for i, c in enumerate(completions)]
        """,
        "reward",
        "my_reward:\n  fn: my_reward:my_reward\n  role: correctness\n",
    ),
    "loss variant": (
        "my_loss",
        """
        from dataclasses import dataclass
        from pathlib import Path

        from grpo_cli.loss import Variant
        from grpo_cli.loss.reductions import token_mean
        from grpo_cli.loss.terms import clipped_surrogate
        from grpo_cli.plugins import Plugin


        @dataclass(frozen=True)
        class Options:
            scale: float = 1.0
            mark: str = ""


        def term(ratio, adv, cfg):
            Path(cfg.options["mark"]).write_text("used")
            return cfg.options["scale"] * clipped_surrogate(ratio, adv, cfg)


        PLUGIN = Plugin(
            name="my_loss", build=lambda: Variant(policy_term=term, reduce=token_mean), options=Options
        )
        """,
        "loss",
        "loss_type: my_loss:PLUGIN\noptions:\n  scale: 2.0\n  mark: {marks}/loss\n",
    ),
    "data source": (
        "my_data",
        """
        from dataclasses import dataclass

        from grpo_cli.data import Facts
        from grpo_cli.plugins import Plugin


        @dataclass(frozen=True)
        class Options:
            count: int = 40


        def rows(d, seed, options):
            made = [{"prompt": f"Repeat the number {i}.", "answer": str(i)} for i in range(options.count)]
            return made[d.eval_size :], made[: d.eval_size]


        PLUGIN = Plugin(name="my_data", build=rows, options=Options, facts=Facts())
        """,
        "data",
        "source: my_data:PLUGIN\neval_size: 8\noptions:\n  count: 24\n",
    ),
    "tracker": (
        "my_tracker",
        """
        import json

        from grpo_cli.plugins import Plugin
        from grpo_cli.trackers import Facts


        class Tracker:
            def __init__(self, start):
                self.file = open(start.run_dir / "my_tracker.jsonl", "a")

            def log(self, row):
                self.file.write(json.dumps(row) + "\\n")

            def close(self):
                self.file.close()


        PLUGIN = Plugin(name="my_tracker", build=Tracker, facts=Facts())
        """,
        None,
        None,
    ),
    "environment": (
        "my_env",
        """
        from pathlib import Path


        class Again:
            \"\"\"One reply, then the episode ends.\"\"\"

            def reset(self, row):
                Path("MARKS/environment").write_text("reset")
                return None

            def step(self, text):
                self.turns = getattr(self, "turns", 0) + 1
                return "Once more." if self.turns == 1 else None
        """,
        "environment",
        "fn: my_env:Again\nmax_turns: 2\n",
    ),
}


def _tree_digest(*roots: Path) -> str:
    """One hash of every file under the roots (names and contents), caches aside."""
    h = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(ROOT)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def _write_plugins(tmp_path: Path) -> tuple[Path, Path, Path, dict[str, list[Path]]]:
    code, conf, marks = tmp_path / "code", tmp_path / "conf", tmp_path / "marks"
    for folder in (code, marks):
        folder.mkdir()
    written: dict[str, list[Path]] = {}
    for kind, (module, source, group, preset) in PLUGINS.items():
        files = [code / f"{module}.py"]
        files[0].write_text(textwrap.dedent(source).lstrip().replace("MARKS", str(marks)))
        if group is not None:
            (conf / group).mkdir(parents=True, exist_ok=True)
            files.append(conf / group / "mine.yaml")
            files[1].write_text(preset.format(marks=marks))
        written[kind] = files
    return code, conf, marks, written


def test_a_plugin_of_each_kind_takes_one_module_and_one_preset(tmp_path):
    """A user's sampler backend, reward, loss variant, data source, tracker and environment run in
    one grpo-train run (the tiny model, 2 steps) with no edit to grpo_cli/ or conf/."""
    before = _tree_digest(ROOT / "grpo_cli", CONF)
    code, conf, marks, written = _write_plugins(tmp_path)
    counts = {kind: len(files) for kind, files in written.items()}
    assert counts == {
        "sampler": 2,
        "reward": 2,
        "loss variant": 2,
        "data source": 2,
        "tracker": 1,
        "environment": 2,
    }
    args = tiny(
        f"hydra.searchpath=[file://{conf}]",
        "hydra.run.dir=run",
        "sampler=mine",
        "reward=[mine]",
        "loss=mine",
        "data=mine",
        "environment=mine",
        "trainer.report_to=[jsonl,my_tracker:PLUGIN]",
        "trainer.max_steps=2",
        "trainer.prompts_per_step=2",
        "trainer.save_steps=2",
        "trainer.log_completions=4",
    )
    args = [a for a in args if not a.startswith("data.num_examples")]
    res = grpo(args, tmp_path, env={"PYTHONPATH": f"{code}"}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if "rewards/my_reward/mean" in r]
    assert [r["step"] for r in step_rows] == [1, 2]
    # Each plug-in did its part: the sampler was built, the loss term ran, the environment was
    # reset, the tracker got every row.
    assert (marks / "sampler").read_text() == "built" and (marks / "loss").read_text() == "used"
    assert (marks / "environment").read_text() == "reset"
    tracked = (tmp_path / "run" / "my_tracker.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in tracked] == rows
    # The data source's prompts were trained on.
    assert "Repeat the number" in (tmp_path / "run" / "completions.jsonl").read_text()
    assert _tree_digest(ROOT / "grpo_cli", CONF) == before  # 0 edits elsewhere


@pytest.mark.parametrize(
    "name, expected",
    [
        ("nosuch", "is not one of builtin, vllm"),
        ("no_such_module:PLUGIN", "cannot be imported"),
        ("json:dumps", "not a grpo_cli.plugins.Plugin"),
    ],
)
def test_a_bad_plugin_name_is_one_paragraph_naming_it(name, expected):
    with pytest.raises(UserError) as exc:
        plugins.load("grpo_cli.samplers", name, "sampler.backend")
    message = str(exc.value)
    assert f"sampler.backend={name!r}" in message and expected in message and "\n" not in message


def test_options_are_typed_by_the_declaration():
    """A plug-in's options node becomes its options dataclass; an unknown key is named with the
    known ones; options given to a plug-in that takes none are refused."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Options:
        count: int = 3

    declared = plugins.Plugin(name="p", build=lambda: None, options=Options)
    assert plugins.read_options(declared, {"count": 5}, "data.options") == Options(count=5)
    assert plugins.read_options(declared, None, "data.options") == Options()
    with pytest.raises(
        UserError, match="data.options has size, which p does not read; its options are count"
    ):
        plugins.read_options(declared, {"size": 1}, "data.options")
    with pytest.raises(UserError, match="p takes no options"):
        plugins.read_options(plugins.Plugin(name="p", build=lambda: None), {"x": 1}, "data.options")


# A user's loss variant with a check of its own, and a user's environment style: the same rule as
# the built-ins (plugins.load), and their checks run in config validation.
CHECKED_LOSS = """
from dataclasses import dataclass

from grpo_cli.loss.reductions import token_mean
from grpo_cli.loss.terms import clipped_surrogate
from grpo_cli.loss.variants import Variant
from grpo_cli.plugins import Plugin


@dataclass(frozen=True)
class Options:
    scale: float = 1.0


def check(lo):
    scale = lo.options.get("scale", 1.0)
    if scale > 0:
        return []
    return [f"loss.options.scale={scale} must be > 0 (my_checked_loss scales its term by it); set it to 1.0."]


PLUGIN = Plugin(
    name="my_checked_loss",
    build=lambda: Variant(policy_term=clipped_surrogate, reduce=token_mean),
    options=Options,
    check=check,
)
"""

STYLE = """
from grpo_cli.environments.styles import Facts
from grpo_cli.plugins import Plugin


class Echo:
    def __init__(self, word):
        self.word = word

    def reset(self, row):
        return None

    def step(self, text):
        return None


def check(env):
    if env.fn == "echo":
        return []
    return [f"environment.fn={env.fn!r}: my_style knows only echo; set environment.fn=echo."]


PLUGIN = Plugin(name="my_style", build=lambda cfg, path, where: lambda: Echo(path), check=check, facts=Facts(fn="echo"))
"""


def test_a_user_loss_variants_check_runs_in_validation(tmp_path, monkeypatch, compose):
    from grpo_cli.config import validate

    (tmp_path / "my_checked_loss.py").write_text(CHECKED_LOSS)
    monkeypatch.syspath_prepend(str(tmp_path))
    chosen = "loss.loss_type=my_checked_loss:PLUGIN"
    assert validate(compose([chosen, "+loss.options.scale=2"])) == []
    problems = validate(compose([chosen, "+loss.options.scale=-1"]))
    assert problems == [
        "loss.options.scale=-1 must be > 0 (my_checked_loss scales its term by it); set it to 1.0."
    ]
    problems = validate(compose([chosen, "+loss.options.size=3"]))
    assert len(problems) == 1 and "loss.options has size, which my_checked_loss does not read" in problems[0]


def test_a_user_environment_style_is_one_module(tmp_path, monkeypatch, compose):
    """environment.style takes a user's style by import path, as every kind does: its build makes
    the environments, its check runs in validation; an unknown name lists the built-in modules."""
    from grpo_cli.config import validate
    from grpo_cli.environments import environment_factory

    (tmp_path / "my_style.py").write_text(STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose(["environment.style=my_style:PLUGIN", "environment.fn=echo"])
    assert validate(cfg) == []
    made = environment_factory(cfg.environment)({"prompt": "hi"})
    assert type(made).__name__ == "Echo" and made.word == "echo"
    problems = validate(compose(["environment.style=my_style:PLUGIN", "environment.fn=other"]))
    assert problems == ["environment.fn='other': my_style knows only echo; set environment.fn=echo."]
    (problem,) = validate(compose(["environment.style=gym", "environment.fn=echo"]))
    assert "environment.style='gym' is not one of native, text_gym, trl;" in problem


def test_a_builtin_environment_style_is_one_module(tmp_path, monkeypatch, compose):
    """A new built-in style is one module of grpo_cli/environments/styles/ (here written to a
    folder added to the package's path, so the package is not touched): environment.style takes
    its file name, and validation's list of styles names it, with no other edit."""
    import importlib
    import sys

    from grpo_cli.config import validate
    from grpo_cli.environments import styles

    (tmp_path / "echoing.py").write_text(STYLE.replace('name="my_style"', 'name="echoing"'))
    monkeypatch.setattr(styles, "__path__", [*styles.__path__, str(tmp_path)])
    importlib.invalidate_caches()
    try:
        assert validate(compose(["environment.style=echoing", "environment.fn=echo"])) == []
        (problem,) = validate(compose(["environment.style=gym", "environment.fn=echo"]))
        assert "is not one of echoing, native, text_gym, trl;" in problem
    finally:
        sys.modules.pop(f"{styles.__name__}.echoing", None)
        vars(styles).pop("echoing", None)
