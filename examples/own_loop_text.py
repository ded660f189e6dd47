"""A small byte-level language model in your own training loop, on any number of processes.

Each line of text is one sequence, so sequences differ in length: a padding collate makes the
batches, the loss is a mean over real tokens and every update is weighted by tokens (so it is
the one-process update on any number of processes), the test predictions are gathered exactly
once in dataset order, the full state is saved every epoch and a stopped run resumes from it,
and metrics go to metrics.jsonl / metrics.csv (and TensorBoard or MLflow with --log-with).

    ddpkit run --nproc 2 examples/own_loop_text.py --epochs 3 --stop-after 1 --out /tmp/lines
    ddpkit run --nproc 2 examples/own_loop_text.py --epochs 3 --out /tmp/lines --resume

The text is the Python standard library's sources read at run time (or --text FILE_OR_DIR);
--synthetic uses generated counting sequences instead.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

import ddpkit

IGNORE = -100  # the target of padding: cross-entropy skips it
VOCAB = 256  # bytes


def lines_of(text: str | None, synthetic: bool, max_len: int = 64) -> list[torch.Tensor]:
    """Sequences of 2 to `max_len` bytes: lines of text, or generated counting sequences."""
    if synthetic:
        g = torch.Generator().manual_seed(0)
        starts = torch.randint(0, VOCAB, (600,), generator=g)
        lengths = torch.randint(2, 24, (600,), generator=g)
        return [(s + torch.arange(int(n))) % VOCAB for s, n in zip(starts, lengths)]
    from ddpkit.data.text import read_documents

    lines = (line[:max_len] for doc in read_documents(text) for line in doc.split(b"\n"))
    return [torch.tensor(list(line)) for line in lines if len(line) >= 2][:20000]


def pad(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (bytes but the last, padded with 0) and next-byte targets (padded with IGNORE)."""
    x = pad_sequence([s[:-1] for s in samples], batch_first=True)
    y = pad_sequence([s[1:] for s in samples], batch_first=True, padding_value=IGNORE)
    return x, y


class LineModel(nn.Module):
    """An embedding, a GRU over the line so far, and a next-byte head."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.emb(x))[0])


def per_line(logits: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per test line: its summed next-byte loss, correct predictions and real targets, which
    rt.evaluate gathers once per line, in dataset order, on any number of processes."""
    real = y != IGNORE
    loss = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=IGNORE, reduction="none").sum(1)
    return {"loss": loss.double(), "correct": ((logits.argmax(-1) == y) & real).sum(1), "tokens": real.sum(1)}


def main(args: argparse.Namespace) -> dict:
    seqs = lines_of(args.text, args.synthetic)
    test, train = seqs[: len(seqs) // 10], seqs[len(seqs) // 10 :]
    state = os.path.join(args.out, "state.pt")
    with ddpkit.Runtime(seed=0, log_dir=args.out, log_with=args.log_with) as rt:
        model = LineModel()
        model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=args.lr))
        loader = rt.loader(DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=pad))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * loader.steps_per_epoch)
        step = rt.load_state(state, scheduler=sched)["step"] if args.resume else 0
        rt.log_params(**vars(args))
        while loader.epoch < args.epochs:
            for x, y in rt.progress(loader, desc=f"epoch {loader.epoch + 1}"):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
                rt.backward(loss, weight=(y != IGNORE).sum())  # a mean over tokens, weighted by them
                if rt.step(opt):
                    sched.step()
                    step += 1
            lines = rt.evaluate(model, DataLoader(test, batch_size=256, collate_fn=pad), outputs=per_line)["outputs"]
            tokens = int(lines["tokens"].sum())  # every test line exactly once: exact per-byte figures
            loss, accuracy = lines["loss"].sum().item() / tokens, lines["correct"].sum().item() / tokens
            rt.log(step, epoch=loader.epoch, test_loss=loss, test_accuracy=accuracy)
            rt.print(
                f"epoch {loader.epoch}: test loss {loss:.4f}, next-byte accuracy {accuracy:.4f} over {tokens} bytes"
            )
            rt.save_state(state, scheduler=sched, step=step)
            if loader.epoch == args.stop_after:  # as if the job were stopped here
                break
        return {"lines": len(lines["tokens"]), "loss": loss, "accuracy": accuracy, "steps": step}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="the GLOBAL batch, in lines")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--text", help="a text file or a directory of them (default: the standard library's sources)")
    p.add_argument("--synthetic", action="store_true", help="generated counting sequences instead of text")
    p.add_argument("--out", default="runs/own-loop-text", help="metrics and the full state go here")
    p.add_argument("--resume", action="store_true", help="continue from --out/state.pt")
    p.add_argument("--stop-after", type=int, help="stop after this epoch, as if interrupted")
    p.add_argument("--log-with", nargs="*", default=[], help="tensorboard, mlflow and/or wandb")
    return p.parse_args(argv)


if __name__ == "__main__":
    results = ddpkit.launch(main, parse())  # under ddpkit run / torchrun: this rank's only
    if 0 in results:
        r = results[0]
        print(f"done: {r['steps']} steps, {r['lines']} test lines, loss {r['loss']!r}, accuracy {r['accuracy']:.4f}")
