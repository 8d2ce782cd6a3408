"""A served table's id -> row map (``_ServingMap``) across deltas: a served model's next delta patches
its map (its rows and default row written past every row a map reads) instead of gathering every row
again, until the patch outgrows its share; then the rows are gathered into a new map. Every map, old or
new, patched or not, serves exactly its own state (a plain dict here), and its compacted form is the
layout a full bundle of that state is read into."""
import numpy as np
import pytest

import recboost as rb

DIM = 4
SMAP = rb._ServingMap


def _state(rng, n, low=-5000, high=5000):
    ids = np.unique(rng.integers(low, high, n)).astype(np.int64)
    return ids, rng.standard_normal((ids.size, DIM)).astype(np.float32), rng.standard_normal(DIM).astype(np.float32)


def _delta(rng, owned):
    """``(changed ids, their rows, evicted ids, default row)``: sorted, disjoint, evicted ones owned."""
    evicted = np.sort(rng.choice(owned, min(owned.size, int(rng.integers(0, 40))), replace=False)) \
        if owned.size else np.zeros(0, np.int64)
    changed = np.setdiff1d(np.unique(rng.integers(-6000, 6000, int(rng.integers(0, 80)))), evicted).astype(np.int64)
    return (changed, rng.standard_normal((changed.size, DIM)).astype(np.float32), evicted,
            rng.standard_normal(DIM).astype(np.float32))


def _assert_serves(m, rows, default, rng):
    """``m`` maps every id of ``rows`` (a dict) to its row and any other id to ``default``."""
    asked = np.concatenate([np.array(sorted(rows), np.int64), rng.integers(-7000, 7000, 300)])
    want = np.stack([rows.get(int(i), default) for i in asked])
    assert np.array_equal(m.weight[m.find(asked)], want)
    assert len(m) == len(rows) and np.array_equal(m.holds(asked), [int(i) in rows for i in asked])
    c = m.compacted()
    assert np.array_equal(c.ids, np.array(sorted(rows), np.int64)) and c.capacity == len(rows) + 2
    assert np.array_equal(c.weight[c.find(asked)], want) and not c.patch_ids.size


@pytest.mark.parametrize("seed", range(12))
def test_each_map_of_a_chain_serves_its_own_state(seed, monkeypatch):
    """25 deltas, each merged with room (a served model's) or not, at random; a patch allowed 1-300 ids:
    every map of the chain, checked after the last, serves its own state (nothing it reads was written
    by a later delta), and both kinds happened."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(SMAP, "PATCH_MIN", int(rng.integers(1, 300)))
    ids, rows, default = _state(rng, int(rng.integers(0, 3000)))
    m, state = SMAP.of(ids, rows, default), dict(zip(ids.tolist(), rows))
    chain, patched = [(m, dict(state), default)], 0
    for _ in range(25):
        changed, new_rows, evicted, default = _delta(rng, np.array(sorted(state), np.int64))
        before = m
        m = m.merged(changed, new_rows, evicted, default, room=bool(rng.integers(0, 4)))
        patched += m.weight is before.weight
        for i in evicted.tolist():
            del state[i]
        state.update(zip(changed.tolist(), new_rows))
        chain.append((m, dict(state), default))
    for m, state, default in chain:
        _assert_serves(m, state, default, rng)
    assert 0 < patched < 25


def test_a_delta_merged_again_on_an_older_map_never_writes_under_a_newer_one():
    """A failed apply's map is dropped and the next delta merges on the map served: here two deltas on
    the same patchable map. The second cannot patch (the rows past the first's tip are taken), so it
    gathers a new map, and the first map still serves its state."""
    rng = np.random.default_rng(7)
    ids, rows, default = _state(rng, 2000)
    base = SMAP.of(ids, rows, default).merged(np.zeros(0, np.int64), np.zeros((0, DIM), np.float32),
                                            np.zeros(0, np.int64), default, room=True)
    owned = dict(zip(ids.tolist(), rows))
    results = []
    for _ in range(2):
        changed, new_rows, evicted, new_default = _delta(rng, ids)
        results.append((base.merged(changed, new_rows, evicted, new_default, room=True), changed, new_rows,
                        evicted, new_default))
    assert results[0][0].weight is base.weight and results[1][0].weight is not base.weight
    for m, changed, new_rows, evicted, new_default in results:
        state = {i: r for i, r in owned.items() if i not in set(evicted.tolist())}
        state.update(zip(changed.tolist(), new_rows))
        _assert_serves(m, state, new_default, rng)
    _assert_serves(base, owned, default, rng)


def test_a_patch_that_outgrows_its_share_is_gathered_into_a_new_map(monkeypatch):
    """Patches grow by each delta's ids until they would pass max(ids // PATCH_SHARE, PATCH_MIN); that
    delta gathers every row into a new map with room, whose patch starts empty."""
    monkeypatch.setattr(SMAP, "PATCH_MIN", 100)
    rng = np.random.default_rng(3)
    ids, rows, default = _state(rng, 800, 0, 800)
    m = SMAP.of(ids, rows, default)
    sizes = []
    for k in range(8):
        changed = np.arange(10_000 + 30 * k, 10_000 + 30 * (k + 1), dtype=np.int64)
        m = m.merged(changed, np.ones((30, DIM), np.float32), np.zeros(0, np.int64), default, room=True)
        sizes.append(int(m.patch_ids.size))
    assert sizes == [0, 30, 60, 90, 0, 30, 60, 90]
