"""TableConfig (issue #36, item 1): one frozen record of a hash table's settings, checked once, from which
HashEmbedding, create_table, FeatureSpec's thresholds, HashEmbeddingLookup, settings(), the cache and the
command line's table options derive; and the sparse optimizers' registry (item 2)."""
import dataclasses

import numpy as np
import pytest

import recboost

DIM = 4


# ---- the config ------------------------------------------------------------------------------------
def test_a_config_is_frozen_and_resolves_its_defaults_once():
    config = recboost.TableConfig(DIM, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.capacity = 128
    # the defaults, resolved when made: the optimizer, the admission counter, no sketch sizes for "exact"
    assert config.optimizer == recboost.SparseAdam() and config.admission_counter == "exact"
    assert (config.sketch_width, config.sketch_depth, config.sketch_window) == (None, None, None)
    sketch = recboost.TableConfig(DIM, 64, 2, eviction_policy="lru")       # a fixed budget that counts: a sketch
    assert (sketch.admission_counter, sketch.sketch_width, sketch.sketch_depth, sketch.sketch_window) == \
        ("sketch", 1024, 4, 512)
    # resolved values make the same config again; replace() checks the changed one
    assert recboost.TableConfig(**{f.name: getattr(sketch, f.name) for f in dataclasses.fields(sketch)}) == sketch
    assert dataclasses.replace(config, capacity=128).capacity == 128
    with pytest.raises(ValueError, match=r"For 'TableConfig', 'capacity' must be an int >= 3, but got 2\."):
        dataclasses.replace(config, capacity=2)


@pytest.mark.parametrize("bad, exc, message", [
    ({"capacity": 2}, ValueError, r"'capacity' must be an int >= 3, but got 2\."),
    ({"embedding_size": 0}, ValueError, r"'embedding_size' must be an int >= 1, but got 0\."),
    ({"access_threshold": -2}, ValueError, r"'access_threshold' must be an int >= -1, but got -2\."),
    ({"eviction_policy": "fifo"}, ValueError, r"'eviction_policy' must be None, 'lru', 'lfu' or 'score', but got 'fifo'\."),
    ({"lfu_half_life": 0, "eviction_policy": "lfu"}, ValueError, r"'lfu_half_life' must be an int >= 1, but got 0\."),
    ({"row_dtype": "float16"}, ValueError, r"'row_dtype' must be one of \['float32', 'bfloat16'\], but got 'float16'"),
    ({"sketch_depth": 2, "admission_counter": "exact"}, ValueError, r"'sketch_depth' must be None with "
                                                                     r"admission_counter='exact'"),
    ({"use_dynamic_expansion": True, "eviction_policy": "lru"}, ValueError, r"'use_dynamic_expansion' must be False "
                                                                             r"with an eviction_policy"),
    ({"optimizer": "adam"}, TypeError, r"'optimizer' must be a SparseSGD, SparseAdagrad, SparseRowWiseAdagrad, "
                                        r"SparseAdam or SparseFtrl, but got 'adam'\."),
    ({"name": ""}, TypeError, r"'name' must be a non-empty str, but got ''\."),
    ({"seed": -1}, ValueError, r"'seed' must be an int >= 0"),
    ({"sharding": "columns"}, ValueError, r"'sharding' must be one of \[None, 'none', 'data_parallel', 'row_wise'\]"),
])
def test_a_bad_setting_is_refused_naming_the_field_the_expected_and_the_given(bad, exc, message):
    settings = dict({"embedding_size": DIM, "capacity": 64}, **bad)
    with pytest.raises(exc, match="For 'TableConfig', " + message):
        recboost.TableConfig(**settings)
    # each front names itself (the same check, once, in the config)
    with pytest.raises(exc, match="For 'HashEmbedding', " + message):
        recboost.HashEmbedding(**settings)
    settings["dim"] = settings.pop("embedding_size")              # create_table's (mx_rec's) name for it
    with pytest.raises(exc, match="For 'create_table', " + message.replace("embedding_size", "dim")):
        recboost.create_table(**dict({"name": "t"}, **settings))


def test_the_fronts_refuse_what_a_config_does_not_hold():
    config = recboost.TableConfig(DIM, 64)
    with pytest.raises(TypeError, match=r"For 'HashEmbedding', the arguments beside a TableConfig must be none but "
                                        r"input_index .*, but got \['seed'\]\."):
        recboost.HashEmbedding(config, seed=3)
    with pytest.raises(TypeError, match=r"For 'HashEmbedding', the keyword arguments must be among \[.*\], but got "
                                        r"'lfu_halflife'\."):
        recboost.HashEmbedding(DIM, 64, lfu_halflife=10)
    with pytest.raises(TypeError, match=r"For 'HashEmbedding', 'capacity' must be given once"):
        recboost.HashEmbedding(DIM, 64, capacity=64)
    with pytest.raises(TypeError, match=r"For 'HashEmbedding', the positional arguments must be at most 14"):
        recboost.HashEmbedding(*range(15))
    with pytest.raises(TypeError, match=r"For 'create_table', keyword 'shard_num' must be one of create_table's"):
        recboost.create_table("t", DIM, 64, shard_num=2)


# ---- every front builds the same config ------------------------------------------------------------------
def test_the_keyword_forms_build_the_config_they_describe():
    ftrl = recboost.SparseFtrl(0.1, l1=0.01)
    want = recboost.TableConfig(DIM, 64, 1, 9, optimizer=ftrl, seed=5, init_stddev=0.2, name="t", combiner="mean",
                                padding_id=-1, eviction_policy="lfu", lfu_half_life=50, row_dtype="bfloat16")
    # HashEmbedding: positional in its order (input_index among them, not in the config), keywords, mx_rec's dim
    positional = recboost.HashEmbedding(DIM, 64, 1, 9, False, recboost.SparseFtrl(0.1, l1=0.01), None, 3, 5, 0.2,
                                        "t", "mean", -1, eviction_policy="lfu", lfu_half_life=50, row_dtype="bfloat16")
    assert positional.config == want and positional.input_index == 3
    keywords = recboost.HashEmbedding(dim=[DIM], capacity=64, access_threshold=1, eviction_threshold=9,
                                      optimizer=ftrl, seed=5, init_stddev=0.2, name="t", combiner="mean",
                                      padding_id=-1, eviction_policy="lfu", lfu_half_life=50, row_dtype="bfloat16")
    assert keywords.config == want and keywords.input_index is None
    assert recboost.HashEmbedding(want, input_index=2).config is want
    # create_table: mx_rec's thresholds (one more than the table's), given or from the feature specs
    spec = recboost.FeatureSpec("f", table_name="t", access_threshold=2, eviction_threshold=10)
    for table in (recboost.create_table("t", DIM, 64, access_threshold=2, eviction_threshold=10, optimizer=ftrl,
                                        seed=5, emb_initializer="normal", combiner="mean", padding_keys=-1,
                                        eviction_policy="lfu", lfu_half_life=50, row_dtype="bfloat16"),
                  recboost.create_table("t", DIM, 64, feature_spec=[spec], optimizer=ftrl, seed=5, combiner="mean",
                                        padding_id=-1, eviction_policy="lfu", lfu_half_life=50, row_dtype="bfloat16",
                                        init_stddev=0.01)):
        assert table.config == dataclasses.replace(want, init_stddev=0.01)
    # HashEmbeddingLookup: mindspore_rec's filter values, its growing table of 100000 rows by default
    lookup = recboost.HashEmbeddingLookup(DIM, permit_filter_value=3, evict_filter_value=7, seed=5)
    assert lookup.config == recboost.TableConfig(DIM, 2 + 100000, 2, 7, use_dynamic_expansion=True, seed=5,
                                                 name="hash_embedding_lookup")
    assert lookup.input_index == 0


def test_a_table_reads_its_settings_from_its_config_and_holds_no_copy():
    """The config is the one home of a table's settings: the table's attributes of them are its
    config's fields, read-only (a copy that could be changed would disagree with the config that
    checkpoints record and the cache and row store were made from); a row-wise shard's
    ``table_capacity`` stays the whole table's."""
    config = recboost.TableConfig(DIM, 2 + 30, combiner="sum", padding_id=-1, row_dtype="bfloat16", max_unique=8,
                                  sharding="row_wise", name="t", init_stddev=0.2, use_dynamic_expansion=True)
    table = recboost.HashEmbedding(config)
    read = {"sharding": "sharding", "use_dynamic_expansion": "use_dynamic_expansion", "max_unique": "max_unique",
            "table_name": "name", "combiner": "combiner", "padding_id": "padding_id", "row_dtype": "row_dtype",
            "table_capacity": "capacity", "init_stddev": "init_stddev"}
    assert {attr: getattr(table, attr) for attr in read} == {attr: getattr(config, name) for attr, name in read.items()}
    for attr in read:
        with pytest.raises(AttributeError):
            setattr(table, attr, getattr(table, attr))
        assert attr not in vars(table)
    assert table.store.config is config
    table.set_layout("row_wise", 1, 3)
    assert table.table_capacity == 32 and table.capacity == 2 + 10 and table.resolved_sharding == "row_wise"


def _train(table, steps=4):
    """A few training steps of ``table`` on seeded ids and gradients; returns its state."""
    rng = np.random.default_rng(11)
    for step in range(steps):
        batch = table.prepare(rng.integers(0, 40, size=(8, 3)), timestamp=step)
        table.take(batch)
        table.gather(batch)
        table.apply_gradients(batch, rng.standard_normal((8, 3, DIM)).astype(np.float32))
    return table.state_dict()


@pytest.mark.parametrize("optimizer", ["SparseAdagrad", "SparseFtrl"])
def test_a_table_of_a_config_trains_as_the_keyword_form_bit_for_bit(backend, optimizer):
    kind = recboost.sparse_optimizers()[optimizer]
    made = recboost.HashEmbedding(DIM, 20, 0, optimizer=kind(0.1), seed=7, row_dtype="bfloat16",
                                  eviction_policy="lru", sketch_width=64)
    config = recboost.TableConfig(DIM, 20, 0, optimizer=kind(0.1), seed=7, row_dtype="bfloat16",
                                  eviction_policy="lru", sketch_width=64)
    a, b = _train(made), _train(recboost.HashEmbedding(config))
    assert made.cache.stats()["replaced"] > 0                 # the policy worked: a full table replaced ids
    np.testing.assert_array_equal(a["table"], b["table"])
    for name in a["slots"]:
        np.testing.assert_array_equal(a["slots"][name], b["slots"][name])
    assert a["settings"] == b["settings"] == config.settings()


# ---- settings and checkpoints ------------------------------------------------------------------------
def test_settings_are_the_configs_recorded_fields_and_round_trip_through_a_state(backend):
    config = recboost.TableConfig(DIM, 40, 0, 5, optimizer=recboost.SparseAdagrad(0.2), combiner="sum",
                                  eviction_policy="lfu", lfu_half_life=30, admission_counter="sketch", sketch_width=80)
    table = recboost.HashEmbedding(config)
    # what checkpoints already hold: the same keys and values as before TableConfig
    assert table.settings() == {
        "access_threshold": 0, "eviction_threshold": 5, "eviction_policy": "lfu", "lfu_half_life": 30,
        "admission_counter": "sketch", "sketch_width": 80, "sketch_depth": 4, "sketch_window": 40,
        "use_dynamic_expansion": False, "combiner": "sum", "padding_id": None, "init_stddev": 0.01,
        "row_dtype": "float32", "optimizer_settings": {"learning_rate": 0.2, "initial_accumulator_value": 0.1},
        "score_half_life": 3600, "score_click_weight": 1.0, "score_nonclick_weight": 0.1, "admit_score": -1.0}
    assert recboost.HashEmbedding(DIM, 40).settings()["sketch_width"] == 0        # exact: no sketch, recorded 0
    rng = np.random.default_rng(3)
    for step in range(3):
        batch = table.prepare(rng.integers(0, 30, size=(6, 2)), timestamp=step)
        table.take(batch)
        table.apply_gradients(batch, np.ones((6, DIM), np.float32))
    state = table.state_dict()
    again = recboost.HashEmbedding(dataclasses.replace(config, seed=9))           # seed: the state brings its own
    again.load_state_dict(state)
    np.testing.assert_array_equal(again.weight, table.weight)
    assert again.seed == table.seed and again.settings() == table.settings()
    # a field that differs is refused by name, both values given
    other = recboost.HashEmbedding(dataclasses.replace(config, eviction=recboost.LFU(half_life=31)))
    with pytest.raises(ValueError, match=r"the setting 'lfu_half_life' of hash table 'hash_embedding' must be 30 as "
                                         r"the state was trained with .*, but got 31\."):
        other.load_state_dict(state)


def test_a_state_older_than_a_setting_loads_with_what_training_did_before_it(backend):
    table = recboost.HashEmbedding(DIM, 40)
    state = table.state_dict()
    for key in ("eviction_policy", "lfu_half_life", "row_dtype", "admission_counter", "sketch_width",
                "sketch_depth", "sketch_window"):
        del state["settings"][key]
    recboost.HashEmbedding(DIM, 40).load_state_dict(state)
    with pytest.raises(ValueError, match=r"the setting 'row_dtype' of hash table 'hash_embedding' must be 'float32'"):
        recboost.HashEmbedding(DIM, 40, row_dtype="bfloat16").load_state_dict(state)


def test_one_cache_factory_makes_every_cache_of_a_table(backend):
    config = recboost.TableConfig(DIM, 2 + 60, 1, 4, eviction_policy="lfu", lfu_half_life=20, sketch_width=128)
    cache = config.new_cache()
    assert (cache.capacity, cache.access_threshold, cache.eviction_threshold, cache.grow, cache.eviction_policy,
            cache.lfu_half_life, cache.admission_counter, cache.sketch_width, cache.sketch_depth,
            cache.sketch_window) == (62, 1, 4, False, "lfu", 20, "sketch", 128, 4, 64)
    shard = recboost.HashEmbedding(config)
    shard.set_layout("row_wise", 1, 3)                         # a shard's cache: its rows, the table's settings
    assert (shard.cache.capacity, shard.cache.eviction_policy, shard.cache.lfu_half_life, shard.cache.sketch_width,
            shard.cache.access_threshold) == (2 + 20, "lfu", 20, 128, 1)


# ---- the command line's table options -------------------------------------------------------------------
@pytest.mark.parametrize("command", ["train", "demo"])
def test_the_table_options_are_the_configs_fields(command, capsys):
    with pytest.raises(SystemExit) as stop:
        recboost.main([command, "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    options = [f.metadata.get("flat", f.name) for f in dataclasses.fields(recboost.TableConfig)
               if "option" in f.metadata]                     # a sub-config's option: its flat spelling
    assert options == ["capacity", "access_threshold", "eviction_threshold", "eviction_policy", "admission_counter"]
    for name in options:
        assert "--%s" % name.replace("_", "-") in text, name
    assert "--eviction-policy {lru,lfu,score}" in text and "--admission-counter {exact,sketch}" in text


# ---- the sparse optimizers' registry --------------------------------------------------------------------
def test_the_registry_lists_every_sparse_optimizer_and_refuses_an_unknown_name():
    registry = recboost.sparse_optimizers()
    assert list(registry) == ["SparseSGD", "SparseAdagrad", "SparseRowWiseAdagrad", "SparseAdam", "SparseFtrl"]
    assert all(registry[name] is getattr(recboost, name) and name in recboost.__all__ for name in registry)
    registry.clear()                                           # a copy: the registry itself is unchanged
    assert len(recboost.sparse_optimizers()) == 5
    assert recboost.sparse_optimizer("SparseFtrl", learning_rate=0.1, l1=0.01) == recboost.SparseFtrl(0.1, l1=0.01)
    assert recboost.sparse_optimizer("SparseFtrl", learning_rate=0.1) != recboost.SparseFtrl(0.2)
    with pytest.raises(ValueError, match=r"For 'sparse_optimizer', 'name' must be one of the sparse optimizers "
                                         r"\['SparseSGD', 'SparseAdagrad', 'SparseRowWiseAdagrad', 'SparseAdam', "
                                         r"'SparseFtrl'\], but got 'SparseLamb'\."):
        recboost.sparse_optimizer("SparseLamb")


def test_a_new_sparse_optimizer_registers_itself_and_its_kernel_must_exist():
    class SparseHalfSGD(recboost.SparseSGD):
        """SGD at half the rate (a throwaway subclass: a new optimizer is its kernel, twin and one class)."""

        def update(self, weight, slots, scalars, uniq, inverse, grad, acc, offsets=None, scale=None):
            recboost.sparse_sgd_update(weight, uniq, inverse, grad, acc, np.float32(self.learning_rate / 2), offsets,
                                       scale)

    try:
        assert recboost.sparse_optimizers()["SparseHalfSGD"] is SparseHalfSGD
        with pytest.raises(TypeError, match=r"'optimizer' must be a SparseSGD, .*, SparseFtrl or SparseHalfSGD"):
            recboost.TableConfig(DIM, 64, optimizer=1)
        table = recboost.HashEmbedding(DIM, 64, optimizer=recboost.sparse_optimizer("SparseHalfSGD", learning_rate=1.0))
        batch = table.prepare(np.array([5]))
        table.take(batch)
        before = table.rows_float32(batch.uniq)
        table.apply_gradients(batch, np.ones((1, DIM), np.float32))
        np.testing.assert_array_equal(table.rows_float32(batch.uniq), before - np.float32(0.5))
        with pytest.raises(TypeError, match=r"sparse optimizer SparseNoKernel: its kernel 'sparse_none_update' is "
                                            r"not among the kernels"):
            type("SparseNoKernel", (recboost.SparseSGD,), {"kernel": "sparse_none_update"})
    finally:   # the registry is the module's: leave it as found
        recboost._SPARSE_OPTIMIZERS.pop("SparseHalfSGD", None)
    assert "SparseNoKernel" not in recboost.sparse_optimizers()


def test_the_docs_example_runs_as_written(capsys):
    import os
    import re
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "tables.md")
    text = open(path, encoding="utf-8").read()
    code = re.search(r"```python\n(.*?)```", text[text.index("## A table's settings in one place"):], re.S).group(1)
    exec(compile(code, path, "exec"), {})
    assert capsys.readouterr().out.splitlines() == [
        "sketch 4000", "['SparseAdagrad', 'SparseAdam', 'SparseFtrl', 'SparseRowWiseAdagrad', 'SparseSGD']"]


def test_a_state_of_another_optimizer_is_refused_naming_the_registry(backend):
    trained = recboost.HashEmbedding(DIM, 40, optimizer=recboost.SparseSGD(0.1)).state_dict()
    names = list(recboost.sparse_optimizers())                    # the message reads the registry
    expected = (r"'state\['optimizer'\]' must be 'SparseFtrl', this table's optimizer \(one of the sparse optimizers "
                + ", ".join(names[:-1]) + " or " + names[-1] + r"\), but got ")
    table = recboost.HashEmbedding(DIM, 40, optimizer=recboost.SparseFtrl(0.1))
    with pytest.raises(ValueError, match=expected + r"'SparseSGD'\."):
        table.load_state_dict(trained)
    with pytest.raises(ValueError, match=expected + r"'SparseLamb'\."):
        table.load_state_dict(dict(trained, optimizer="SparseLamb"))


# ---- FeatureSpec: mx_rec's table-level settings, the TableConfig fields of their names ---------------------
def test_a_feature_spec_sets_its_tables_fields_in_the_tables_rules_and_ranges():
    spec = recboost.FeatureSpec("f", "t", "f", 3, 10)             # mx_rec's positional order
    assert (spec.table_name, spec.index_key, spec.access_threshold, spec.eviction_threshold) == ("t", "f", 3, 10)
    assert spec.table_settings == {"access_threshold": 2, "eviction_threshold": 9}     # the table's rules: one less
    assert recboost.FeatureSpec("f", access_threshold=0).table_settings == {"access_threshold": -1,
                                                                              "eviction_threshold": -1}
    table = recboost.create_table("t", DIM, 64, feature_spec=spec)
    assert {name: getattr(table.config, name) for name in spec.table_settings} == spec.table_settings
    # the table's range one higher, refused by the spec (or create_table) naming the value given
    top = 2 ** 62                                                   # the table's largest threshold
    assert recboost.FeatureSpec("f", eviction_threshold=top + 1).table_settings["eviction_threshold"] == top
    with pytest.raises(ValueError, match=r"For 'FeatureSpec', 'access_threshold' must be an int <= %d, "
                                         r"but got %d\." % (top + 1, top + 2)):
        recboost.FeatureSpec("f", access_threshold=top + 2)
    with pytest.raises(ValueError, match=r"For 'create_table', 'eviction_threshold' must be an int <= %d, "
                                         r"but got %d\." % (top + 1, top + 2)):
        recboost.create_table("t", DIM, 64, eviction_threshold=top + 2)


# ---- dependent settings as sub-configs: eviction=LRU()/LFU(...), admission=Count()/Sketch(...) (issue #59) --------
@pytest.mark.parametrize("make, exc, message", [
    (lambda: recboost.LFU(half_life=0), ValueError, r"For 'LFU', 'half_life' must be an int >= 1, but got 0\."),
    (lambda: recboost.LFU(1.5), TypeError, r"For 'LFU', 'half_life' must be an int, but got 1\.5\."),
    (lambda: recboost.LFU(2 ** 62 + 1), ValueError, r"For 'LFU', 'half_life' must be an int <= 4611686018427387904"),
    (lambda: recboost.Sketch(width=0), ValueError, r"For 'Sketch', 'width' must be an int >= 1, but got 0\."),
    (lambda: recboost.Sketch(64, depth=17), ValueError, r"For 'Sketch', 'depth' must be an int <= 16, but got 17\."),
    (lambda: recboost.Sketch(depth=0), ValueError, r"For 'Sketch', 'depth' must be an int >= 1, but got 0\."),
    (lambda: recboost.Sketch(window=True), TypeError, r"For 'Sketch', 'window' must be an int, but got True\."),
    (lambda: recboost.Sketch(width=2 ** 31), ValueError, r"For 'Sketch', 'width' must be an int <= 2147483647"),
])
def test_each_sub_config_checks_its_own_fields(make, exc, message):
    with pytest.raises(exc, match=message):
        make()


def test_the_sub_configs_are_frozen_records_the_tables_resolve():
    assert recboost.LRU() == recboost.LRU() and recboost.LFU() == recboost.LFU(3600) != recboost.LFU(60)
    assert recboost.Count() == recboost.Count() and recboost.Sketch() == recboost.Sketch(None, 4, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recboost.LFU().half_life = 5
    assert all(name in recboost.__all__ for name in ("LRU", "LFU", "Count", "Sketch"))
    # a table resolves the sketch's default sizes from its capacity, and the default counter from its budget
    config = recboost.TableConfig(DIM, 1000, 1, eviction=recboost.LRU())
    assert (config.eviction, config.admission) == (recboost.LRU(), recboost.Sketch(4000, 4, 2000))
    assert recboost.TableConfig(DIM, 1000, 1).admission == recboost.Count()
    # the flat spellings read back from the sub-configs (None where the choice has no such setting)
    assert (config.eviction_policy, config.lfu_half_life, config.admission_counter, config.sketch_width,
            config.sketch_depth, config.sketch_window) == ("lru", None, "sketch", 4000, 4, 2000)
    # and a cache's: its attributes stay the kernels' flat values; eviction/admission are the sub-configs
    cache = config.new_cache()
    assert (cache.eviction, cache.admission, cache.eviction_policy, cache.lfu_half_life) == (
        recboost.LRU(), recboost.Sketch(4000, 4, 2000), "lru", 3600)
    assert recboost.HashCache(64).eviction is None and recboost.HashCache(64).admission == recboost.Count()


# flat spelling, sub-config spelling: the same table
SPELLINGS = [
    (dict(eviction_policy="lfu", lfu_half_life=5), dict(eviction=recboost.LFU(half_life=5))),
    (dict(eviction_policy="lru"), dict(eviction=recboost.LRU())),                      # a budget that counts: sketch
    (dict(eviction_policy="lru", admission_counter="exact"), dict(eviction=recboost.LRU(), admission=recboost.Count())),
    (dict(admission_counter="sketch", sketch_width=64, sketch_depth=2), dict(admission=recboost.Sketch(64, 2))),
    (dict(sketch_window=50), dict(admission=recboost.Sketch(window=50))),              # a size alone: the sketch
    (dict(eviction_policy="lfu", lfu_half_life=5, sketch_width=64),                     # both, and mixed spellings
     dict(eviction=recboost.LFU(5), sketch_width=64)),
]


@pytest.mark.parametrize("flat, sub", SPELLINGS, ids=[str(sorted(f)) for f, _ in SPELLINGS])
def test_the_flat_and_the_sub_config_spellings_make_the_same_table(backend, flat, sub):
    made = [recboost.TableConfig(DIM, 20, 1, seed=3, **flat), recboost.TableConfig(DIM, 20, 1, seed=3, **sub)]
    assert made[0] == made[1] and made[0].settings() == made[1].settings()
    # every front: HashEmbedding's keyword form, create_table (mx_rec's threshold: one more), HashCache
    tables = [recboost.HashEmbedding(DIM, 20, 1, seed=3, **spelling) for spelling in (flat, sub)]
    assert tables[0].config == tables[1].config == made[0]
    assert recboost.create_table("t", DIM, 20, access_threshold=2, **flat).config == \
        recboost.create_table("t", DIM, 20, access_threshold=2, **sub).config
    caches = [recboost.HashCache(20, 1, **spelling) for spelling in (flat, sub)]
    assert caches[0].state_dict().keys() == caches[1].state_dict().keys()
    # the same behaviour on a seeded stream, bit for bit
    states = [_train(table, steps=6) for table in tables]
    assert states[0]["settings"] == states[1]["settings"]
    np.testing.assert_array_equal(states[0]["table"], states[1]["table"])
    for key, value in states[0]["cache"].items():
        np.testing.assert_array_equal(value, states[1]["cache"][key], err_msg=key)


def test_the_two_spellings_write_the_same_checkpoint_bytes(graph_mode, tmp_path):
    """A model with a flat-spelled table and one with the sub-configs write checkpoints whose every array
    member is byte for byte the same, their manifests too but for the run's id and so its checksum."""
    import json
    import zipfile
    from mindspore import nn
    import mindspore as ms

    def checkpoint(path, **spelling):
        ms.set_seed(0)
        table = recboost.HashEmbedding(9, 40, 1, input_index=1, seed=0, name="ids",
                                       optimizer=recboost.SparseAdagrad(0.05), **spelling)
        net = recboost.WideDeep(4, 6, 8, (16,), embedding=table)
        model = recboost.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
        stream = recboost.SyntheticClickStream(seed=0, num_dense=4, num_sparse=6, vocab_sizes=[300] * 6, batch_size=64)
        model.train(1, [next(stream) for _ in range(3)])
        assert table.cache.stats()["replaced"] > 0                # the policy and the sketch were at work
        model.save_checkpoint(str(path))
        return zipfile.ZipFile(str(path))

    a = checkpoint(tmp_path / "flat.npz", eviction_policy="lfu", lfu_half_life=5, sketch_width=64)
    b = checkpoint(tmp_path / "sub.npz", eviction=recboost.LFU(5), admission=recboost.Sketch(64))
    assert a.namelist() == b.namelist()
    for name in a.namelist():
        if name != "manifest.npy":
            assert a.read(name) == b.read(name), name
    manifests = [json.loads(bytes(np.load(z.open("manifest.npy"))).decode()) for z in (a, b)]
    for manifest in manifests:
        manifest.pop("run"), manifest.pop("sha256")
    assert manifests[0] == manifests[1]
    assert manifests[0]["tables"][0]["settings"]["lfu_half_life"] == 5


@pytest.mark.parametrize("given, exc, message", [
    (dict(eviction=recboost.LFU(30), lfu_half_life=31), ValueError,
     r"'lfu_half_life' must be 30 as eviction=LFU\(half_life=30\) says, or not given, but got 31\."),
    (dict(eviction=recboost.LRU(), eviction_policy="lfu"), ValueError,
     r"'eviction_policy' must be 'lru' as eviction=LRU\(\) says, or not given, but got 'lfu'\."),
    (dict(eviction=recboost.LRU(), eviction_policy="none"), ValueError,
     r"'eviction_policy' must be 'lru' as eviction=LRU\(\) says, or not given, but got 'none'\."),
    (dict(admission=recboost.Count(), sketch_depth=2), ValueError,
     r"'sketch_depth' must be None with admission_counter='exact' \(a setting of admission_counter='sketch': "
     r"Sketch's depth\), but got 2\."),
    (dict(admission=recboost.Sketch(64), sketch_width=128), ValueError,
     r"'sketch_width' must be 64 as admission=Sketch\(width=64, depth=4, window=None\) says, or not given"),
    (dict(admission=recboost.Sketch(), admission_counter="exact"), ValueError,
     r"'admission_counter' must be 'sketch' as admission=Sketch\(.*\) says, or not given, but got 'exact'\."),
    # a setting of another choice: half_life only with LFU, sketch sizes only with the sketch
    (dict(eviction_policy="lru", lfu_half_life=60), ValueError,
     r"'lfu_half_life' must be None with eviction_policy='lru' \(a setting of eviction_policy='lfu': LFU's "
     r"half_life\), but got 60\."),
    (dict(lfu_half_life=60), ValueError, r"'lfu_half_life' must be None with eviction_policy=None"),
    (dict(eviction=recboost.LRU(), lfu_half_life=60), ValueError, r"'lfu_half_life' must be None with "
                                                                  r"eviction_policy='lru'"),
    # a sub-config of the wrong kind
    (dict(eviction="lru"), TypeError, r"'eviction' must be None or one of LRU\(...\), LFU\(...\), Score\(...\), but got 'lru'\."),
    (dict(admission=recboost.LRU()), TypeError, r"'admission' must be None or one of Count\(...\), Sketch\(...\)"),
])
def test_a_flat_keyword_and_a_conflicting_sub_config_are_refused_naming_both(given, exc, message):
    for where, make in (("TableConfig", lambda: recboost.TableConfig(DIM, 64, **given)),
                        ("HashEmbedding", lambda: recboost.HashEmbedding(DIM, 64, **given)),
                        ("create_table", lambda: recboost.create_table("t", DIM, 64, **given)),
                        ("HashCache", lambda: recboost.HashCache(64, **given))):
        with pytest.raises(exc, match="For '%s', " % where + message):
            make()
    # agreeing spellings are one setting; the value a kernel holds without the setting (3600, 0) is no setting
    assert recboost.TableConfig(DIM, 64, eviction=recboost.LFU(30), lfu_half_life=30).eviction == recboost.LFU(30)
    assert recboost.HashCache(64, 1, 2, False, "lru", 3600).eviction == recboost.LRU()


def test_replace_changes_a_sub_config_and_the_growth_rule_is_checked_once(backend):
    config = recboost.TableConfig(DIM, 64, eviction=recboost.LFU(30))
    assert dataclasses.replace(config, eviction=recboost.LRU()).eviction_policy == "lru"
    assert dataclasses.replace(config, eviction=None, use_dynamic_expansion=True).use_dynamic_expansion
    with pytest.raises(ValueError, match=r"'lfu_half_life' must be 30 as eviction=LFU\(half_life=30\) says"):
        dataclasses.replace(config, lfu_half_life=31)            # replace passes the config's eviction too
    # no growth with an eviction policy: one check (the cache's), in each caller's name for growth
    for make, name in ((lambda: dataclasses.replace(config, use_dynamic_expansion=True), "use_dynamic_expansion"),
                       (lambda: recboost.HashEmbedding(DIM, 64, use_dynamic_expansion=True, eviction=recboost.LRU()),
                        "use_dynamic_expansion"),
                       (lambda: recboost.HashCache(64, grow=True, eviction=recboost.LFU()), "grow")):
        with pytest.raises(ValueError, match=r"'%s' must be False with an eviction_policy \('l[rf]u' keeps the table "
                                             r"at its capacity" % name):
            make()
    # mindspore_rec's table grows unless an eviction policy, in either spelling, keeps it at its size
    assert not recboost.HashEmbeddingLookup(DIM, capacity=100, eviction=recboost.LRU()).use_dynamic_expansion
    assert recboost.HashEmbeddingLookup(DIM, capacity=100).use_dynamic_expansion


def test_a_state_recording_a_setting_its_choice_does_not_use_still_loads(backend):
    """Before the sub-configs a table could record ``lfu_half_life`` with "lru" (unused by it): such a state
    loads into the LRU table of today, strictly (the setting did nothing)."""
    table = recboost.HashEmbedding(DIM, 40, eviction_policy="lru")
    state = _train(table)
    state["settings"]["lfu_half_life"] = 3
    again = recboost.HashEmbedding(DIM, 40, eviction=recboost.LRU())
    again.load_state_dict(state)
    np.testing.assert_array_equal(again.weight, table.weight)
    lfu = recboost.HashEmbedding(DIM, 40, eviction=recboost.LFU(3)).state_dict()
    with pytest.raises(ValueError, match=r"the setting 'lfu_half_life' of hash table 'hash_embedding' must be 3 as"):
        recboost.HashEmbedding(DIM, 40, eviction=recboost.LFU(4)).load_state_dict(lfu)


def test_the_sub_config_docs_example_runs_as_written(capsys):
    import os
    import re
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "tables.md")
    text = open(path, encoding="utf-8").read()
    code = re.search(r"```python\n(.*?)```", text[text.index("### Dependent settings as sub-configs"):], re.S).group(1)
    exec(compile(code, path, "exec"), {})
    assert capsys.readouterr().out.splitlines() == ["Sketch(width=4000, depth=2, window=2000)", "lfu 600", "LRU()"]


def test_a_new_choice_registers_itself_only_when_the_kernels_know_it():
    """A new eviction policy is one class (its kernel mapping beside it): defining one whose choice the
    kernels do not take is a TypeError naming it, and it does not register."""
    with pytest.raises(TypeError, match=r"eviction Fifo: its choice 'fifo' is not among the kernels' "
                                        r"eviction_policy \(None, 'lru', 'lfu' or 'score'\)"):
        dataclasses.dataclass(frozen=True)(type("Fifo", (recboost.LRU,), {"choice": "fifo"}))
    with pytest.raises(ValueError, match=r"For 'TableConfig', 'eviction_policy' must be None, 'lru', 'lfu' or 'score', "
                                         r"but got 'fifo'\."):
        recboost.TableConfig(DIM, 64, eviction_policy="fifo")
