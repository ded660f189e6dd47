"""`text`: byte sequences cut at document ends (lengths vary, every next-byte prediction in
exactly one sequence, padding ignored), a fixed split, the standard library's sources as the
offline default, bad paths refused; and the sampler's token counts, which the runtime weighs
micro-batches by, add up to the global batch's on any number of ranks."""

from __future__ import annotations

import pytest
import torch

from ddpkit import data
from ddpkit.data import IGNORE, text
from ddpkit.errors import UsageError

pytestmark = pytest.mark.unit

SEQ = 16
DOCUMENTS = {"a.txt": b"x" * 40, "b.txt": b"hello world", "c.txt": b"q", "sub/d.md": bytes(range(200)) * 2}


@pytest.fixture
def corpus(tmp_path):
    for name, content in DOCUMENTS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    (tmp_path / ".hidden").write_bytes(b"never read" * 10)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "objects").write_bytes(b"never read either" * 10)
    return tmp_path


def test_sequences_stay_inside_documents_and_cover_every_prediction(corpus):
    train, test = text.text(str(corpus), SEQ)
    documents = [DOCUMENTS[n] for n in sorted(DOCUMENTS)]  # sorted by path; hidden files skipped
    # Each document of n bytes gives n - 1 predictions ("c.txt", one byte, gives none).
    assert train.tokens() + test.tokens() == sum(len(d) - 1 for d in documents)
    # Every (input, target) pair of every sequence is two consecutive bytes of one document.
    pairs = {(d[i], d[i + 1]) for d in documents for i in range(len(d) - 1)}
    lengths = []
    for dataset in (train, test):
        x, y = dataset.batch(torch.arange(len(dataset)))
        assert x.shape == y.shape == (len(dataset), SEQ) and x.dtype == y.dtype == torch.int64
        for row_x, row_y, n in zip(x, y, dataset.token_counts.tolist()):
            assert all((a, b) in pairs for a, b in zip(row_x[:n].tolist(), row_y[:n].tolist()))
            assert (row_y[n:] == IGNORE).all() and (row_x[n:] == 0).all()  # padding, never a target
            lengths.append(n)
    # Lengths vary: full sequences, and the shorter ends of documents (39 = 2*16 + 7, 10, 399 = 24*16 + 15).
    assert sorted(set(lengths)) == [7, 10, 15, 16]


def test_a_sample_is_the_same_on_both_data_paths(corpus):
    train, _ = text.text(str(corpus), SEQ)
    x, y = train.batch(torch.tensor([3, 0, len(train) - 1]))
    for row, i in enumerate([3, 0, len(train) - 1]):
        assert torch.equal(train[i][0], x[row]) and torch.equal(train[i][1], y[row])


def test_split_is_fixed_and_a_tenth(corpus):
    train, test = text.text(str(corpus), SEQ)
    again_train, again_test = text.text(str(corpus), SEQ)
    assert torch.equal(train.starts, again_train.starts) and torch.equal(test.starts, again_test.starts)
    assert len(test) == round(0.1 * (len(train) + len(test)))
    assert not set(train.starts.tolist()) & set(test.starts.tolist())


def test_one_file_is_one_document(tmp_path):
    path = tmp_path / "one.txt"
    path.write_bytes(b"abcdefghij" * 5)  # 49 predictions: 16, 16, 16, 1
    train, test = text.text(str(path), SEQ)
    assert sorted(train.token_counts.tolist() + test.token_counts.tolist()) == [1, 16, 16, 16]


def test_default_text_is_the_standard_librarys_sources():
    splits = data.load("text", seq_len=128)
    assert splits.in_shape == (128,) and splits.num_classes == 256
    assert splits.train.data.numel() == text.STDLIB_BYTES  # read at run time, cut to the cap
    assert len(splits.train) > 1000 and len(splits.test) > 100
    counts = splits.train.token_counts
    assert counts.max() == 128 and counts.min() < 128  # the last sequences of files are shorter
    first = text.stdlib_files()[0]
    with open(first, "rb") as f:
        head = f.read(10)
    assert bytes(splits.train.data[:10].tolist()) == head


@pytest.mark.parametrize("content", [None, b"", b"ab"])
def test_a_path_without_enough_text_is_refused(tmp_path, content):
    path = tmp_path / "t.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError, match="--text-path"):
        text.text(str(path), SEQ)


@pytest.mark.parametrize("n,batch,micro,world", [(21, 10, None, 3), (21, 10, 2, 3), (23, 7, 3, 2), (5, 5, 1, 4)])
def test_token_counts_of_micro_batches_add_up_to_the_global_batch(n, batch, micro, world):
    counts = torch.randint(1, 20, (n,), generator=torch.Generator().manual_seed(n))
    tokens: dict[int, int] = {}  # step -> tokens over all ranks and micro-batches
    totals: dict[int, set[int]] = {}  # step -> the global batch's tokens, as each micro-batch says
    for rank in range(world):
        sampler = data.GlobalBatchSampler(
            n, batch, world, rank, seed=2, micro_batch_size=micro, lockstep=True, token_counts=counts
        )
        step = 0
        for indices, info in sampler.plan():
            assert info.tokens == int(counts[indices].sum()) == info.count
            tokens[step] = tokens.get(step, 0) + info.tokens
            totals.setdefault(step, set()).add(info.step_count)
            step += info.last
    assert all(totals[step] == {tokens[step]} for step in tokens)
    assert sum(tokens.values()) == int(counts.sum())
    # Without token counts a micro-batch counts its samples, as before.
    info = next(data.GlobalBatchSampler(n, batch, world, 0).plan())[1]
    assert info.tokens is None and info.count == info.size
