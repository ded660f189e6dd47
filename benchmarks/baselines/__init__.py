"""The job of `python -m benchmarks startup` written by hand for other launchers: plain scripts, run as
files (`python SCRIPT`, `torchrun SCRIPT`, `accelerate launch SCRIPT`), never imported by ddpkit.

- torchrun_digits.py: torchrun + DistributedDataParallel + DistributedSampler, as the tutorials do;
- accelerate_digits.py: the same loop through Hugging Face Accelerate;
- fabric_digits.py: the same loop through Lightning Fabric, which launches its own processes;
- digits_job.py: what all three share (data, model, hyperparameters, evaluation), so they train
  exactly what `ddpkit train --epochs 10` trains. It imports only NumPy and torch.
"""
