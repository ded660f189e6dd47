"""`images`: augmentation changes the samples, differs per epoch, and does not depend on the
number of ranks (it is keyed by the sample's position in the epoch)."""

from __future__ import annotations

import pytest
import torch

from ddpkit import data
from tests.data.helpers import CPU, image_set

pytestmark = pytest.mark.unit


def test_augmentation_does_not_depend_on_the_number_of_ranks():
    """Step k's augmented samples, over all ranks, are the same for 1 and 3 ranks."""
    ds = image_set()

    def step_batches(world):
        per_step = {}
        for rank in range(world):
            loader = data.train_loader(ds, 50, world_size=world, rank=rank, device=CPU, seed=1)
            step = 0
            for x, _y in loader:
                per_step.setdefault(step, []).append(x)
                step += loader.current.last
        return {k: torch.cat(v) for k, v in per_step.items()}

    one, three = step_batches(1), step_batches(3)
    assert one.keys() == three.keys()
    assert all(torch.equal(one[k], three[k]) for k in one)


def test_augmentation_changes_samples_and_differs_per_epoch():
    ds = image_set(augment=True)
    plain = image_set(augment=False)
    keys0 = data.augment_keys(0, 0, torch.arange(len(ds)))
    keys1 = data.augment_keys(0, 1, torch.arange(len(ds)))
    x0, _ = ds.batch(torch.arange(len(ds)), keys0)
    x1, _ = ds.batch(torch.arange(len(ds)), keys1)
    base, _ = plain.batch(torch.arange(len(ds)))
    changed = (x0 != base).flatten(1).any(1).float().mean().item()
    assert changed > 0.9  # 49 crops x 2 flips: about 1 in 98 samples stays as it was
    assert not torch.equal(x0, x1)
    flips = (keys0 & 1).float().mean().item()
    assert 0.4 < flips < 0.6
    assert ds[(3, int(keys0[3]))][0].shape == (3, 12, 12)


def test_a_sample_is_read_as_the_images_index_reads_it():
    # a negative index counts from the end; labels of a dtype index_select has no 1-D kernel for
    images = torch.randint(0, 255, (5, 1, 4, 4), dtype=torch.uint8)
    for labels in (torch.arange(5), torch.arange(5).to(torch.uint16)):
        ds = data.ImageSet(images, labels, 0.5, 0.2)
        for index in (-1, -5, 2, torch.tensor(3)):
            x, y = ds[index]
            assert torch.equal(x, (images[index].float() - 0.5) / 0.2) and y == labels[index]
        assert torch.equal(ds.batch(torch.tensor([4, 0]))[1], labels[[4, 0]])
        for outside in (5, -6):
            with pytest.raises(IndexError):
                ds[outside]
