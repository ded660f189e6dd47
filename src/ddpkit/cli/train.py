"""`ddpkit train`: flags (over a `--config` YAML file, over the model's recipe) into a
`TrainConfig`, then `trainer.train`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from .parsing import OneLineErrors


def main(argv: Sequence[str]) -> int:
    from ..timeline import Timeline, gc_paused

    timeline = Timeline()  # from this process's start: the interpreter's start counts
    with gc_paused():  # imports and parsing make only objects that stay
        from ..trainer import train

        timeline.mark("imports_done")
        cfg = parse(argv)
    train(cfg, timeline)
    return 0


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
        pass

    parser = Parser(
        prog="ddpkit train",
        description=TrainConfig.__doc__,
        add_option_string_dash_variants=simple_parsing.DashVariant.DASH,
    )
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML file of options (keys as the flags without '--'); flags on the command line override it",
    )
    parser.add_arguments(TrainConfig, dest="cfg", default=defaults)
    return parser
