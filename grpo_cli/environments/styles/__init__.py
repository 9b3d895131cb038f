"""Environment styles: what `environment.style` chooses, how `environment.fn` becomes a maker of
fresh environments (grpo-cli's own interface, TRL's classes, skyrl-gym's text environments).

A style is a plug-in (grpo_cli/plugins.py): one module declaring `PLUGIN = Plugin(...)`. The
modules of this package are the built-ins, each named by its file (`environment.style=trl` is
trl.py); a user's is chosen by import path (`environment.style=my_pkg.my_style`), by the same
rule. Config validation takes the names from the modules. What this package asks of it:

    build(cfg, path, where) -> make   make() -> a fresh environment with the interface of
                                      grpo_cli/environments/__init__.py; cfg: the environment
                                      section; path: environment.fn (or one entry of its mapping);
                                      where: that key, for its errors (UserError, one paragraph)
    check(env) -> problems            its checks of the environment section, run by validation
    options                           none (the environment section has no options node)
    facts: Facts                      what environment.fn names under it, whether plain tools may
                                      stand in for it, the keys it alone reads, and
                                      the task defaults it declares (rewards,
                                      max_new_tokens; None: the data source's)
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli import plugins
from grpo_cli.errors import UserError
from grpo_cli.plugins import Plugin


@dataclass(frozen=True)
class Facts:
    """What a style declares. fn: what environment.fn names under it, as messages say it ("the TRL
    environment class by import path (environment.fn=my_pkg.envs:MyEnv)"); tools: environment.tools
    (plain functions, which make a ToolEnv) may stand in for environment.fn; keys: the keys of the
    environment section that it alone reads (validation reports them set under another style);
    rewards and max_new_tokens: the task defaults it declares where the user sets none
    (grpo_cli/config/task.py), None: the data source's."""

    fn: str = "an import path (my_pkg.envs:MyEnv)"
    tools: bool = False
    keys: tuple[str, ...] = ()
    rewards: tuple[str, ...] | None = None
    max_new_tokens: int | None = None


def plugin(name: str) -> Plugin:
    """The declaration of style `name`: a module of this package, or a user's by import path
    (plugins.load). UserError otherwise, or where its facts are not a Facts."""
    declared = plugins.load(__name__, name, "environment.style")
    if not isinstance(declared.facts, Facts):
        raise UserError(
            f"environment.style={name!r}: its PLUGIN's facts is {type(declared.facts).__name__}, not a "
            "grpo_cli.environments.styles.Facts; declare Plugin(..., facts=Facts(fn=...)) in its module."
        )
    return declared


def foreign_keys(chosen: str) -> dict[str, str]:
    """The environment keys that other built-in styles read and `chosen` does not, each with the
    style that reads it."""
    return plugins.foreign_keys(__name__, chosen, lambda name: plugin(name).facts)
