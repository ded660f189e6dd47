"""ddpkit compared with what it replaces, kept out of the installed package:

- `parity`: ddpkit's runtime against hand-written single, DDP and FSDP2 loops, to 1%;
- `startup`: the whole `ddpkit train` command against torchrun, `accelerate launch` and
  Lightning Fabric on the same job (`baselines/` holds their scripts);
- `overhead`: the runtime's cost per step, in µs, over a hand-written loop on a tiny model;
- `busy`: whole `ddpkit train` commands started together and alone, under each thread setting;
- `dropout`: a gpt step with no dropout, torch's and ddpkit's;
- `plan`: `ddpkit plan`'s step time on this machine's CPU against real steps.

Run from the repository root, with ddpkit installed:

    python -m benchmarks parity|startup|overhead|busy|dropout|plan|all [--quick] [--device cpu|cuda] [--json FILE --plot FILE.png]

They use the same runner, options and result records as `ddpkit bench`; results go to
benchmarks/results/ and `all` refreshes the comparison table in benchmarks/README.md.
"""

# name -> module, in the order `python -m benchmarks all` runs them
COMPARISONS: dict[str, str] = {
    "parity": "benchmarks.parity",
    "startup": "benchmarks.startup",
    "overhead": "benchmarks.overhead",
    "busy": "benchmarks.busy",
    "dropout": "benchmarks.dropout",
    "plan": "benchmarks.plan",
}
