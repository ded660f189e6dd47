"""`python -m benchmarks NAME`: the comparison benchmarks, through `ddpkit bench`'s runner."""

import sys

from ddpkit.cli import run_command
from ddpkit.cli.bench import main

from . import COMPARISONS

if __name__ == "__main__":
    sys.exit(
        run_command(
            "python -m benchmarks",
            lambda argv: main(argv, COMPARISONS, prog="python -m benchmarks", table="compare"),
            sys.argv[1:],
        )
    )
