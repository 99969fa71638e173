"""The verdict rule on made-up paired differences: every outcome, and the paired form."""
import math

import pytest

from pyprune.studies.verdict import AHEAD, BEHIND, UNSETTLED, paired_verdict, verdict


def test_same_sign_and_clear_of_two_standard_errors_is_ahead_or_behind():
    # perplexity: negative differences (A lower) put A ahead
    ahead = verdict([-3.0, -2.5, -3.5])
    assert ahead.word == AHEAD and ahead.seeds == 3
    assert math.isclose(ahead.mean, -3.0) and math.isclose(ahead.std, 0.5)
    assert math.isclose(ahead.sem, 0.5 / math.sqrt(3))
    assert verdict([3.0, 2.5, 3.5]).word == BEHIND
    # a metric where higher is better flips the words
    assert verdict([3.0, 2.5, 3.5], lower_is_better=False).word == AHEAD
    assert verdict([-3.0, -2.5, -3.5], lower_is_better=False).word == BEHIND


def test_signs_that_differ_leave_it_unsettled_however_large_the_mean():
    result = verdict([-10.0, -12.0, 0.5])
    assert result.word == UNSETTLED and "sign" in result.reason
    # a zero difference is no sign either way
    assert verdict([-1.0, -1.1, 0.0]).word == UNSETTLED


def test_a_mean_within_two_standard_errors_is_unsettled():
    # same sign on every seed, but mean 1.0, std 0.9: sem 0.52, 2·sem 1.04 > 1.0
    result = verdict([0.1, 1.9, 1.0])
    assert result.word == UNSETTLED and "2·sem" in result.reason
    assert result.sem * 2 > abs(result.mean)
    # the same spread over more seeds clears it: sem shrinks with √n
    assert verdict([0.1, 1.9, 1.0] * 3).word == BEHIND


def test_one_seed_is_unsettled():
    result = verdict([-50.0])
    assert result.word == UNSETTLED and result.seeds == 1 and result.reason == "one seed"
    assert math.isnan(result.std)
    with pytest.raises(ValueError):
        verdict([])


def test_the_safe_controls_rows_at_4_8_and_50_percent():
    """The paired differences of SAFE⁺ − its masked-reconstruction control in
    benchmarks/results/safe-controls-smollm2-135m.md: behind at 4:8 (every seed positive, t ≈ 2.2),
    unsettled at 50% (one seed of three positive)."""
    assert verdict([2.984, 0.257, 2.036]).word == BEHIND
    assert verdict([0.123, -1.417, -2.273]).word == UNSETTLED


def test_paired_verdict_uses_the_seeds_both_arms_ran():
    ours = {0: 10.0, 1: 11.0, 2: 12.0, 3: 99.0}
    theirs = {0: 12.0, 1: 13.5, 2: 14.2}
    result = paired_verdict(ours, theirs)
    assert result.word == AHEAD and result.seeds == 3
    assert math.isclose(result.mean, (-2.0 - 2.5 - 2.2) / 3)
    assert str(result).startswith("ahead (-2.23 ± 0.252 over 3 seeds")
    with pytest.raises(ValueError):
        paired_verdict({0: 1.0}, {1: 1.0})
