"""The digits job through Hugging Face Accelerate, for

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 accelerate_digits.py

(`--multi_gpu` is Accelerate's switch for "several local processes through torchrun"; with
`Accelerator(cpu=True)` they run on the CPU over gloo. `--cpu` alone would start one process.)
The prepared loader gives each process 32 samples per step; the main process evaluates.
"""

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from digits_job import EPOCHS, GLOBAL_BATCH, SEED, StepClock, accuracy, cosine, load_digits, optimizer, small_cnn
from torch.utils.data import DataLoader


def main() -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(SEED)
    train, test = load_digits()
    model = small_cnn()
    opt = optimizer(model.parameters())
    loader = DataLoader(train, batch_size=GLOBAL_BATCH // accelerator.num_processes, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    # Not prepared: Accelerate would step a prepared scheduler once per process per step.
    sched = cosine(opt.optimizer, EPOCHS * len(loader))
    clock = StepClock()
    for epoch in range(EPOCHS):
        clock.start()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            clock.mark(tuple(x.shape))
        if accelerator.is_main_process:
            acc = accuracy(accelerator.unwrap_model(model), test)
            print(f"epoch {epoch + 1}/{EPOCHS}  loss {loss.item():.4f}  test accuracy {acc:.4f}", flush=True)
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print(f"final test accuracy {acc:.4f}", flush=True)
        print(clock.line(), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
