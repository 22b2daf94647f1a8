"""The equal-prefix comparison that benchmarks/spec_tp_matrix.py measures with and the DFlash2 lossless test
checks with: which steps count as the same prefix, which gap is taken, when a divergence is not a tie."""

from __future__ import annotations

import math

from spec_tp_matrix import compare_at_equal_prefix


def test_identical_runs_have_no_divergence_and_no_gap() -> None:
    top = [{7: -0.1, 8: -2.5}, {9: -0.3, 7: -1.4}]
    got = compare_at_equal_prefix([7, 9], top, [7, 9], top)
    assert got.diverged_at is None and got.max_gap == 0.0 and got.gap_before == 0.0 and not got.crossed


def test_the_gap_counts_every_shared_token_of_every_equal_prefix_step() -> None:
    # Same choice at step 0, but the runner-up moved by 0.5: a gap even though the tokens agree.
    a = [{7: -0.1, 8: -2.0}, {9: -0.2, 3: -1.9}]
    b = [{7: -0.1, 8: -2.5}, {9: -0.25, 3: -1.9}]
    got = compare_at_equal_prefix([7, 9], a, [7, 9], b)
    assert math.isclose(got.max_gap, 0.5) and got.worst_step == 0 and math.isclose(got.gap_before, 0.5)


def test_the_divergence_step_still_has_an_equal_prefix_and_is_compared() -> None:
    a = [{7: -0.1, 8: -2.0}, {9: -0.60, 3: -0.61}, {1: -0.1}]
    b = [{7: -0.1, 8: -2.0}, {3: -0.50, 9: -0.70}, {2: -0.1}]
    got = compare_at_equal_prefix([7, 9, 1], a, [7, 3, 2], b)
    assert got.diverged_at == 1 and not got.crossed
    assert math.isclose(got.max_gap, 0.11) and got.worst_step == 1 and got.gap_before == 0.0
    assert math.isclose(got.margin_at_divergence, 0.01)
    # Step 2 follows different prefixes: its disjoint top lists are not a gap.
    assert math.isfinite(got.max_gap)


def test_a_choice_missing_from_the_other_runs_top_list_is_crossed() -> None:
    a = [{7: -0.1, 8: -2.0}, {9: -0.5, 3: -1.0}]
    b = [{7: -0.1, 8: -2.0}, {4: -0.4, 3: -1.0}]
    got = compare_at_equal_prefix([7, 9], a, [7, 4], b)
    assert got.diverged_at == 1 and got.crossed


def test_disjoint_top_lists_at_an_equal_prefix_are_an_infinite_gap() -> None:
    got = compare_at_equal_prefix([7], [{7: -0.1, 8: -2.0}], [5], [{5: -0.1, 6: -2.0}])
    assert got.diverged_at == 0 and got.crossed and got.max_gap == math.inf
