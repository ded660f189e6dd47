"""`ddpkit train`: flags (over a `--config` YAML file, over the model's recipe) into a
`TrainConfig`, then `trainer.train`."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Sequence
from typing import Any

from . import _a_launchers_worker
from .parsing import OneLineErrors

# Imports inside functions: a command's --help and its flags' checks load no torch; what runs
# the command loads when it runs.


def main(argv: Sequence[str]) -> int:
    from ..observe.timeline import Timeline, gc_paused

    timeline = Timeline()  # from this process's start: the interpreter's start counts
    with _curves_helper(argv):
        with gc_paused():  # parsing and imports make only objects that stay
            cfg = parse(argv)  # --help and a bad flag end here, before torch loads
            from ..trainer import train

            timeline.mark("imports_done")
        train(cfg, timeline)
    return 0


def _curves_helper(argv: Sequence[str]) -> contextlib.AbstractContextManager[Any]:
    """The process that imports matplotlib on an idle core while this one imports torch, and
    draws curves.png at the end (`ddpkit.observe.plotter`); started first, before anything slow. Not
    for --help, nor for a process that torchrun or srun started as one of several ranks:
    it has no ddpkit parent that forks its workers, and every rank would start one."""
    from ..observe.plotter import helper

    if any(a in ("-h", "--help") for a in argv) or _a_launchers_worker() or "RANK" in os.environ:
        return contextlib.nullcontext()
    return helper()


def parse(argv: Sequence[str]) -> Any:
    """The `TrainConfig` of a command line. Precedence, lowest first: built-in defaults, the
    model's recipe, the YAML file, flags. (`--config`, `--model` and `--device` are read
    first: they decide which file and which recipe give the defaults.)"""
    from ..trainer.config import layered

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # `--conf` is no --config
    for flag in ("--config", "--model", "--device"):
        pre.add_argument(flag)
    known, _ = pre.parse_known_args(argv)
    return _parser(layered(known.config, known.model, known.device)).parse_args(argv).cfg


def _parser(defaults: Any) -> Any:
    import simple_parsing

    from ..trainer.config import TrainConfig

    class Parser(OneLineErrors, simple_parsing.ArgumentParser):
        def _preprocessing(self, *args: Any, **kwargs: Any) -> Any:
            # simple-parsing makes the dataclass's group when it parses or prints help: it is
            # titled by the class and its destination ("TrainConfig ['cfg']") and repeats the
            # command's description. Every flag is an option of the command.
            out = super()._preprocessing(*args, **kwargs)
            for group in self._action_groups:
                if group.title and group.title.startswith(TrainConfig.__name__):
                    group.title, group.description = "training options", None
            return out

    parser = Parser(
        prog="ddpkit train",
        description=TrainConfig.__doc__,
        add_option_string_dash_variants=simple_parsing.DashVariant.DASH,
        formatter_class=_one_default_formatter(),
    )
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML file of options (keys as the flags without '--'); flags on the command line override it",
    )
    parser.add_arguments(TrainConfig, dest="cfg", default=defaults)
    return parser


def _one_default_formatter() -> type:
    import simple_parsing

    class OneDefault(simple_parsing.SimpleHelpFormatter):
        """A flag whose help says its default in words ("(default: runs/<date>-<time>)") does
        not get argparse's "(default: None)" after it; a flag without a default gets none."""

        def _get_help_string(self, action: argparse.Action) -> str | None:
            if action.default is None or (action.help and "(default" in action.help):
                return action.help
            return super()._get_help_string(action)

    return OneDefault
