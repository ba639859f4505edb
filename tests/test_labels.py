"""t2i/i2t assignment: the image-token share and its prefix bound, as properties."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pairforge.shards.labels import (
    I2T,
    IMG,
    T2I,
    assign_tasks,
    i2t_rate,
    share_report,
    start_offset,
)

P_DROPS = st.sampled_from([0.0, 0.05, 0.1, 0.25, 0.5, 0.9, 1.0])


def _tokens(draw, n: int, variable: bool) -> list[int]:
    if variable:  # variable-resolution tokenizers: counts differ per image
        return draw(st.lists(st.integers(16, 4096), min_size=n, max_size=n))
    return [draw(st.sampled_from([64, 256, 576, 1024]))] * n


@st.composite
def shards(draw):
    n = draw(st.integers(1, 400))
    return _tokens(draw, n, draw(st.booleans())), draw(P_DROPS), draw(st.integers(0, 10**6))


@settings(max_examples=300, deadline=None)
@given(shards())
def test_share_and_prefix_bound(case):
    tokens, p_drop, seed = case
    labels = assign_tasks(tokens, [True] * len(tokens), p_drop, start_offset(seed, 3))
    report = share_report(tokens, labels, p_drop)
    # at every prefix, within one image's tokens of the target (half from the rule, up to
    # half from the seeded start offset)
    assert report.max_prefix_deviation <= report.max_image_tokens + 1e-6
    assert abs(report.realized - p_drop) * sum(tokens) <= max(tokens) + 1e-6
    unseeded = share_report(tokens, assign_tasks(tokens, [True] * len(tokens), p_drop), p_drop)
    assert unseeded.max_prefix_deviation <= max(tokens) / 2 + 1e-6
    assert set(labels) <= {T2I, I2T}
    if p_drop == 0:
        assert labels == [T2I] * len(tokens)
    if p_drop == 1:
        assert labels == [I2T] * len(tokens)


@settings(max_examples=100, deadline=None)
@given(shards(), st.floats(0.0, 0.5))
def test_img_samples_count_as_unconditional(case, img_rate):
    tokens, p_drop, seed = case
    rng = np.random.default_rng(seed)
    captioned = (rng.random(len(tokens)) >= img_rate).tolist()
    labels = assign_tasks(tokens, captioned, p_drop, start_offset(seed, 0))
    assert [lab == IMG for lab in labels] == [not c for c in captioned]
    img_share = sum(t for t, c in zip(tokens, captioned, strict=True) if not c) / sum(tokens)
    report = share_report(tokens, labels, p_drop)
    # img tokens fill the unconditional budget first; i2t tops it up to the target
    expected = max(p_drop, img_share)
    assert report.realized == pytest.approx(expected, abs=max(tokens) / sum(tokens) + 1e-9)
    # and among captioned samples the i2t share is smooth at every prefix
    cap_tokens = [t for t, c in zip(tokens, captioned, strict=True) if c]
    cap_labels = [lab for lab, c in zip(labels, captioned, strict=True) if c]
    if cap_tokens:
        rate = i2t_rate(np.asarray(tokens), np.asarray(captioned), p_drop)
        inner = share_report(cap_tokens, cap_labels, rate)
        assert inner.max_prefix_deviation <= max(cap_tokens) + 1e-6


def test_interleaved_not_staged():
    labels = assign_tasks([256] * 100, [True] * 100, 0.1)
    positions = [i for i, lab in enumerate(labels) if lab == I2T]
    assert len(positions) == 10
    assert max(np.diff(positions)) <= 10  # one i2t about every tenth sample


def test_independent_of_worker_count():
    rng = np.random.default_rng(0)
    shards_ = [rng.integers(16, 2048, size=200).tolist() for _ in range(12)]

    def label(shard_id):
        return assign_tasks(shards_[shard_id], [True] * 200, 0.3, start_offset(7, shard_id))

    serial = [label(i) for i in range(12)]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(label, range(12)))
    assert serial == parallel
    assert start_offset(7, 1) != start_offset(7, 2) and -0.5 <= start_offset(7, 1) < 0.5


def test_p_drop_out_of_range():
    with pytest.raises(ValueError, match="p_drop"):
        assign_tasks([1], [True], 1.5)
