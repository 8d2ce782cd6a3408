"""Throwaway (reverted): a new cache setting, admit_limit, reaches the cache from a TableConfig."""
import numpy as np
import pytest

import recboost


def test_a_new_cache_setting_flows_from_the_config(backend):
    config = recboost.TableConfig(4, 64, admit_limit=2)
    cache = config.new_cache()
    assert cache.admit_limit == 2
    rows = cache.lookup(np.arange(10, 15))
    assert np.count_nonzero(rows) == 2                           # only 2 admitted
    assert recboost.HashCache(64).admit_limit == -1
    table = recboost.HashEmbedding(config)
    assert table.settings()["admit_limit"] == 2 and table.cache.admit_limit == 2
    state = table.state_dict()
    assert state["cache"]["admit_limit"] == 2
    again = recboost.HashEmbedding(4, 64, admit_limit=2)
    again.load_state_dict(state)
    with pytest.raises(ValueError, match="'admit_limit'"):
        recboost.TableConfig(4, 64, admit_limit=-3)
    with pytest.raises(ValueError, match="admit_limit"):
        recboost.HashEmbedding(4, 64).load_state_dict(state)
