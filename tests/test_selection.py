"""filters/selection: the radix selection gives exactly what a full sort gives."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pairforge.filters.selection import kth_largest, sortable_keys, value_of


def sorted_threshold(values: np.ndarray, fraction: float) -> float:
    """The single-process rule it replaces: sort everything, take the k-th largest."""
    if not len(values):
        return float("-inf")
    k = max(1, int(round(fraction * len(values))))
    return float(np.sort(values)[::-1][k - 1])


def over(shards: list[np.ndarray]):  # noqa: ANN201
    return lambda fn: (fn(s) for s in shards)


def test_keys_sort_as_the_floats_do() -> None:
    values = np.array([-np.inf, -3.5, -1e-30, 0.0, 1e-30, 0.25, 0.2500001, 7.0, np.inf],
                      np.float32)
    keys = sortable_keys(values)
    assert list(np.argsort(keys)) == list(range(len(values)))
    assert [value_of(int(k)) for k in keys] == [float(v) for v in values]
    assert sortable_keys(np.array([-0.0], np.float32))[0] == sortable_keys(
        np.array([0.0], np.float32))[0]


@pytest.mark.parametrize("fraction", [1e-9, 0.01, 0.3, 0.5, 0.999, 1.0])
def test_clip_like_scores_over_many_shards(fraction: float) -> None:
    rng = np.random.default_rng(0)
    shards = [rng.normal(0.25, 0.05, size).astype(np.float32)
              for size in rng.integers(0, 5000, 40)]
    shards[3][:50] = shards[3][0]  # ties
    everything = np.concatenate(shards)
    assert kth_largest(over(shards), fraction) == sorted_threshold(everything, fraction)


def test_no_scores() -> None:
    assert kth_largest(over([np.zeros(0, np.float32)]), 0.3) == float("-inf")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.floats(-2, 2, width=32), max_size=30), min_size=1, max_size=6),
       st.floats(0.001, 1.0))
def test_any_shards_any_fraction(parts: list[list[float]], fraction: float) -> None:
    shards = [np.array(p, np.float32) for p in parts]
    assert kth_largest(over(shards), fraction) == sorted_threshold(np.concatenate(shards),
                                                                   fraction)
