"""What a run tells: metrics and timers, the tracker files and services (tracking), the
start-up timeline, plots and the plotter helper, the environment report (env) and
`ddpkit report`'s comparison of runs. Above the core; below the strategies, checkpoints,
launcher and the Runtime.
"""
