"""The digits job as the PyTorch DDP tutorial writes it, for

    torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 torchrun_digits.py

DistributedDataParallel over gloo, a DistributedSampler (32 samples per rank and step: global
batch 64 on 2 processes), rank 0 evaluates the whole test set after every epoch.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from digits_job import EPOCHS, GLOBAL_BATCH, SEED, StepClock, accuracy, cosine, load_digits, optimizer, small_cnn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    train, test = load_digits()
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(train, batch_size=GLOBAL_BATCH // world, sampler=sampler)
    model = DistributedDataParallel(small_cnn())
    opt = optimizer(model.parameters())
    sched = cosine(opt, EPOCHS * len(loader))
    clock = StepClock()
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        clock.start()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            clock.mark(tuple(x.shape))
        if rank == 0:
            acc = accuracy(model.module, test)
            print(f"epoch {epoch + 1}/{EPOCHS}  loss {loss.item():.4f}  test accuracy {acc:.4f}", flush=True)
        dist.barrier()
    if rank == 0:
        print(f"final test accuracy {acc:.4f}", flush=True)
        print(clock.line(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
