"""eviction_policy="score" (``Score``): scores from labels, decay, lowest-score replacement and
admission by score, against a plain reference; compiled-vs-twin parity; state round trips; errors."""
import math

import numpy as np
import pytest

import recboost

from test_hash_cache import mix64    # the bucket hash, written independently of recboost._mix64
UNIT = 65536          # documented: scores are held in 1/65536 of a point



class RefScoreTable:
    """The documented policy on dicts, for batches of distinct ids: each id's score (fixed point) halves
    once per whole half-life since it was last seen, then grows by the click or non-click weight; an id
    without a row gets one in a batch whose score before that batch (decayed to now, before the batch's
    own weights) exceeds admit_score: the lowest free row, else (a full table)
    the row of the id its bucket of 32 rows ranks lowest (score decayed to now, then last seen, then row),
    never an id seen in this batch. A replaced id is forgotten."""

    def __init__(self, capacity, half_life, click_weight, nonclick_weight, admit_score):
        self.capacity, self.half_life = capacity, half_life
        self.units = (int(round(nonclick_weight * UNIT)), int(round(click_weight * UNIT)))
        self.t = -1 if admit_score < 0 else math.floor(admit_score * UNIT)
        self.score, self.last, self.row = {}, {}, {}
        self.owner = {}                        # row -> id
        self.next_row = 2

    def decayed(self, key, now):
        periods = max(now - self.last[key], 0) // self.half_life
        return 0 if periods >= 63 else self.score[key] >> periods

    def lookup(self, ids, labels, now):
        replaced, before = [], {}
        for key, label in zip(ids, labels):
            if key in self.score:
                self.score[key] = self.decayed(key, now)
            else:
                self.score[key] = 0
            before[key] = self.score[key]
            if label is not None:
                self.score[key] += self.units[int(label)]
            self.last[key] = now
        for key in ids:
            if key in self.row or before[key] <= self.t:
                continue
            if self.next_row < self.capacity:
                self.row[key], self.owner[self.next_row] = self.next_row, key
                self.next_row += 1
                continue
            nb = -(-(self.capacity - 2) // 32)
            lo = 2 + ((mix64(key) >> 32) * nb >> 32) * 32
            options = [(self.decayed(self.owner[r], now), self.last[self.owner[r]], r)
                       for r in range(lo, min(lo + 32, self.capacity)) if self.last[self.owner[r]] != now]
            if not options:
                continue
            _, _, r = min(options)
            gone = self.owner[r]
            replaced.append((gone, r))
            for d in (self.score, self.last, self.row):
                del d[gone]
            self.row[key], self.owner[r] = r, key
        return [self.row.get(k, 0) for k in ids], replaced


@pytest.mark.parametrize("admit_score", [-1.0, 0.25])
def test_choices_match_a_plain_reference(backend, admit_score):
    """A stream of 300 ids with per-id click rates through a table of 64 rows (two buckets): the rows
    handed out, the ids replaced and every score agree with the reference, batch by batch; some
    batches come without labels (they move no score)."""
    rng = np.random.default_rng(11)
    settings = dict(half_life=5, click_weight=1.5, nonclick_weight=0.1, admit_score=admit_score)
    cache = recboost.HashCache(66, eviction=recboost.Score(**settings))
    ref = RefScoreTable(66, **settings)
    rate = rng.uniform(0, 0.6, 300)
    now, replaced = 0, 0
    for step in range(120):
        now += int(rng.integers(0, 3))
        ids = rng.choice(300, size=int(rng.integers(5, 30)), replace=False, p=np.arange(300, 0, -1) / 45150)
        labels = (rng.random(ids.size) < rate[ids]).astype(np.int64)
        given = None if step % 9 == 4 else labels
        rows = cache.lookup(ids, timestamp=now, labels=given)
        want_rows, want_replaced = ref.lookup(ids.tolist(), [None] * ids.size if given is None else labels, now)
        np.testing.assert_array_equal(rows, want_rows)
        got_ids, got_rows = cache.take_replaced()
        assert list(zip(got_ids.tolist(), got_rows.tolist())) == want_replaced
        replaced += len(want_replaced)
        keys = np.array(sorted(ref.score), np.int64)
        np.testing.assert_array_equal(cache.counts(keys), [ref.score[k] for k in keys.tolist()])
    np.testing.assert_array_equal(cache.scores(keys), [ref.score[k] / UNIT for k in keys.tolist()])
    assert replaced > 30 and cache.stats()["replaced"] == replaced
    if admit_score > 0:
        assert cache.stats()["rejected"] > 0


def test_a_score_by_hand(backend):
    """Worked by hand: weights 1 (click) and 0.25 (no click), half-life 10 steps."""
    c = recboost.HashCache(8, eviction=recboost.Score(half_life=10, click_weight=1, nonclick_weight=0.25))
    c.lookup([[5, 6], [5, 7]], labels=[[1, 1], [0, 0]], timestamp=0)
    np.testing.assert_array_equal(c.scores([5, 6, 7, 8]), [1.25, 1.0, 0.25, 0.0])
    c.lookup([5], labels=[0], timestamp=25)        # two half-lives: 1.25 / 4 + 0.25
    assert c.scores([5])[0] == 1.25 / 4 + 0.25
    c.lookup([6, 6], timestamp=25)                 # no labels: 6's score is as it was (decayed: 0.25)
    assert c.scores([6])[0] == 0.25
    assert c.counts([6])[0] == UNIT // 4


def test_admission_by_score_waits_for_the_score(backend):
    """admit_score 1, on the score before each lookup: an id shown without clicks (0.5 each) gets its
    row at its fourth show (before its third its score is 1.0, not above 1); a click (2) gets the id
    its row at its next lookup; without labels nothing is admitted."""
    c = recboost.HashCache(10, eviction=recboost.Score(click_weight=2, nonclick_weight=0.5, admit_score=1))
    assert c.lookup([3], labels=[0], timestamp=0)[0] == 0
    assert c.lookup([3, 4], labels=[0, 1], timestamp=1).tolist() == [0, 0]
    assert c.lookup([3, 4], labels=[0, 0], timestamp=2).tolist() == [0, 2]
    assert c.lookup([3], labels=[0], timestamp=3)[0] == 3
    assert c.lookup([9, 9, 9], timestamp=4).tolist() == [0, 0, 0]
    assert c.stats()["rejected"] == 7 and len(c) == 2


#: one batch of ids with repeats (below) and three labellings of it
BATCH = np.array([5, 1, 2, 5, 3, 1, 6, 2])
LABELLINGS = {"zeros": np.zeros(8, np.int64), "ones": np.ones(8, np.int64),
              "mixed": np.array([0, 0, 1, 0, 0, 1, 1, 0])}


@pytest.mark.parametrize("labels, then", [("zeros", [0, 0, 3]), ("ones", [3, 4, 5]), ("mixed", [3, 0, 4])])
def test_admission_by_score_reads_no_label_of_its_own_lookup(backend, labels, then):
    """admit_score 0.5 (a click 1, a show 0.25): from one state, a batch with repeated ids gets the same
    rows and the same statistics whatever its labels, all 0, all 1 or mixed: only id 1, whose score
    before the batch is 1.0, gets a row (2, at each of its elements); id 2's 0.5 is not above 0.5. The
    labels move the scores, so they decide the rows of the next lookup: ids 6, 5 and 2 get theirs there
    where this batch's labels lifted them above 0.5."""
    settings = recboost.Score(click_weight=1, nonclick_weight=0.25, admit_score=0.5)
    warm = recboost.HashCache(10, eviction=settings)
    assert warm.lookup([1, 2, 2, 3], labels=[1, 0, 0, 0], timestamp=0).tolist() == [0, 0, 0, 0]
    c = recboost.HashCache(10, eviction=settings)
    c.load_state_dict(warm.state_dict())
    assert c.lookup(BATCH, labels=LABELLINGS[labels], timestamp=1).tolist() == [0, 2, 0, 0, 0, 2, 0, 0]
    stats = c.stats()
    assert (stats["admitted"], stats["rejected"], stats["overflowed"], len(c)) == (1, 4 + 6, 0, 1)
    # scores now (zeros / ones / mixed): 6 0.25 / 1 / 1; 5 0.5 / 2 / 0.5; 2 1.0 / 2.5 / 1.75
    assert c.lookup([6, 5, 2], timestamp=2).tolist() == then


@pytest.mark.parametrize("labels", sorted(LABELLINGS))
def test_admission_by_score_in_a_full_table_reads_no_label_of_its_own_lookup(backend, labels):
    """The same batch into a full table (capacity 4: rows 2 and 3, held by ids 7 and 8, score 1.0 each):
    whatever the labels, id 1 (1.0 before the batch) takes 7's row (the lowest score, then the lowest
    row) at each of its elements, and every other element reads row 0."""
    settings = recboost.Score(click_weight=1, nonclick_weight=0.25, admit_score=0.5)
    warm = recboost.HashCache(4, eviction=settings)
    assert warm.lookup([7, 8, 1, 2, 2, 3], labels=[1, 1, 1, 0, 0, 0], timestamp=0).tolist() == [0] * 6
    assert warm.lookup([7, 8], timestamp=1).tolist() == [2, 3]
    c = recboost.HashCache(4, eviction=settings)
    c.load_state_dict(warm.state_dict())
    assert c.lookup(BATCH, labels=LABELLINGS[labels], timestamp=2).tolist() == [0, 2, 0, 0, 0, 2, 0, 0]
    assert [a.tolist() for a in c.take_replaced()] == [[7], [2]]
    stats = c.stats()
    assert (stats["admitted"], stats["replaced"], stats["rejected"], stats["overflowed"]) == (3, 1, 6 + 6, 0)


def _both(*args, **kwargs):
    from test_hash_cache import _both_backends      # the compiled and the twin kernel behind HashCache's checks
    return _both_backends(*args, **kwargs)


@pytest.mark.parametrize("counter", ["exact", "sketch"])
def test_compiled_and_twin_agree_bit_for_bit(counter):
    """Both backends on one stream with repeated ids in a batch, max_admit, label-less batches, admission
    by score and a full table: the same rows, replacements, counts, states, and after a state moves
    from one backend to the other, the same continuation."""
    if not recboost.FAST_BACKEND:
        pytest.skip("compiled-vs-twin parity needs the compiled backend; the reference test covers the twin")
    sketch = dict(admission=recboost.Sketch(width=2048, depth=3, window=500)) if counter == "sketch" else {}
    caches = _both(100, eviction=recboost.Score(half_life=3, click_weight=1.0, nonclick_weight=0.3,
                                                admit_score=0.5), eviction_threshold=20, **sketch)
    rng = np.random.default_rng(5)
    for step in range(60):
        ids = rng.zipf(1.3, size=(40, 3)) % 5000 + step // 10 * 3000
        labels = rng.random((40, 1)) < 0.2
        labels = None if step % 7 == 3 else np.repeat(labels, 3, axis=1)
        limit = 5 if step % 5 == 2 else -1
        rows = {b: c.lookup(ids, timestamp=step, max_admit=limit, labels=labels) for b, c in caches.items()}
        np.testing.assert_array_equal(rows["py"], rows["fast"])
        for got, want in zip(caches["fast"].take_replaced(), caches["py"].take_replaced()):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(caches["py"].counts(ids), caches["fast"].counts(ids))
        if step % 11 == 10:
            for got, want in zip(caches["fast"].evict(), caches["py"].evict()):
                np.testing.assert_array_equal(got, want)
        if step == 30:                  # each resumes from the other's state
            states = {b: c.state_dict() for b, c in caches.items()}
            caches["py"].load_state_dict(states["fast"])
            caches["fast"].load_state_dict(states["py"])
    a, b = caches["py"].state_dict(), caches["fast"].state_dict()
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert a["replaced"] > 20 and a["rejected"] > 0 and a["eviction_policy"] == "score"
    assert (a["score_click_weight"], a["score_nonclick_weight"], a["admit_score"]) == (1.0, 0.3, 0.5)


def test_the_settings_round_trip_through_a_state(backend):
    c = recboost.HashCache(50, eviction=recboost.Score(half_life=7, click_weight=3, nonclick_weight=0, admit_score=2))
    c.lookup([1, 2, 3], labels=[1, 0, 1], timestamp=4)
    d = recboost.HashCache(50)
    d.load_state_dict(c.state_dict())
    assert d.eviction == recboost.Score(half_life=7, click_weight=3.0, nonclick_weight=0.0, admit_score=2.0)
    assert d.eviction_policy == "score" and d.score_half_life == 7
    assert d.lookup([1, 2, 3], labels=[0, 0, 0], timestamp=4).tolist() == [2, 0, 3]
    # a state saved before the score policy (no score keys) loads with its defaults
    old = recboost.HashCache(50, eviction=recboost.LFU(half_life=9)).state_dict()
    for key in ("score_half_life", "score_click_weight", "score_nonclick_weight", "admit_score"):
        del old[key]
    d.load_state_dict(old)
    assert d.eviction == recboost.LFU(half_life=9) and d.admit_score == -1.0


@pytest.mark.parametrize("saved, loaded", [("score", "lru"), ("score", None), ("lfu", "score"), (None, "score")])
def test_a_state_loads_between_the_score_policy_and_another_not_even_with_strict_false(backend, saved, loaded):
    """A "score" table's counts are decayed click scores in fixed point, another table's are counts of
    sightings: a state of the one in a table of the other would admit and replace by the wrong numbers (a
    score of 0.1 reads as 6554 sightings). strict=False goes on with the table's other settings, but this
    one is refused all the same, naming it, and the table is unchanged."""
    from _faults import differences, table_snapshot
    policy = lambda name: dict(eviction=recboost.Score(admit_score=0.5)) if name == "score" else \
        dict(eviction_policy=name, access_threshold=5, admission_counter="exact")
    source = recboost.HashEmbedding(4, 40, **policy(saved))
    source.prepare(np.array([42, 43]), **(dict(labels=np.array([0, 1])) if saved == "score" else {}))
    table = recboost.HashEmbedding(4, 40, **policy(loaded))
    before = table_snapshot(table)
    with pytest.raises(ValueError, match=r"the setting '.*' of hash table '.*' must be .* as the state was trained "
                                         r"with \(to go on with this table's, load with strict=False\)"):
        table.load_state_dict(source.state_dict())
    assert not differences(table_snapshot(table), before)
    with pytest.raises(ValueError, match=r"the setting 'eviction_policy' of hash table '.*' must be %r as the state was "
                                         r"trained with \(a 'score' table's counts are decayed click scores, .*: not "
                                         r"even strict=False converts them\), but got %r" % (saved, loaded)):
        table.load_state_dict(source.state_dict(), strict=False)
    assert not differences(table_snapshot(table), before)


def test_flat_keywords_and_sub_config_are_one_setting():
    flat = recboost.HashCache(40, eviction_policy="score", score_half_life=8, score_click_weight=2.0,
                              admit_score=0.5)
    assert flat.eviction == recboost.Score(half_life=8, click_weight=2.0, admit_score=0.5)


@pytest.mark.parametrize("kwargs, name, expected", [
    (dict(eviction=recboost.LFU(), admit_score=1.0), "admit_score", "None with eviction_policy='lfu'"),
    (dict(admit_score=1.0), "admit_score", "None with eviction_policy=None"),
    (dict(eviction_policy="lru", score_click_weight=2.0), "score_click_weight", "None with eviction_policy='lru'"),
    (dict(eviction_policy="score", access_threshold=3), "access_threshold", "-1 with eviction_policy='score'"),
    (dict(eviction_policy="score", grow=True), "grow", "False with an eviction_policy"),
])
def test_settings_that_do_not_go_together_are_refused(kwargs, name, expected):
    with pytest.raises((ValueError, TypeError)) as info:
        recboost.HashCache(40, **kwargs)
    assert name in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize("field, value, expected, exc", [
    ("click_weight", -1.0, "a finite number in [0, 1024]", ValueError),
    ("nonclick_weight", float("nan"), "a finite number in [0, 1024]", ValueError),
    ("click_weight", float("inf"), "a finite number in [0, 1024]", ValueError),
    ("click_weight", True, "a finite number in [0, 1024]", TypeError),
    ("half_life", 0, "an int >= 1", ValueError),
    ("half_life", 2.5, "an int", TypeError),
    ("admit_score", -0.5, "-1 (off) or a finite number in [0,", ValueError),
    ("admit_score", float("nan"), "-1 (off) or a finite number in [0,", ValueError),
])
def test_bad_settings_name_the_field_expected_and_given(field, value, expected, exc):
    with pytest.raises(exc) as info:
        recboost.Score(**{field: value})
    text = str(info.value)
    assert "Score" in text and field in text and expected in text and repr(value)[:3] in text


@pytest.mark.parametrize("labels, expected, given", [
    ([0, 2, 1], "0 or 1 each", "1 other values, e.g. 2"),
    ([0.5, 1.0, 0.0], "0 or 1 each", "e.g. 0.5"),
    ([1, 0], "the shape of the ids (3,)", "shape (2,)"),
    (["a", "b", "c"], "an array of 0s and 1s", "dtype <U1"),
])
def test_bad_labels_are_refused(backend, labels, expected, given):
    c = recboost.HashCache(10, eviction=recboost.Score())
    with pytest.raises((ValueError, TypeError)) as info:
        c.lookup([1, 2, 3], labels=labels)
    assert "'labels'" in str(info.value) and expected in str(info.value) and given in str(info.value)
    assert c.step == 0 and len(c) == 0                       # nothing changed


def test_labels_only_with_the_score_policy(backend):
    c = recboost.HashCache(10, eviction=recboost.LFU())
    with pytest.raises(ValueError, match="'labels'.*only a table with eviction_policy='score'.*'lfu'"):
        c.lookup([1], labels=[1])
    with pytest.raises(ValueError, match="eviction_policy.*'score'.*'lfu'"):
        c.scores([1])


def test_mx_rec_show_click_params_map_where_the_meaning_matches():
    """mx_rec's score alpha * shows + beta * clicks: nonclick_weight alpha, click_weight alpha + beta; its
    admit_threshold (0: off) is admit_score; evict_percentage and score_decay are refused by name."""
    s = recboost.Score.from_show_click(alpha=0.5, beta=2.0, admit_threshold=3.0, half_life=60)
    assert s == recboost.Score(half_life=60, click_weight=2.5, nonclick_weight=0.5, admit_score=3.0)
    assert recboost.Score.from_show_click().admit_score == -1.0
    with pytest.raises(ValueError, match="'evict_percentage'.*0.0.*given 0.1|'evict_percentage'.*0.1"):
        recboost.Score.from_show_click(evict_percentage=0.1)
    with pytest.raises(ValueError, match="'score_decay'.*half_life="):
        recboost.Score.from_show_click(score_decay=0.9)
    with pytest.raises(ValueError, match="'alpha'"):
        recboost.Score.from_show_click(alpha=-1)


def test_a_table_takes_its_samples_labels_for_each_id(backend):
    """HashEmbedding.prepare with labels: each id of a sample (multi-hot, ragged, padding dropped) is a
    show of that sample, a click where its label is 1; evaluation (is_train False) and a step without
    labels move no score."""
    pad = -1
    table = recboost.HashEmbedding(4, 40, combiner="sum", padding_id=pad,
                                   eviction=recboost.Score(click_weight=1.0, nonclick_weight=0.25))
    table.prepare(np.array([[7, 8, pad], [7, 9, 9]]), labels=np.array([1, 0]))
    np.testing.assert_array_equal(table.cache.scores([7, 8, 9]), [1.25, 1.0, 0.5])
    table.prepare((np.array([8, 9, 9, 7]), np.array([0, 1, 4])), labels=np.array([[0], [1]]))
    np.testing.assert_array_equal(table.cache.scores([7, 8, 9]), [2.25, 1.25, 2.5])
    table.prepare(np.array([[7, 7, 7]]), is_train=False, labels=np.array([1]))
    table.prepare(np.array([[7, 7, 7]]))
    np.testing.assert_array_equal(table.cache.scores([7]), [2.25])
    with pytest.raises(ValueError, match="labels of table .* one per sample: 2.*3 labels"):
        table.prepare(np.array([[7, 8, 9], [1, 2, 3]]), labels=np.array([1, 0, 1]))
    with pytest.raises(ValueError, match="'labels' must be 0 or 1 each"):
        table.prepare(np.array([[7, 8, 9]]), labels=np.array([2]))


@pytest.mark.parametrize("sharding", ["data_parallel", "row_wise"])
def test_a_score_table_across_ranks_scores_as_in_one_process(backend, sharding):
    """A "score" table laid out data-parallel or row-wise, over a world of one rank: its step's labels
    travel with its ids through the exchange (``share_ids``, a byte an id), and its scores, admissions
    by score, replacements and rows stay those of the same table in one process, bit for bit."""
    from test_hash_embedding import TableIds, _OneRank
    make = lambda: recboost.HashEmbedding(4, 2 + 24, eviction_policy="score", admit_score=0.5, score_half_life=4,
                                          score_click_weight=2.0, seed=4, name="t", optimizer=recboost.SparseSGD(0.1))
    local, laid, ex = make(), make(), _OneRank()
    laid.set_layout(sharding, 0, 1, ex)
    rng = np.random.default_rng(6)
    for step in range(12):
        ids, labels = rng.integers(0, 60, (16, 2)), rng.integers(0, 2, 16)
        want = local.prepare(ids, timestamp=step, labels=labels)
        parts = laid.check_features([ids])
        entries = [TableIds(step, [p.ids for p in parts], [np.repeat(labels, 2).astype(np.uint8)])]
        shared, = ex.share_ids(ex.share_headers(0, [1], entries), entries)
        np.testing.assert_array_equal(shared.labels, np.repeat(labels, 2))
        batch = laid.prepare_step(parts, shared.time, True, (), shared)
        grad = rng.normal(size=(16, 2, 4)).astype(np.float32)
        for table, b in ((local, want), (laid, batch)):
            table.take(b)
            table.gather(b)
            table.apply_gradients(b, grad)
    every = np.arange(60)
    stats = local.cache.stats()
    assert stats == laid.cache.stats() and stats["replaced"] > 0 and stats["rejected"] > 0
    np.testing.assert_array_equal(local.cache.scores(every), laid.cache.scores(every))
    np.testing.assert_array_equal(local.cache.find(every), laid.cache.find(every))
    held = local.cache.find(every) >= 2
    np.testing.assert_array_equal(local.weight[local.cache.find(every[held])], laid.weight[laid.cache.find(every[held])])
