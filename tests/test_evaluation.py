"""`evaluation`: an odd-sized test set is counted exactly once over the ranks, and every rank
gets the one-process result."""

from __future__ import annotations

import pytest

import ddpkit
from tests import workers


@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy,nproc,n", [("ddp", 2, 37), ("ddp", 3, 37), ("ddp", 3, 1), ("fsdp", 3, 37), ("fsdp", 3, 1)]
)  # fsdp: ranks with a batch fewer (or none) run forwards on empty batches to keep in step
def test_odd_test_set_counted_exactly_once(strategy, nproc, n):
    out = ddpkit.launch(workers.evaluate_odd, n, strategy, nproc=nproc)
    reference = workers.evaluate_odd(n)  # one process, no sharding
    assert reference["samples"] == n
    assert sum(r["shard"] for r in out.values()) == n  # shards partition the set: no padding
    for r in out.values():
        assert r["samples"] == n
        assert r["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-12)
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy,nproc,names,keys",
    [
        ("ddp", 2, ("input", "target"), None),  # found by their usual names
        ("fsdp", 3, ("input_ids", "labels"), None),  # fsdp: an empty batch is a dict too
        ("ddp", 2, ("features", "class"), ("features", "class")),  # named with keys=
    ],
)
def test_batches_that_are_mappings_give_the_result_of_pairs(strategy, nproc, names, keys):
    # a custom collate's dicts were refused ("evaluate needs batches of (input, target)")
    reference = workers.evaluate_odd(37)
    out = ddpkit.launch(workers.evaluate_odd, 37, strategy, names, keys, nproc=nproc)
    for r in out.values():
        assert r["samples"] == 37
        assert r["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-12)
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-6)


@pytest.mark.distributed
def test_a_custom_collate_that_renames_entries_serves_the_empty_batches_of_fsdp_too():
    # 37 samples in batches of 8 over 3 ranks: a rank with a batch fewer runs an empty one, which
    # came from the dataset's own entries ('ids', 'y'), not the collate's: "no entry 'input_ids'"
    reference = workers.evaluate_odd(37)
    out = ddpkit.launch(workers.evaluate_collated, 37, nproc=3)
    for r in out.values():
        assert r["samples"] == 37 and r["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-12)


@pytest.mark.unit
@pytest.mark.parametrize(
    "names,keys,said",
    [
        (("features", "class"), None, "has no input and no target entry; name its input and target"),
        (("input", "class"), None, "has no target entry; name its input and target"),
        (("input", "target"), ("input", "labels"), "has no entry 'labels'; name its input and target"),
    ],
)
def test_a_mapping_without_a_known_or_named_entry_is_one_clear_usage_error(names, keys, said):
    with pytest.raises(ddpkit.UsageError, match=rf"^evaluate: a batch that is a mapping \(.*\) {said}: rt.evaluate"):
        workers.evaluate_odd(5, "ddp", names, keys)


@pytest.mark.unit
def test_keys_that_are_not_two_names_are_refused():
    with pytest.raises(ddpkit.UsageError, match=r"rt.evaluate\(keys=...\): expected \(input name, target name\)"):
        workers.evaluate_odd(5, "ddp", ("a", "b"), "ab")


@pytest.mark.unit
def test_a_mappings_named_inputs_reach_the_model_as_keyword_arguments():
    # keys=(("input_ids", "attention_mask"), "labels"): the mask was dropped before (the model
    # got the input entry alone); the result is that of the masked inputs as pairs.
    out = workers.evaluate_masked(37)
    assert out["named"]["samples"] == 37
    assert out["named"]["accuracy"] == out["pairs"]["accuracy"]
    assert out["named"]["loss"] == pytest.approx(out["pairs"]["loss"], rel=1e-6)
    unmasked = workers.evaluate_odd(37)
    assert unmasked["loss"] != pytest.approx(out["named"]["loss"], rel=1e-3)  # the mask mattered


@pytest.mark.distributed
def test_named_inputs_under_fsdp_on_three_ranks_serve_the_empty_batches_too():
    reference = workers.evaluate_masked(37)["named"]
    for r in ddpkit.launch(workers.evaluate_masked, 37, "fsdp", nproc=3).values():
        assert r["named"]["samples"] == 37 and r["named"]["accuracy"] == reference["accuracy"]
        assert r["named"]["loss"] == pytest.approx(reference["loss"], rel=1e-6)


@pytest.mark.unit
@pytest.mark.parametrize("keys", [((), "y"), (("a", 1), "y"), (("a",), ("y",)), "ab", ("a", "b", "c")])
def test_keys_of_any_other_shape_are_refused(keys):
    with pytest.raises(ddpkit.UsageError, match=r"rt.evaluate\(keys=...\): expected \(input name, target name\)"):
        workers.evaluate_odd(5, "ddp", ("a", "b"), keys)
