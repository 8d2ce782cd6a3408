"""Freeze index sequences: MindSpore's strategy 0 exactly, strategy 1's placement and distribution."""
import numpy as np
import pytest

import recboost as rb


def _mindspore_sequence(groups, strategy, p, steps, seed=0):
    from mindspore.boost import GradientFreeze as MSGradientFreeze
    np.random.seed(seed)
    return np.asarray(MSGradientFreeze(groups, strategy, p, steps).generate_freeze_index_sequence(
        groups, strategy, p, steps), dtype=np.int64)


@pytest.mark.parametrize("groups, p, steps", [(10, 0.7, 1000), (4, 0.5, 333), (7, 0.0, 50), (2, 0.9, 77),
                                              (1, 0.7, 30), (10, 0.7, 65536)])
def test_strategy0_is_mindsporess_sequence(backend, groups, p, steps):
    ours = backend.freeze_index_sequence(groups, 0, p, steps, 123)
    assert ours.dtype == np.int32
    np.testing.assert_array_equal(ours, _mindspore_sequence(groups, 0, p, steps))


@pytest.mark.parametrize("groups, p, steps", [(10, 0.7, 65536), (5, 0.3, 20000), (3, 0.95, 5000)])
def test_strategy1_placement_and_distribution(backend, groups, p, steps):
    ours = backend.freeze_index_sequence(groups, 1, p, steps, 7)
    ms_seq = _mindspore_sequence(groups, 1, p, steps)
    assert len(ours) == len(ms_seq)
    # where the frozen steps fall is deterministic in MindSpore too: identical placement
    np.testing.assert_array_equal(ours != 0, ms_seq != 0)
    frozen = ours[ours != 0]
    assert abs(len(frozen) / len(ours) - (1 - p)) < 2.0 / len(ours) + 1e-3
    # index i drawn with probability (groups - i) / sum(1..groups-1): chi-square test (alpha = 1e-4)
    counts = np.bincount(frozen, minlength=groups)[1:]
    expected = len(frozen) * np.arange(groups - 1, 0, -1) / (groups * (groups - 1) / 2)
    chi2 = ((counts - expected) ** 2 / expected).sum()
    critical = {9: 33.7, 4: 23.5, 2: 18.4}[groups - 1]
    assert chi2 < critical, (counts, expected)
    # and MindSpore's own draws agree with the same law (sanity of the reference)
    ms_counts = np.bincount(ms_seq[ms_seq != 0], minlength=groups)[1:]
    assert ((ms_counts - expected) ** 2 / expected).sum() < critical


def test_seed_matters_and_is_reproducible(backend):
    a = backend.freeze_index_sequence(10, 1, 0.7, 5000, 1)
    assert np.array_equal(a, backend.freeze_index_sequence(10, 1, 0.7, 5000, 1))
    assert not np.array_equal(a, backend.freeze_index_sequence(10, 1, 0.7, 5000, 2))


@pytest.mark.parametrize("args", [(10, 1, 0.7, 65536, 0), (10, 0, 0.7, 1000, 0), (3, 1, 0.25, 999, 2 ** 64 - 1),
                                  (65535, 1, 0.5, 3000, 9), (2, 1, 0.0, 10, 5)])
def test_backends_bit_identical(args):
    if not rb.FAST_BACKEND:
        pytest.skip("compiled backend not built in this run (the fallback run checks the twin alone)")
    fast = rb._backend_kernels("fast")["freeze_index_sequence"](*args)
    py = rb._backend_kernels("py")["freeze_index_sequence"](*args)
    np.testing.assert_array_equal(fast, py)


def test_generate_freeze_index_sequence_method_and_errors(backend):
    freeze = rb.GradientFreeze(10, 1, 0.7, 1000, seed=3)
    seq = freeze.generate_freeze_index_sequence(10, 1, 0.7, 1000)
    np.testing.assert_array_equal(seq, backend.freeze_index_sequence(10, 1, 0.7, 1000, 3))
    with pytest.raises(ValueError, match="'freeze_p' must be a number in \\[0, 1\\)"):
        freeze.generate_freeze_index_sequence(10, 1, 1.0, 1000)
    with pytest.raises(ValueError, match="'freeze_strategy' must be an int <= 1"):
        freeze.generate_freeze_index_sequence(10, 2, 0.5, 1000)
    with pytest.raises(TypeError, match="'total_steps' must be an int"):
        rb.GradientFreeze(10, 1, 0.7, 10.5)
