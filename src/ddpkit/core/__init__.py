"""The bottom layer, which every other imports and which imports none of them: processes and
collectives (dist), devices, random streams (seed, draws), threads, precision, the CPU
allocator, input checks, files and locks, nested values (tree), memory readers and the log.

Nothing here imports torch at package import: `ddpkit --help` stays fast.
"""
