"""Byte-level text for the language model (`--data text`): documents cut into sequences that
never cross a document's end, so their lengths vary.

The text is read at run time: from the file or directory `--text-path` names (each file one
document; a directory is read recursively in sorted order, hidden names skipped), or by
default from the Python standard library's own sources (the top-level modules of
`sysconfig.get_paths()["stdlib"]`, in sorted order, the first `STDLIB_BYTES`). So it needs no
network and no text is copied into the repository; the default text depends on the Python
version that runs it.

A document of n bytes gives n - 1 next-byte predictions. It is cut into sequences of at most
`seq_len` of them: sequence k reads bytes [k*L, k*L + L) and predicts bytes [k*L + 1, k*L + L]
(L = seq_len), so consecutive sequences share one byte and every prediction of the document
is in exactly one sequence; the last one of a document is shorter. A sample is that sequence
padded to `seq_len`: inputs padded with 0, targets with `IGNORE` (which cross-entropy skips),
so batches stack without a collate of their own and the padding never reaches a loss.
`token_counts` holds each sample's real targets: what the loader weighs micro-batches by.

The test set is a fixed tenth of the sequences (a permutation drawn with NumPy's PCG64 seeded
0, as for the digits), whatever `--seed` is; sequences of one document may fall on both sides.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import UsageError

IGNORE = -100  # the target of padding: torch's cross_entropy ignore_index default
VOCAB = 256  # bytes
STDLIB_BYTES = 2**20  # how much of the standard library's sources the default text reads
TEST_FRACTION = 0.1


class TextSet(Dataset):
    """Sequences of bytes: sample i is (inputs, targets), both int64 of length `seq_len`,
    cut from `data` (uint8, every document end to end) at `starts[i]` with `token_counts[i]`
    real targets. `batch(indices)` cuts a whole batch at once on the device the bytes are on
    (the resident path); `dataset[i]` is the same sample (the DataLoader path)."""

    def __init__(self, data: torch.Tensor, starts: torch.Tensor, token_counts: torch.Tensor, seq_len: int):
        self.data, self.starts, self.token_counts, self.seq_len = data, starts, token_counts, seq_len
        self._resident: dict[str, TextSet] = {}

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(torch.tensor([index]))
        return x[0], y[0]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the samples at `indices`, shaped (len(indices), seq_len)."""
        offsets = torch.arange(self.seq_len, device=self.data.device)
        real = offsets < self.token_counts[indices, None]
        # Padding positions read byte 0 of the text (in bounds), then are overwritten.
        at = torch.where(real, self.starts[indices, None] + offsets, 0)
        x = torch.where(real, self.data[at].long(), 0)
        y = torch.where(real, self.data[at + 1].long(), IGNORE)
        return x, y

    def tokens(self) -> int:
        """Next-byte predictions in the whole set."""
        return int(self.token_counts.sum())

    def nbytes(self) -> int:
        return self.data.numel() + 8 * (self.starts.numel() + self.token_counts.numel())

    def to(self, device: torch.device) -> TextSet:
        """A copy living on `device` (made once, then reused)."""
        if self.data.device == device:
            return self
        key = str(device)
        if key not in self._resident:
            self._resident[key] = TextSet(
                self.data.to(device), self.starts.to(device), self.token_counts.to(device), self.seq_len
            )
        return self._resident[key]


def stdlib_files() -> list[str]:
    """The default text's files: the standard library's top-level modules, sorted by name."""
    folder = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(folder) if n.endswith(".py") and not n.startswith("."))
    return [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]


def text_files(path: str) -> list[str]:
    """The documents under `--text-path`: the file itself, or every regular file below the
    directory (hidden files and folders skipped), sorted by path."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise UsageError(f"--text-path {path}: no such file or directory")
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in files if not f.startswith(".")]
    return sorted(p for p in found if os.path.isfile(p))


def read_documents(path: str | None) -> list[bytes]:
    """The documents of `--text-path` (None: the standard library's sources, the first
    `STDLIB_BYTES` of them, the last file cut)."""
    files = stdlib_files() if path is None else text_files(os.path.expanduser(path))
    documents, total = [], 0
    for name in files:
        try:
            with open(name, "rb") as f:
                document = f.read() if path is not None else f.read(STDLIB_BYTES - total)
        except OSError as err:
            raise UsageError(f"--text-path {name}: cannot read it ({err.strerror})") from None
        documents.append(document)
        total += len(document)
        if path is None and total >= STDLIB_BYTES:
            break
    return documents


def cut(documents: list[bytes], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(all bytes, start of each sequence, its targets): every document cut into sequences of
    at most `seq_len` next-byte predictions (see the module's docstring)."""
    starts, counts, offset = [], [], 0
    for document in documents:
        predictions = len(document) - 1
        for k in range(0, max(0, predictions), seq_len):
            starts.append(offset + k)
            counts.append(min(seq_len, predictions - k))
        offset += len(document)
    joined = b"".join(documents)
    data = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.zeros(0, dtype=torch.uint8)
    return data, torch.tensor(starts, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64)


def split(data: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, seq_len: int) -> tuple[TextSet, TextSet]:
    """(train, test): a fixed tenth of the sequences (at least one) for test, in their order."""
    order = np.random.default_rng(0).permutation(len(starts))
    n_test = max(1, round(TEST_FRACTION * len(starts)))
    test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
    return (
        TextSet(data, starts[train], counts[train], seq_len),
        TextSet(data, starts[test], counts[test], seq_len),
    )


def text(path: str | None, seq_len: int) -> tuple[TextSet, TextSet]:
    """(train, test) sequences of `--text-path` (None: the standard library's sources)."""
    if seq_len < 1:
        raise UsageError(f"--seq-len must be positive, got {seq_len}")
    data, starts, counts = cut(read_documents(path), seq_len)
    if len(starts) < 2:
        where = f"--text-path {path}" if path is not None else "the standard library's sources"
        raise UsageError(
            f"{where}: too little text for a training and a test sequence (it needs a file of at least "
            f"{seq_len + 2} bytes, or two of at least 2)"
        )
    return split(data, starts, counts, seq_len)
