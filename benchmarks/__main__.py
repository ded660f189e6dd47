"""`python -m benchmarks NAME`: the comparison benchmarks, through `ddpkit bench`'s runner, and
`python -m benchmarks gpu`, the GPU check (benchmarks/gpu.py), which must start before ddpkit
is installed and so imports nothing of it."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["gpu"]:
        from .gpu import main as gpu

        sys.exit(gpu(sys.argv[2:]))

    from ddpkit.cli import run_command
    from ddpkit.cli.bench import main

    from . import COMPARISONS

    code = run_command(
        "python -m benchmarks",
        lambda argv: main(argv, COMPARISONS, prog="python -m benchmarks", table="compare"),
        sys.argv[1:],
    )
    if sys.argv[1:2] in ([], ["-h"], ["--help"]):
        print(f"  {'gpu':<12} the GPU check: CUDA tests and GPU figures in one run (python -m benchmarks gpu --help)")
    sys.exit(code)
