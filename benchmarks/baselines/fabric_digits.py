"""The digits job through Lightning Fabric, which starts its own processes:

    python fabric_digits.py

`Fabric(accelerator="cpu", devices=2, strategy="ddp")` re-runs this script for rank 1;
`setup_dataloaders` puts a DistributedSampler in the loader (32 samples per rank and step);
rank 0 evaluates the whole test set after every epoch.
"""

import torch
import torch.nn.functional as F
from digits_job import EPOCHS, GLOBAL_BATCH, SEED, StepClock, accuracy, cosine, load_digits, optimizer, small_cnn
from lightning.fabric import Fabric
from torch.utils.data import DataLoader


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    torch.manual_seed(SEED)
    train, test = load_digits()
    model = small_cnn()
    opt = optimizer(model.parameters())
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(train, batch_size=GLOBAL_BATCH // fabric.world_size, shuffle=True))
    sched = cosine(opt, EPOCHS * len(loader))
    clock = StepClock()
    for epoch in range(EPOCHS):
        clock.start()
        for x, y in loader:  # Fabric sets the sampler's epoch on each pass
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            fabric.backward(loss)
            opt.step()
            sched.step()
            clock.mark(tuple(x.shape))
        if fabric.global_rank == 0:
            acc = accuracy(model.module, test)
            print(f"epoch {epoch + 1}/{EPOCHS}  loss {loss.item():.4f}  test accuracy {acc:.4f}", flush=True)
        fabric.barrier()
    if fabric.global_rank == 0:
        print(f"final test accuracy {acc:.4f}", flush=True)
        print(clock.line(), flush=True)


if __name__ == "__main__":
    main()
