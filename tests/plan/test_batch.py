"""The search for the largest micro-batch (``fabriclite/plan/batch.py``) on peaks whose truth is known: a trace
function standing in for the plan, its peak growing with the batch as a script's does (flat while the optimizer's
step holds the peak, then the forward's activations taking over)."""

from fabriclite.plan.batch import largest_batch
from fabriclite.plan.report import Plan

MEMORY = 10_000_000


def tracer(peak):
    traced = []

    def trace(batch: int) -> Plan:
        traced.append(batch)
        return planned(batch, peak)

    return trace, traced


def planned(batch: int, peak) -> Plan:
    plan = Plan(
        "train.py", 8, 8, 1, steps=2, device_memory=MEMORY, configuration=[("optimizer", "AdamW; state float32")]
    )
    plan.peak_bytes, plan.setup_peak_bytes = peak(batch), 1_000
    plan.memory = {"parameters": 1_000_000, "buffers": 0, "optimizer state": 2_000_000, "gradients": 1_000_000,
                   "collective buffers": 0, "activations and temporaries": peak(batch) - 4_000_000, "other": 0}  # fmt: skip
    return plan


def two_regimes(batch: int) -> int:
    """The optimizer's step holds the peak up to batch 100 (4 MB and 1 kB a sample), the forward after it (10 kB a
    sample): 10 MB is first passed at batch 701."""
    return max(4_000_000 + 1_000 * batch, 3_000_000 + 10_000 * batch)


def test_the_largest_batch_that_fits_and_the_next_that_does_not_are_both_traced():
    trace, traced = tracer(two_regimes)
    found = largest_batch(planned(32, two_regimes), [32, None], trace)
    assert found["script"] == 32 and found["largest"] == 700 and found["first_over"] == 701
    rows = {row["batch"]: row for row in found["traced"]}
    assert rows[700] == {"batch": 700, "peak_bytes": 10_000_000, "fits": True}
    assert not rows[701]["fits"] and found["changes"] == [] and "note" not in found
    assert traced[0] == 16 and len(traced) <= 6, traced  # half the script's batch, then along the line


def test_when_not_even_batch_1_fits_it_says_what_to_change_with_the_figures():
    def huge(batch: int) -> int:
        return 9_900_000 + 200_000 * batch

    found = largest_batch(planned(8, huge), [8], tracer(huge)[0])
    assert found["largest"] == 0 and found["first_over"] == 1
    changes = "\n".join(found["changes"])
    assert "at batch 1 the peak is 9.63 MiB, 97.66 KiB over 9.54 MiB" in changes
    # 4 MB of model state on this rank: halving it brings 10.1 MB under 10 MB.
    assert "hold 3.81 MiB on this rank; sharding them over 2 times as many ranks" in changes
    assert "in bfloat16 it would hold 976.56 KiB" in changes


def test_a_script_without_a_batched_loader_is_not_searched_and_says_why():
    trace, traced = tracer(two_regimes)
    found = largest_batch(planned(32, two_regimes), [None], trace)
    assert found["largest"] is None and traced == [] and "no loader with torch's BatchSampler" in found["note"]


def test_a_peak_that_does_not_grow_with_the_batch_ends_the_search():
    trace, traced = tracer(lambda batch: 5_000_000)
    found = largest_batch(planned(32, lambda batch: 5_000_000), [32], trace)
    assert found["first_over"] is None and "does not grow with the loaders' batch" in found["note"]
    assert traced == [16, 64]  # doubled once, then three traces in a row held the same peak


def test_a_peak_flat_at_small_batches_is_followed_by_doubling_the_batch():
    def shuffle_then_activations(batch: int) -> int:  # a 9 MB permutation holds the peak up to batch 30
        return max(9_000_000, 6_000_000 + 100_000 * batch)

    trace, traced = tracer(shuffle_then_activations)
    found = largest_batch(planned(16, shuffle_then_activations), [16], trace)
    assert found["largest"] == 40 and found["first_over"] == 41, found
    assert traced[:2] == [8, 32], traced  # 8 and 16 held the same peak: the batch doubled


def test_a_batch_the_script_cannot_run_at_bounds_the_search_and_says_why():
    def small_data_set(batch: int) -> Plan:  # 600 samples per rank: a larger batch yields none, and the loop fails
        plan = planned(batch, two_regimes)
        if batch > 600:
            plan.error, plan.steps = "UnboundLocalError: cannot access local variable 'loss'", 0
        return plan

    found = largest_batch(planned(32, two_regimes), [32], small_data_set)
    assert 540 <= found["largest"] <= 600 and found["first_over"] <= 700, found  # out of traces before exact
    assert "did not trace the steps at a batch of" in found["note"] and "UnboundLocalError" in found["note"]
    assert all(row["fits"] == (row["batch"] <= 600) for row in found["traced"]), found["traced"]
