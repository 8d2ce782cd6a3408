"""RecModel with hash tables: translation on the prefetch thread, eviction in stream order, growth,
and exact resume of everything (dense state, tables, slots, caches, eviction schedule)."""
import threading
import time

import numpy as np
import pytest
import mindspore as ms
from mindspore import nn

import recboost as rb
from _stopping import StopAfter     # (a stop leaves the prefetch depth prepared: compared runs match)

pytestmark = pytest.mark.fallback       # also on make test's numpy-fallback run (pytest.ini)

BATCH, FIELDS, DENSE, DIM = 128, 6, 4, 8


def _stream(seed=0, **kw):
    stream = rb.SyntheticClickStream(seed=seed, num_dense=DENSE, num_sparse=FIELDS, vocab_sizes=[300] * FIELDS,
                                     batch_size=BATCH, drift=20000.0, with_timestamp=True,
                                     rows_per_second=64, **kw)
    for dense, ids, label, ts in stream:
        yield {"dense": dense, "ids": ids, "label": label, "timestamp": ts}


SKETCH = dict(admission_counter="sketch", sketch_width=512, sketch_depth=3, sketch_window=300)


def _model(capacity=64, access=1, evict=8, grow=True, seed=0, policy=None, optimizer=None, row_dtype="float32",
           admission=None, metrics=None):
    ms.set_seed(seed)
    table = rb.HashEmbedding(DIM + 1, capacity, access_threshold=access, eviction_threshold=evict,
                             use_dynamic_expansion=grow and policy is None, max_unique=BATCH * FIELDS + 1,
                             input_index=1, seed=seed, name="ids", optimizer=optimizer or rb.SparseAdam(0.01),
                             eviction_policy=policy, row_dtype=row_dtype, **({"lfu_half_life": 3} if policy == "lfu" else {}),
                             **(admission or {}))
    net = rb.WideDeep(DENSE, FIELDS, DIM, (16,), embedding=table)
    return table, rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01),
                              metrics=metrics)


_StopAt = StopAfter         # request_stop() once the step count is reached


def _snapshot(table, model):
    state = table.state_dict()
    out = {"table": state["table"], **{"slot:" + k: v for k, v in state["slots"].items()},
           **{"cache:" + k: np.asarray(v) for k, v in state["cache"].items()}}
    out.update({"dense:" + p.name: p.asnumpy() for p in model.state_parameters()})
    return out


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_online_train_with_admission_eviction_and_growth(graph_mode):
    table, model = _model()
    hook = rb.EvictHook(evict_time_interval=4)
    model.online_train(_stream(), callbacks=[hook, _StopAt(2)], dataset_sink_mode=False)
    cell, capacity = model.train_network, table.capacity
    compiled = set(cell.compile_cache) if hasattr(cell, "compile_cache") else None
    assert compiled is None or compiled                                     # one graph, compiled
    model.online_train(_stream(seed=1), callbacks=[hook, _StopAt(30)], dataset_sink_mode=False)
    assert model.train_network is cell and table.capacity > capacity        # grew, same train cell
    if compiled is not None:
        assert cell.compile_cache == compiled                                # and no new graph
    stats = table.cache.stats()
    assert model.step == 30
    assert stats["admitted"] > 0 and stats["rejected"] > 0          # admission at work
    assert stats["evicted"] > 0 and hook.evictions > 0              # eviction ran in stream order
    assert stats["grown"] >= 1 and table.capacity == table.cache.capacity > 64     # growth
    assert len(table.cache) <= table.capacity


@pytest.mark.slow
@pytest.mark.parametrize("policy, variant", [(None, None), ("lru", None), ("lfu", None), (None, "rowwise"),
                                             (None, "bfloat16"), (None, "sketch"), ("lru", "sketch"), (None, "schedule")],
                         ids=["none", "lru", "lfu", "rowwise_adagrad", "bfloat16_rows", "sketch", "lru_sketch",
                              "lr_schedule"])
def test_resume_with_tables_is_exact(graph_mode, tmp_path, policy, variant):
    """A run stopped at a checkpoint and resumed from it in a new model ends as the run that never
    stopped, bit for bit: with growth, or with a full table replacing ids by its policy; with Adam's
    slots, or row-wise Adagrad's one value per row; with bfloat16 rows (the stochastic rounding's
    counter is in the checkpoint); with the exact admission counter or the sketch (its counters and
    aging in the checkpoint); with a learning-rate schedule, a clip and decay (the table's step is in
    the checkpoint)."""
    config = {"capacity": 130, "policy": policy} if policy else {}
    if variant == "rowwise":
        config["optimizer"] = rb.SparseRowWiseAdagrad(0.05)
    if variant == "bfloat16":
        config["row_dtype"] = "bfloat16"
    if variant == "schedule":
        config["optimizer"] = rb.SparseAdam(nn.ExponentialDecayLR(0.05, 0.8, 2), clip_norm=0.05, weight_decay=0.01,
                                            decoupled_weight_decay=0.1)
    if variant == "sketch":
        config["admission"] = SKETCH
    elif policy:
        config["admission"] = {"admission_counter": "exact"}     # the policy with the exact counter
    table_a, model_a = _model(**config)
    model_a.online_train(_stream(), callbacks=[rb.EvictHook(evict_time_interval=4), StopAfter(24)],
                         dataset_sink_mode=False)
    table_b, model_b = _model(**config)
    ckpt = rb.OnlineCheckpoint(tmp_path, every_steps=5, keep=1, save_on_end=False)
    model_b.online_train(_stream(), callbacks=[rb.EvictHook(evict_time_interval=4), ckpt, _StopAt(13)],
                         dataset_sink_mode=False)
    assert rb.latest_checkpoint(str(tmp_path)).endswith("recboost-10.npz")
    table_c, model_c = _model(seed=7, **config)        # different seed: all state must come from the file
    model_c.online_train(_stream(), callbacks=[rb.EvictHook(evict_time_interval=4), StopAfter(24)],
                         dataset_sink_mode=False, resume_from=str(tmp_path))
    assert model_c.step == 24
    assert table_c.cache.stats() == table_a.cache.stats()
    assert table_a.cache.stats()["grown" if policy is None else "replaced"] > 0
    if variant == "sketch":
        assert table_a.cache.stats()["aged"] > 0 and table_a.cache.stats()["candidates"] == 0
    _assert_same(_snapshot(table_a, model_a), _snapshot(table_c, model_c))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_checkpoint_of_another_eviction_policy_is_refused(graph_mode, tmp_path, policy):
    """A checkpoint of a table without a policy does not load into a table with one, unless
    strict=False, which goes on with the table's own policy."""
    table, model = _model(capacity=130, grow=False)
    model.online_train(_stream(), callbacks=_StopAt(3), dataset_sink_mode=False)
    path = model.save_checkpoint(str(tmp_path / "recboost-3.npz"))
    other_table, other = _model(capacity=130, policy=policy)
    with pytest.raises(ValueError, match=r"the setting 'eviction_policy' of hash table 'ids' must be None as the "
                                         r"state was trained with .*, but got %r\.$" % policy):
        other.load_checkpoint(path)
    assert len(other_table.cache) == 0
    other.load_checkpoint(path, strict=False)
    assert other_table.cache.eviction_policy == policy and len(other_table.cache) == len(table.cache)


def test_checkpoint_of_another_admission_counter(graph_mode, tmp_path):
    """A checkpoint of a table with the exact counter does not load into one with a sketch (nor the
    reverse), naming the setting; strict=False goes on with the table's sketch, its candidates'
    counts moved into it (the sketch's counts are upper bounds of theirs), its rows as they were."""
    table, model = _model(capacity=130, grow=False)
    model.online_train(_stream(), callbacks=_StopAt(3), dataset_sink_mode=False)
    path = model.save_checkpoint(str(tmp_path / "recboost-3.npz"))
    state = table.cache.state_dict()
    cand = state["rows"] < 0
    assert cand.sum() > 50
    other_table, other = _model(capacity=130, grow=False, admission=SKETCH)
    with pytest.raises(ValueError, match=r"the setting 'admission_counter' of hash table 'ids' must be 'exact' as "
                                         r"the state was trained with .*, but got 'sketch'\.$"):
        other.load_checkpoint(path)
    assert len(other_table.cache) == 0
    other.load_checkpoint(path, strict=False)
    stats = other_table.cache.stats()
    assert other_table.cache.admission_counter == "sketch" and stats["candidates"] == 0
    assert stats["size"] == len(table.cache) and stats["admitted"] == table.cache.stats()["admitted"]
    np.testing.assert_array_equal(other_table.cache.find(state["keys"]), table.cache.find(state["keys"]))
    assert (other_table.cache.counts(state["keys"][cand]) >= state["counts"][cand]).all()
    other_path = other.save_checkpoint(str(tmp_path / "recboost-sketch.npz"))
    with pytest.raises(ValueError, match=r"the setting 'admission_counter' of hash table 'ids' must be 'sketch'"):
        _model(capacity=130, grow=False)[1].load_checkpoint(other_path)


def test_checkpoint_of_another_table_config_is_refused(graph_mode, tmp_path):
    table, model = _model()
    model.online_train(_stream(), callbacks=_StopAt(3), dataset_sink_mode=False)
    path = model.save_checkpoint(str(tmp_path / "recboost-3.npz"))
    ms.set_seed(0)
    other_table = rb.HashEmbedding(DIM + 2, 64, max_unique=BATCH * FIELDS + 1, input_index=1, name="ids")
    other = rb.RecModel(rb.WideDeep(DENSE, FIELDS, DIM + 1, (16,), embedding=other_table), nn.BCEWithLogitsLoss(),
                        nn.Adam(rb.WideDeep(DENSE, FIELDS, DIM + 1, (16,), embedding=other_table).trainable_params()))
    before = other_table.weight.copy()
    with pytest.raises(ValueError, match=r"recboost-3.npz' has a bad state for hash table 0 'ids' "
                                         r"\(field 'tables\[0\]'\): .*state\['embedding_size'\]' must be 10, but got 9\.$"):
        other.load_checkpoint(path)
    np.testing.assert_array_equal(before, other_table.weight)
    assert len(other_table.cache) == 0


@pytest.mark.slow
def test_predict_and_eval_do_not_admit(graph_mode):
    table, model = _model(evict=-1)
    model.online_train(_stream(), callbacks=_StopAt(5), dataset_sink_mode=False)
    stats = table.cache.stats()
    batch = next(_stream(seed=3))
    out = model.predict(batch["dense"], batch["ids"])
    assert out.shape == (BATCH, 1)
    assert table.cache.stats() == stats
    model._metrics = {"auc", "log_loss"}
    result = model.eval([(batch["dense"], batch["ids"], batch["label"])])
    assert set(result) == {"auc", "log_loss"} and 0.0 <= result["auc"] <= 1.0
    assert table.cache.stats() == stats


def test_predict_of_a_batch_without_the_tables_items_is_refused(graph_mode):
    """A batch too short to hold the item a table reads (here the ids, item 1) is refused naming the batch
    and both counts, not an IndexError."""
    table, model = _model()
    batch = next(_stream())
    with pytest.raises(ValueError, match=r"the batch.*at least 2 items \(a table reads item 1\).*but got '1 items'"):
        model.predict(batch["dense"])
    assert model.predict(batch["dense"], batch["ids"]).shape == (BATCH, 1)


def _evicting_reference(batches, hooks):
    """The table a RecModel with ``hooks`` must end with: each batch looked up in stream order, then
    every hook, in order, evicts the tables it finds due (by hand, no RecModel)."""
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM + 1, 64, access_threshold=1, eviction_threshold=8, use_dynamic_expansion=True,
                             max_unique=BATCH * FIELDS + 1, input_index=1, seed=0, name="ids",
                             optimizer=rb.SparseAdam(0.01))
    for taken, batch in enumerate(batches, start=1):
        table.prepare(batch["ids"], int(batch["timestamp"]))
        for hook in hooks:
            for due in hook.due(taken, [table]):
                if due:
                    table.evict(table.cache.now)
    return table


@pytest.mark.slow
def test_two_evict_hooks_both_run_in_order_and_resume_exactly(graph_mode, tmp_path):
    """Every EvictHook in the callbacks runs, each on its own schedule and tables; both schedules are
    checkpointed. (A hook naming a table that is not the network's is an error.)"""
    import itertools
    batches = list(itertools.islice(_stream(), 20))

    def hooks(tables=None):
        return [rb.EvictHook(evict_time_interval=None, evict_step_interval=7),
                rb.EvictHook(evict_time_interval=10, tables=tables)]

    table, model = _model()
    first, second = hooks(tables=[table])
    model.online_train(batches, callbacks=[first, _StopAt(100), second], dataset_sink_mode=False)
    ref = _evicting_reference(batches, hooks())
    assert model.step == 20 and (first.evictions, second.evictions) == (2, 3)
    assert table.cache.stats()["evicted"] > 0
    np.testing.assert_equal(table.cache.state_dict(), ref.cache.state_dict())
    only_first_table, only_first = _model()
    only_first.online_train(batches, callbacks=hooks()[0], dataset_sink_mode=False)
    assert only_first_table.cache.stats()["evicted"] < table.cache.stats()["evicted"]     # the second one counts
    # stopped at 9 and resumed from its checkpoint with two fresh hooks: the same run
    table_b, model_b = _model()
    model_b.online_train(iter(batches), callbacks=hooks() + [rb.OnlineCheckpoint(tmp_path, every_steps=9), _StopAt(9)],
                         dataset_sink_mode=False)
    table_c, model_c = _model(seed=3)
    resumed = hooks()
    model_c.online_train(batches, callbacks=resumed, dataset_sink_mode=False, resume_from=str(tmp_path))
    assert [h.evictions for h in resumed] == [2, 3]
    _assert_same(_snapshot(table, model), _snapshot(table_c, model_c))
    other = rb.HashEmbedding(DIM + 1, 64, name="other")
    with pytest.raises(ValueError, match=r"the 'tables' of EvictHook 1 of 'callbacks' must be hash tables of the "
                                         r"network \['ids'\], but got 'other'"):
        model_c.online_train(batches, callbacks=[rb.EvictHook(), rb.EvictHook(tables=[other])], dataset_sink_mode=False)
    assert model_c.step == 20


def test_callbacks_reach_the_model_through_public_names(graph_mode):
    """``cb_params.recboost`` is the model; a callback of one's own scores the batch about to be trained
    on with ``predict_step_inputs`` (what ProgressMonitor does) and sees the tables, network and loss."""
    from mindspore.train.callback import Callback
    table = rb.HashEmbedding(5, 256, input_index=1, seed=0, name="ids")
    net = rb.WideDeep(4, 5, 4, (8,), embedding=table)
    loss = nn.BCEWithLogitsLoss()
    model = rb.RecModel(net, loss, nn.Adam(net.trainable_params(), 0.01))
    seen = []

    class Scores(Callback):
        def on_train_step_begin(self, run_context):
            params = run_context.original_args()
            rec = params.recboost
            scores = rec.predict_step_inputs(params.train_dataset_element).asnumpy()
            seen.append((rec is model, rec.tables == (table,), rec.network is net, rec.loss_fn is loss,
                         rec.checkpoint_shard, scores.shape))
    rng = np.random.default_rng(0)
    batches = [(rng.random((16, 4), np.float32), rng.integers(0, 50, (16, 5)), (rng.random((16, 1)) < 0.3)
                .astype(np.float32)) for _ in range(3)]
    model.train(1, batches, callbacks=[Scores()])
    assert seen == [(True, True, True, True, None, (16, 1))] * 3


def test_between_steps_an_id_only_a_prefetched_batch_looked_up_reads_as_unknown(tmp_path):
    """RecModel prepares up to two batches ahead: their lookups admit ids, and an EvictHook's eviction frees
    rows there, but an admitted id's row gets its initial values only when its step takes the batch. Between
    steps (a callback) predict and export see the model of the steps trained so far, as Model does: an id only
    a prefetched batch has looked up reads the default row and is left out of a bundle, though the cache
    already gave it a row that still holds an evicted id's values. predict pauses the prefetcher, so its
    lookups never run beside the prefetch thread's (the numpy fallback's cache raised IndexError there)."""
    batches = [b for _, b in zip(range(12), _stream(seed=1))]
    table, model = _model(capacity=4096, access=0, evict=2, grow=False)
    seen, checked = set(), []

    class Probe(ms.train.Callback):
        def on_train_step_end(self, run_context):
            step = int(run_context.original_args().cur_step_num)
            seen.update(batches[step - 1]["ids"].ravel().tolist())
            if step < 4:
                return
            ahead = batches[step]
            new = np.isin(ahead["ids"], np.fromiter(seen, np.int64), invert=True)
            with model.between_steps():             # (the prefetcher paused: the cache read at one point)
                rows = table.cache.find(ahead["ids"][new])
                assert new.any() and (rows > rb.HASH_SCRATCH_ROW).all()              # admitted ahead ...
                assert np.asarray(table.weight)[rows].any(axis=1).all()              # ... on re-used rows
            never = 10 ** 12 + np.arange(new.size).reshape(new.shape)               # ids no batch holds
            inputs = {k: ahead[k] for k in ("dense", "ids", "timestamp")}
            np.testing.assert_array_equal(model.predict(inputs).asnumpy(), model.predict(
                dict(inputs, ids=np.where(new, never, ahead["ids"]))).asnumpy())
            exports = {6: {}, 7: {"base": str(tmp_path / "6")}, 8: {"max_rows": 600}}    # full, delta, capped
            if step in exports:
                model.export(str(tmp_path / str(step)), **exports[step])
                exported = np.load(tmp_path / str(step) / "table-0-ids.npy")
                assert exported.size and not np.isin(ahead["ids"][new], exported).any()
            checked.append(step)

    model.online_train(iter(batches), callbacks=[Probe(), rb.EvictHook(evict_step_interval=1), _StopAt(8)])
    assert checked == [4, 5, 6, 7, 8]


@pytest.mark.parametrize("call", ["predict", "eval"])
def test_predict_and_eval_in_a_callback_never_look_ids_up_beside_the_prefetcher(monkeypatch, call):
    """The prefetch thread looks up the next batches' ids while a step's callbacks run; a callback's predict
    or eval (a model zoo EvalCallBack) looks ids up in the same cache. Each pauses the prefetcher first (the
    lookup under way ends, none starts), so no lookup of the cache runs beside theirs: with each prefetched
    lookup made to take 20 ms, none is under way when a find begins."""
    table, model = _model(capacity=64, access=0, evict=3, metrics={"log_loss"} if call == "eval" else None)
    cache_type = type(table.cache)
    lookup, find, busy, finds = cache_type.lookup, cache_type.find, threading.Event(), []

    def slow_lookup(self, *args, **kwargs):
        busy.set()
        try:
            time.sleep(0.02)
            return lookup(self, *args, **kwargs)
        finally:
            busy.clear()

    def checked_find(self, ids):
        finds.append(busy.is_set())
        return find(self, ids)
    monkeypatch.setattr(cache_type, "lookup", slow_lookup)
    monkeypatch.setattr(cache_type, "find", checked_find)
    held_out = [b for _, b in zip(range(2), _stream(seed=5))]

    class Probe(ms.train.Callback):
        def on_train_step_end(self, run_context):
            if call == "predict":
                model.predict({k: held_out[0][k] for k in ("dense", "ids", "timestamp")})
            else:
                model.eval(held_out, dataset_sink_mode=False)
    model.online_train(_stream(), callbacks=[Probe(), _StopAt(6)])
    assert len(finds) >= 6 and not any(finds)
