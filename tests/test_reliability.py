"""Long runs that survive (issue 27): clocks that are never guessed, checkpoints that load only into
the configuration that wrote them (unless told otherwise), checkpoint directories that keep their
integrity, and resumes that say what they skip."""
import os
import re
import shutil
import signal

import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn
from mindspore.train.callback import Callback

import recboost as rb
from _stopping import StopAfter
from test_survival import BATCH, DENSE, DIM, FIELDS, _assert_same, _batches, _hold_lock, _no_counters, _state

T0 = 1_700_000_000


def _model(seed=0, **table_kwargs):
    import mindspore as ms
    ms.set_seed(seed)
    model_kwargs = table_kwargs.pop("model_kwargs", {})
    kwargs = dict(access_threshold=1, eviction_threshold=600, max_unique=BATCH * FIELDS + 1, input_index=1,
                  name="ids", seed=seed)
    kwargs.update(table_kwargs)
    table = rb.HashEmbedding(DIM + 1, 256, **kwargs)
    net = rb.WideDeep(DENSE, FIELDS, DIM, (8,), embedding=table)
    return table, rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01), **model_kwargs)


def _timed(batches, start=T0, every=60):
    return [{"dense": d, "ids": i, "label": y, "timestamp": np.int64(start + every * k)}
            for k, (d, i, y) in enumerate(batches)]


# ---- clocks --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_batch_without_its_timestamp_is_refused_naming_it_and_changes_nothing(graph_mode, backend):
    table, model = _model()
    stream = _timed(_batches(1, 6))
    model.online_train(stream[:3], dataset_sink_mode=False)
    assert table.clock == "data" and table.cache.now == T0 + 120
    before = _state(table, model)
    missing = {k: v for k, v in stream[3].items() if k != "timestamp"}
    with pytest.raises(ValueError, match=r"stream batch 4's time column 'timestamp' must be a data time: hash "
                                         r"table 'ids' keeps data time \(its last lookup was at 1700000120\)"):
        model.online_train([missing], dataset_sink_mode=False)
    _assert_same(_no_counters(before), _no_counters(_state(table, model)))
    model.online_train(stream[3:], dataset_sink_mode=False)            # the stream goes on, on data time
    assert model.step == 6 and table.cache.now == T0 + 300 and table.clock == "data"


def test_a_step_clock_stream_refuses_a_timestamp(graph_mode):
    table, model = _model()
    model.online_train(_batches(1, 2), dataset_sink_mode=False)
    assert table.clock == "step"
    with pytest.raises(ValueError, match=r"time column 'timestamp' must be absent: hash table 'ids' counts steps"):
        model.online_train(_timed(_batches(2, 1)), dataset_sink_mode=False)
    assert model.step == 2 and table.cache.step == 2


def test_the_table_api_keeps_its_clock_too(backend):
    emb = rb.HashEmbedding(4, 64, eviction_threshold=10)
    emb.prepare(np.arange(5), timestamp=100)
    with pytest.raises(ValueError, match=r"For 'HashEmbedding.prepare', 'timestamp' must be a data time"):
        emb.prepare(np.arange(5))
    assert emb.cache.step == 1 and emb.cache.now == 100
    emb.prepare(np.arange(5), is_train=False)                          # evaluation has no clock
    assert emb.clock == "data"


def test_the_clock_is_checkpointed(graph_mode, tmp_path):
    table, model = _model()
    model.online_train(_timed(_batches(1, 3)), dataset_sink_mode=False)
    model.save_checkpoint(str(tmp_path / "c.npz"))
    other_table, other = _model()
    other.load_checkpoint(str(tmp_path / "c.npz"))
    assert other_table.clock == "data"
    with pytest.raises(ValueError, match="keeps data time"):
        other.online_train(_batches(2, 1), dataset_sink_mode=False)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["[B]", "[B, 1]"])
@pytest.mark.live_backend
def test_a_per_row_time_column_counts_the_batch_at_its_latest_row(graph_mode, backend, shape):
    """The documented rule: one time per row is accepted; the batch's time is its latest row's."""
    batches = _batches(3, 4)
    rows = [np.int64(T0 + 60 * k) + np.arange(BATCH, dtype=np.int64)[::-1] for k in range(4)]
    per_row = [dict(b, timestamp=r if shape == "[B]" else r[:, None]) for b, r in zip(_timed(batches), rows)]
    latest = [dict(b, timestamp=r.max()) for b, r in zip(_timed(batches), rows)]
    got_table, got = _model()
    got.online_train(per_row, dataset_sink_mode=False)
    want_table, want = _model()
    want.online_train(latest, dataset_sink_mode=False)
    assert got_table.cache.now == T0 + 180 + BATCH - 1
    _assert_same(_state(want_table, want), _state(got_table, got))


@pytest.mark.parametrize("column, match", [
    (np.arange(BATCH - 1, dtype=np.int64), r"time column 'timestamp' of stream batch 1 must be one time per row "
                                           r"\(32\), but got '31 times'"),
    (np.zeros((BATCH, 2), np.int64), r"time column 'timestamp' must be one time for the batch, or one per row"),
    (np.full(BATCH, 1.5), r"time column 'timestamp' must be integers"),
])
def test_a_bad_time_column_is_named(graph_mode, column, match):
    table, model = _model()
    batch = dict(_timed(_batches(4, 1))[0], timestamp=column)
    with pytest.raises((ValueError, TypeError), match=match):
        model.online_train([batch], dataset_sink_mode=False)
    assert model.step == 0 and table.cache.step == 0


# ---- checkpoints load only into the configuration that wrote them ----------------------------------------
@pytest.fixture(scope="module")
def settings_checkpoint(tmp_path_factory):
    """The checkpoint of the default table's model after 3 timed batches, written once for the cases below
    (which only read it): ``(its path, the table's settings)``."""
    from _dist import graph_mode_on_cpu
    with graph_mode_on_cpu():
        table, model = _model()
        model.online_train(_timed(_batches(1, 3)), dataset_sink_mode=False)
        path = str(tmp_path_factory.mktemp("settings") / "c.npz")
        model.save_checkpoint(path)
        return path, table.settings()


@pytest.mark.slow
@pytest.mark.parametrize("setting, value", [("eviction_threshold", 60), ("access_threshold", 3),
                                            ("use_dynamic_expansion", True)])
def test_a_resume_into_other_table_settings_is_refused_unless_told(graph_mode, settings_checkpoint, setting, value,
                                                                   capfd):
    path, settings = settings_checkpoint
    saved = settings[setting]
    other_table, other = _model(**{setting: value})
    with pytest.raises(ValueError, match=r"the checkpoint '%s' .*the setting '%s' of hash table 'ids' must be %r as "
                                         r"the state was trained with \(to go on with this table's, load with "
                                         r"strict=False\), but got %r" % (re.escape(path), setting, saved, value)):
        other.load_checkpoint(path)
    assert other.step == 0 and other_table.cache.step == 0
    other.online_train(_timed(_batches(2, 2), start=T0 + 180), dataset_sink_mode=False, resume_from=path,
                       resume_strict=False, resume_skip=0)
    assert other.step == 5 and other_table.settings()[setting] == value
    assert {"eviction_threshold": other_table.cache.eviction_threshold, "access_threshold":
            other_table.cache.access_threshold, "use_dynamic_expansion": other_table.cache.grow}[setting] == value
    assert "goes on with %s=%r" % (setting, value) in capfd.readouterr().err


@pytest.mark.parametrize("kwargs", [dict(combiner="mean"), dict(combiner="sqrtn"), dict(padding_id=None),
                                    dict(padding_id=-1)])
def test_a_pooled_table_state_loads_only_into_its_combiner_and_padding_id(backend, kwargs):
    made = dict(combiner="sum", padding_id=0, name="bags")
    table = rb.HashEmbedding(4, 64, **made)
    batch = table.prepare(np.array([[1, 2, 0], [3, 0, 0]]))
    table.take(batch)
    table.apply_gradients(batch, np.ones((2, 4), np.float32))
    state = table.state_dict()
    other = rb.HashEmbedding(4, 64, **dict(made, **kwargs))
    key, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=r"the setting '%s' of hash table 'bags' must be %r" % (key, made[key])):
        other.load_state_dict(state)
    assert other.cache.step == 0 and not other.weight.any()
    other.load_state_dict(state, strict=False)
    assert getattr(other, key) == value and other.cache.step == 1


def test_a_resume_into_other_model_settings_is_refused(graph_mode, tmp_path):
    table, model = _model()
    model.online_train(_timed(_batches(1, 2)), dataset_sink_mode=False)
    path = str(tmp_path / "c.npz")
    model.save_checkpoint(path)
    _, other = _model(model_kwargs=dict(loss_scale_manager=rb.FixedLossScaleManager(64.0, drop_overflow_update=True)))
    with pytest.raises(ValueError, match=r"was written by a model with loss_scale_manager=None, but this model has "
                                         r"'FixedLossScaleManager'"):
        other.load_checkpoint(path)


# ---- checkpoint directories ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["run1/ckpt", "../escape", "/abs", ".hidden", ".."])
def test_a_prefix_is_a_plain_name(tmp_path, prefix):
    with pytest.raises(ValueError, match=r"'prefix' must be a plain file name"):
        rb.OnlineCheckpoint(tmp_path, every_steps=1, prefix=prefix)
    with pytest.raises(ValueError, match=r"'prefix' must be a plain file name"):
        rb.latest_checkpoint(str(tmp_path), prefix)


def test_a_prefix_leaves_room_for_the_longest_checkpoint_name(graph_mode, tmp_path):
    """A prefix of 201 bytes or more is refused at construction: ``<prefix>-<step>.part-<r>-of-<n>.npz``
    must fit a file name's 255 bytes, and a longer prefix failed only at the first save. 200 bytes (two-byte
    characters count twice) save and resume, the longest part name there can be made beside them too."""
    for prefix in ("p" * 201, "\u00e9" * 101):
        with pytest.raises(ValueError, match=r"'prefix' must be at most 200 bytes in UTF-8 \(the checkpoint's file "
                                             r"name is at most 255\), but got '%d bytes'" % len(prefix.encode())):
            rb.OnlineCheckpoint(tmp_path, every_steps=1, prefix=prefix)
    prefix = "\u00e9" * 100
    table, model = _model()
    model.online_train(_timed(_batches(1, 2)), callbacks=rb.OnlineCheckpoint(tmp_path, every_steps=2, prefix=prefix),
                       dataset_sink_mode=False)
    assert rb.latest_checkpoint(str(tmp_path), prefix).endswith(prefix + "-2.npz")
    (tmp_path / ("%s-%d.part-99999-of-99999.npz" % (prefix, 2 ** 63 - 1))).write_bytes(b"")   # the longest
    _, other = _model()
    other.online_train([], dataset_sink_mode=False, resume_from=str(tmp_path), resume_prefix=prefix)
    assert other.step == 2


def test_resume_and_latest_checkpoint_take_the_prefix(graph_mode, tmp_path):
    table, model = _model()
    model.online_train(_timed(_batches(1, 4)), callbacks=rb.OnlineCheckpoint(tmp_path, every_steps=2, prefix="run1"),
                       dataset_sink_mode=False)
    assert rb.latest_checkpoint(str(tmp_path), "run1").endswith("run1-4.npz")
    assert rb.latest_checkpoint(str(tmp_path)) is None
    _, other = _model()
    with pytest.raises(ValueError, match=r"named recboost-<step>.npz \(prefix='recboost'\); it holds checkpoints "
                                         r"with the prefix 'run1'"):
        other.online_train([], dataset_sink_mode=False, resume_from=str(tmp_path))
    other.online_train([], dataset_sink_mode=False, resume_from=str(tmp_path), resume_prefix="run1")
    assert other.step == 4


def test_a_checkpoint_under_another_steps_name_is_refused_naming_it(graph_mode, tmp_path):
    """A directory's newest checkpoint is chosen by the step in its name: an older one renamed to a later
    step, or a copy of another under a later name, would resume from the wrong step. latest_checkpoint,
    load_checkpoint and resume_from refuse it naming the file, changing nothing; without it the resume
    takes the newest checkpoint written."""
    table, model = _model()
    model.online_train(_timed(_batches(1, 6)), callbacks=rb.OnlineCheckpoint(tmp_path, every_steps=2, keep=10),
                       dataset_sink_mode=False)
    forged = tmp_path / "recboost-10.npz"
    for make, recorded in ((lambda: os.replace(tmp_path / "recboost-2.npz", forged), 2),
                           (lambda: shutil.copyfile(tmp_path / "recboost-6.npz", forged), 6)):
        make()
        message = r"For '%s', the newest checkpoint '%s' must be a checkpoint of the step its name gives, 10, but " \
                  r"got 'one of step %d \(renamed, or a copy of another checkpoint\)'"
        with pytest.raises(ValueError, match=message % ("latest_checkpoint", re.escape(str(forged)), recorded)):
            rb.latest_checkpoint(str(tmp_path))
        _, other = _model()
        before = other.step
        for call in (lambda: other.load_checkpoint(str(tmp_path)),
                     lambda: other.online_train([], dataset_sink_mode=False, resume_from=str(tmp_path))):
            with pytest.raises(ValueError, match=message % ("latest_checkpoint", re.escape(str(forged)), recorded)):
                call()
            assert other.step == before == 0
        os.remove(forged)
    other.online_train([], dataset_sink_mode=False, resume_from=str(tmp_path))
    assert other.step == 6


def test_a_resume_on_a_stream_shorter_than_what_it_skips_is_refused_naming_it(graph_mode, tmp_path):
    """A resume skips the batches the checkpointed call had consumed (or resume_skip's): a Python stream that
    ends among them is not the stream the checkpoint continues, and trained nothing without a word. Now a
    ValueError naming train_dataset and what was skipped; the model is as the checkpoint loaded it. An empty
    stream, or one that holds exactly them, resumes the checkpoint alone (its prepared batches replayed), and
    the right one ends as the run."""
    stream = _timed(_batches(1, 8))
    ref_table, ref = _model()
    ref.online_train(stream, dataset_sink_mode=False)
    table, model = _model()
    model.online_train(stream, callbacks=[rb.OnlineCheckpoint(tmp_path, every_steps=4), StopAfter(4)],
                       dataset_sink_mode=False)
    consumed = _taken(tmp_path)                   # (those trained and those prepared ahead, which it replays)
    assert consumed > model.step == 4
    for given, skip, why in ((stream[:3], None, r"the checkpointed call had consumed them; resume_skip=0 if this "
                                                r"stream starts afresh"), (stream, 100, "resume_skip")):
        _, other = _model(seed=7)
        with pytest.raises(ValueError, match=r"For 'RecModel.online_train', 'train_dataset' must be a stream holding "
                                             r"the %d batches a resume skips \(%s\), but got 'one that ended after %d'"
                                             % (consumed if skip is None else skip, why, len(given))):
            other.online_train(iter(given), dataset_sink_mode=False, resume_from=str(tmp_path), resume_skip=skip)
        assert other.step == 4
    for given in ([], iter(stream[:consumed])):
        _, other = _model(seed=7)
        other.online_train(given, dataset_sink_mode=False, resume_from=str(tmp_path))
        assert other.step == consumed              # (the batches prepared ahead, replayed)
    resumed_table, resumed = _model(seed=7)
    resumed.online_train(iter(stream), dataset_sink_mode=False, resume_from=str(tmp_path))
    assert resumed.step == ref.step == 8
    _assert_same(_no_counters(_state(ref_table, ref)), _no_counters(_state(resumed_table, resumed)))


class _AtStep(Callback):
    def __init__(self, step, action):
        self.step, self.action = step, action

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == self.step:
            self.action()


def test_a_deleted_directory_is_locked_again_before_the_next_save(graph_mode, tmp_path, capfd):
    directory = tmp_path / "ckpt"
    table, model = _model()
    ckpt = rb.OnlineCheckpoint(directory, every_steps=2, keep=2)
    model.online_train(_timed(_batches(1, 6)), callbacks=[ckpt, _AtStep(3, lambda: shutil.rmtree(directory))],
                       dataset_sink_mode=False)
    assert "THE LOCK OF %s IS GONE" % directory in capfd.readouterr().err
    assert sorted(os.listdir(directory)) == ["recboost-4.npz", "recboost-6.npz"]


@pytest.mark.slow
def test_a_replaced_directory_held_by_another_trainer_stops_the_save(graph_mode, tmp_path):
    directory = tmp_path / "ckpt"
    holders = []

    def replace():
        shutil.rmtree(directory)
        os.makedirs(directory)
        holders.append(_hold_lock(directory))

    table, model = _model()
    try:
        with pytest.raises(RuntimeError, match=r"this run must hold its checkpoint directory .* but the directory was "
                                               r"replaced during training and cannot be taken back: .*locked by the "
                                               r"running process"):
            model.online_train(_timed(_batches(1, 6)), callbacks=[rb.OnlineCheckpoint(directory, every_steps=2),
                                                                  _AtStep(3, replace)], dataset_sink_mode=False)
        assert os.path.exists(directory / ".recboost.lock")       # the other trainer's lock is left alone
        assert model.step == 4
    finally:
        for holder in holders:
            holder.send_signal(signal.SIGKILL)
            holder.wait()


# ---- a resume says what it skips ------------------------------------------------------------------------------
def _taken(directory):
    return rb._checkpoint_file_manifest(rb.latest_checkpoint(str(directory)))["taken"]


@pytest.mark.slow
@pytest.mark.live_backend
def test_one_call_per_pass_resumes_its_own_pass(graph_mode, backend, tmp_path, capfd):
    """Pass 1 ends (its checkpoint at the end), pass 2 stops after 6 of its steps: resuming pass 2
    from there skips only the batches pass 2 had consumed (6, and those already prepared, which the
    checkpoint replays), not pass 1's too. From the end of pass 1 the default skips pass 1's 10
    (the stream given again), and says so; ``resume_skip=0`` starts pass 2 afresh. Each ends where
    one uninterrupted run of both passes ends."""
    pass1, pass2 = _timed(_batches(1, 10)), _timed(_batches(2, 10), start=T0 + 600)
    ref_table, ref = _model()
    ref.online_train(pass1, dataset_sink_mode=False)
    ref.online_train(pass2, dataset_sink_mode=False)

    first, second = tmp_path / "a", tmp_path / "b"
    table, model = _model()
    model.online_train(pass1, callbacks=rb.OnlineCheckpoint(first, every_steps=100), dataset_sink_mode=False)
    model.online_train(iter(pass2), callbacks=[StopAfter(16), rb.OnlineCheckpoint(second, every_steps=100)],
                       dataset_sink_mode=False)
    assert model.step == 16
    consumed = _taken(second) - 10
    assert 6 <= consumed <= 8 and _taken(first) == 10
    for directory, stream, skip, skipped in ((second, pass2, None, consumed), (first, pass1 + pass2, None, 10),
                                             (first, pass2, 0, 0)):
        resumed_table, resumed = _model(seed=7)
        resumed.online_train(stream, dataset_sink_mode=False, resume_from=str(directory), resume_skip=skip)
        assert resumed.resume_skipped == skipped and resumed.step == 20
        assert "skipping the first %d batches of this stream" % skipped in capfd.readouterr().err
        _assert_same(_no_counters(_state(ref_table, ref)), _no_counters(_state(resumed_table, resumed)))
    resumed_table, resumed = _model(seed=7)
    resumed.online_train(pass2[consumed:], dataset_sink_mode=False, resume_from=str(second), resume_skip=0)
    assert resumed.resume_skipped == 0 and resumed.step == 20
    _assert_same(_no_counters(_state(ref_table, ref)), _no_counters(_state(resumed_table, resumed)))


# ---- nothing non-finite enters the model (issue #35 item 4) --------------------------------------------
def _finite_model(tables=True):
    """A Wide&Deep over a hash table that admits every id at once (a batch of ids it has seen adds no row),
    or over a plain nn.Embedding (no table: the step's overflow flags are read lazily)."""
    import mindspore as ms
    ms.set_seed(0)
    if not tables:
        net = rb.WideDeep(DENSE, FIELDS, DIM, (8,), vocab_size=300)
        return None, rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    table = rb.HashEmbedding(DIM + 1, 512, max_unique=BATCH * FIELDS + 1, input_index=1, name="ids", seed=0)
    net = rb.WideDeep(DENSE, FIELDS, DIM, (8,), embedding=table)
    return table, rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))


def _model_state(table, model):
    """Every dense parameter and optimizer state, and the table's rows and optimizer slots."""
    out = {"param:" + p.name: p.asnumpy().copy() for p in model.state_parameters()}
    if table is not None:
        out["table"] = table.weight.copy()
        out.update(("slot:" + name, a.copy()) for name, a in table.slots.items())
    return out


def _huge(batch, factor=np.float32(1e30)):
    return batch[0] * factor, batch[1], batch[2]


def _fit(model, how, batches):
    if how == "train":
        model.train(1, batches)
    else:
        model.online_train(batches, dataset_sink_mode=False)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["online_train", "train"])
@pytest.mark.live_backend
def test_huge_finite_features_are_skipped_and_the_model_stays_finite(graph_mode, backend, how):
    """Two batches whose dense features are x1e30 pass the batch checks (they are finite) and give finite
    gradients whose squares overflow float32: each step is skipped and counted, every dense parameter,
    optimizer state, table row and slot is bit-identical to before, and training goes on, finite."""
    table, model = _finite_model()
    good = _batches(1, 4)
    _fit(model, how, good[:2])
    before = _model_state(table, model)
    _fit(model, how, [_huge(good[0]), _huge(good[1])])           # ids the table holds: no new rows
    assert model.overflow_steps == 2 and model.step == 4 and model.skipped_batches["nonfinite"] == 0
    _assert_same(_model_state(table, model), before)
    _fit(model, how, good[2:])
    assert model.step == 6 and model.overflow_steps == 2
    for key, value in _model_state(table, model).items():
        assert np.isfinite(value).all(), key
    assert np.isfinite(model.predict(good[0][0], good[0][1]).asnumpy()).all()


@pytest.mark.slow
@pytest.mark.parametrize("tables", [True, False], ids=["hash table", "plain network"])
def test_a_run_of_skipped_steps_stops_training_naming_the_batches(graph_mode, tables):
    """RecModel._OVERFLOW_RUN skipped steps in a row stop training with a RuntimeError naming the stream
    batches of the run; the model is as it was before the run (the plain network's flags are read lazily,
    within _OVERFLOW_RUN steps)."""
    table, model = _finite_model(tables)
    good = _batches(2, 2)
    model.online_train(good, dataset_sink_mode=False)
    before = _model_state(table, model)
    run = rb.RecModel._OVERFLOW_RUN
    bad = [_huge(good[k % 2]) for k in range(run + 10)]
    with pytest.raises(RuntimeError, match=r"'RecModel.online_train', the update of at least one of %d steps in a "
                       r"row must be finite .* but got '%d skipped steps in a row, on stream batches 3 to %d \(the "
                       r"model is as it was before stream batch 3\)'" % (run, run, run + 2)):
        model.online_train(bad, dataset_sink_mode=False)
    assert model.step == run + 2 and model.overflow_steps == run
    _assert_same(_model_state(table, model), before)


class _RowTimesDense(nn.Cell):
    """logit = sum over fields of (row . x) + b: a table row's gradient is the dense features times the
    logit's gradient, so features of 1e25 give rows a finite gradient whose square overflows float32 (the
    dense parameter's gradient stays small)."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self.b = Parameter(Tensor(np.zeros(1, np.float32)), name="b")

    def construct(self, x, ids):
        rows = self.table(ids)                                   # [B, F, D]
        return (rows.sum(1) * x).sum(-1, keepdims=True) + self.b


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["SparseAdam", "SparseAdagrad", "SparseFtrl", "SparseSGD"])
@pytest.mark.live_backend
def test_a_step_that_would_overflow_a_table_row_or_slot_is_skipped(graph_mode, backend, optimizer):
    """Only the hash table's rows get a huge gradient (the sum of a row's occurrences too): the step is
    skipped and counted, and no row, slot or dense parameter changes; SparseAdam's second moment would have
    become Inf."""
    table, model, good = _row_model(getattr(rb, optimizer)(0.01))
    _huge_step_is_skipped(table, model, good, np.float32(1e25))


def _row_model(optimizer):
    """A table of ``optimizer`` under a dense Adam, trained 2 normal steps; returns it, the model and the
    3 normal batches (the third not trained yet)."""
    import mindspore as ms
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM, 512, max_unique=BATCH * FIELDS + 1, input_index=1, name="ids", seed=0,
                             optimizer=optimizer)
    net = _RowTimesDense(table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    rng = np.random.default_rng(3)
    good = [(rng.normal(size=(BATCH, DIM)).astype(np.float32), rng.integers(0, 300, (BATCH, FIELDS)).astype(np.int64),
             (rng.random((BATCH, 1)) < 0.3).astype(np.float32)) for _ in range(3)]
    model.online_train(good[:2], dataset_sink_mode=False)
    return table, model, good


def _load_changed(table, change):
    """Give the table's rows a state: its row store's state, changed by ``change(state)`` in place, loaded
    back (the table's own arrays are read-only, and a loaded state resets the store's running bounds)."""
    state = table.store.state_dict()
    change(state)
    table.store.load_state_dict(state)


def _huge_step_is_skipped(table, model, good, factor):
    """A step on the first batch's features times ``factor`` (labels the model gets wrong) is skipped and
    counted, changing nothing; then the third normal batch trains, and everything stays finite."""
    before = _model_state(table, model)
    dense, ids, label = _huge(good[0], factor)
    model.online_train([(dense, ids, 1 - label)], dataset_sink_mode=False)
    assert model.overflow_steps == 1 and model.step == 3
    _assert_same(_model_state(table, model), before)
    model.online_train(good[2:], dataset_sink_mode=False)
    assert model.overflow_steps == 1 and model.step == 4
    for key, value in _model_state(table, model).items():
        assert np.isfinite(value).all(), key


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["SparseAdagrad", "SparseRowWiseAdagrad", "SparseFtrl"])
@pytest.mark.live_backend
def test_a_step_that_would_overflow_a_row_accumulator_is_skipped(graph_mode, backend, optimizer):
    """The table's accumulators at float32's largest value (as a long run of huge but finite gradients leaves
    them): features x3e17 give the rows gradients whose T * T is finite (~1e37, the check of the gradients
    alone lets them pass) but whose squares (~1e33) take accum + g * g to Inf. The step is skipped and
    counted, and no row, slot or dense parameter changes; a normal step still runs (g * g is far below the
    accumulators' spacing, so they stay finite)."""
    table, model, good = _row_model(getattr(rb, optimizer)(0.01))
    _load_changed(table, lambda st: st["slots"]["accum"].fill(np.finfo(np.float32).max))
    _huge_step_is_skipped(table, model, good, np.float32(3e17))


def test_a_step_that_would_overflow_a_row_linear_is_skipped(graph_mode, backend):
    """SparseFtrl's linear grows by g - sigma * w, sigma = (sqrt(accum + g * g) - sqrt(accum)) / lr: rows of
    -1e20 (finite), a learning rate of 1e-6 and gradients of ~1e13 (T * T and accum + g * g finite) give
    sigma * w ~1e39, Inf in float32 (then NaN rows). The step is skipped, nothing changes."""
    table, model, good = _row_model(rb.SparseFtrl(1e-6))
    _load_changed(table, lambda st: st["table"].fill(np.float32(-1e20)))
    before = _model_state(table, model)
    dense, ids, label = _huge(good[0], np.float32(1e15))
    model.online_train([(dense, ids, 1 - label)], dataset_sink_mode=False)
    assert model.overflow_steps == 1 and model.step == 3
    _assert_same(_model_state(table, model), before)


def test_a_step_that_would_overflow_a_row_weight_is_skipped(graph_mode, backend):
    """SparseFtrl's new row is (l1 sign(linear) - linear) / (accum^q / lr + 2 l2): rows whose accumulators start
    at 1e-30 (a divisor of 1e-13 with l2 = 0) and whose linear is 1e30 (finite) would become Inf under a tiny
    gradient (features x1e-20: accum, linear and the gradient all stay finite). The step is skipped, nothing
    changes."""
    table, model, good = _row_model(rb.SparseFtrl(0.01, initial_accum=1e-30))
    _load_changed(table, lambda st: st["slots"]["linear"].fill(np.float32(1e30)))
    before = _model_state(table, model)
    model.online_train([_huge(good[0], np.float32(1e-20))], dataset_sink_mode=False)
    assert model.overflow_steps == 1 and model.step == 3
    _assert_same(_model_state(table, model), before)


def test_tables_reading_one_item_bound_its_rows_together(graph_mode):
    """A wide SparseFtrl table and a deep SparseAdam table read one ids item, so the step has one gradient
    for both: the bound the host hands the step for it is the wide table's (Adam's slots do not grow): the
    largest accumulator, |linear| and |weight| of every row (a row the step does not update too), each raised
    to a power of two, FTRL's q, learning rate and divisor bound, and an ``add`` of 0 (no L2 decay)."""
    from test_dropin import _shared_ids_batches, _shared_ids_model
    model, net = _shared_ids_model(1)
    data = _shared_ids_batches(3, 1)
    model.online_train(data[:2], dataset_sink_mode=False)

    def change(state):
        state["slots"]["accum"].fill(np.float32(5.0))
        state["slots"]["accum"][-1] = np.float32(7.0)        # the largest, on the last row (no id holds it)
    _load_changed(net.wide, change)
    feed = model._pipeline.prepare(data[2], {"taken": 2}, "test")
    model._pipeline.inputs(feed)                             # (the ids admitted now get their initial rows)
    assert net.wide.capacity - 1 not in feed.tables[0].uniq
    assert model._pipeline.row_positions == (1,) and [b.positions for b in feed.tables] == [(1,), (1,)]
    # D: the new weights' divisor sqrt(accum) / lr is at least sqrt(initial_accum = 0.1) / 0.05 (accumulators
    # never decrease), lowered by 2^-16 to stay below the kernel's float32 value of it
    divisor = float(np.float32(0.1)) ** 0.5 / float(np.float32(0.05)) * (1 - 2.0 ** -16)
    assert np.float32(divisor) < np.sqrt(np.float32(0.1)) / np.float32(0.05)
    up = lambda x: 2.0 ** np.ceil(np.log2(float(x)))
    want = [8.0, up(np.abs(net.wide.slots["linear"]).max()), up(np.abs(net.wide.weight).max()), 0.5, 0.05, divisor,
            0.0]
    bounds, factors = model._pipeline.row_bounds(feed)
    np.testing.assert_array_equal(bounds, np.float32([want]))
    np.testing.assert_array_equal(factors, [1.0])                 # (no bags: a gradient row reaches one row)


class _BagTimesDense(nn.Cell):
    """logit = (pooled bag . x) + b with a "sum" bag of ids: an id repeated k times in its bag gets k times the
    bag's gradient."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self.b = Parameter(Tensor(np.zeros(1, np.float32)), name="b")

    def construct(self, x, ids):
        return (self.table(ids) * x).sum(-1, keepdims=True) + self.b


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["SparseAdam", "SparseAdagrad"])
def test_an_id_repeated_in_a_sum_bag_is_bounded_by_its_count(graph_mode, backend, optimizer):
    """Each bag holds one id 8 times, so its row's gradient is 8 times the bag's: features of 2e19 give the
    bags' gradient a T of ~5e18 (T * T finite) but the row a gradient of ~4e19, whose square overflows the
    optimizer's slot. The batch's gradient factor (8, the largest bag's count) bounds it: the step is
    skipped and nothing changes; normal steps around it train."""
    import mindspore as ms
    ms.set_seed(0)
    table = rb.HashEmbedding(DIM, 256, combiner="sum", input_index=1, name="ids", seed=0,
                             optimizer=getattr(rb, optimizer)(0.01))
    net = _BagTimesDense(table)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.01))
    rng = np.random.default_rng(4)

    ids = np.repeat(np.arange(10, 14)[:, None], 8, axis=1).astype(np.int64)    # [4 bags, 8 copies of one id]

    def batch(scale, label=0.0):
        x = (rng.random((4, DIM)) * 0.1).astype(np.float32)
        x[0, 0] = np.float32(scale)
        return x, ids, np.full((4, 1), label, np.float32)
    model.online_train([batch(1.0), batch(1.0)], dataset_sink_mode=False)
    before = _model_state(table, model)
    pooled = table.gather(table.prepare(ids[:1], is_train=False))[0, 0]      # the huge logit's sign: the label
    model.online_train([batch(2e19, float(pooled < 0))], dataset_sink_mode=False)   # opposes it (gradient 1/4)
    assert model.overflow_steps == 1 and model.step == 3
    _assert_same(_model_state(table, model), before)
    model.online_train([batch(1.0)], dataset_sink_mode=False)
    assert model.overflow_steps == 1 and model.step == 4
    assert all(np.isfinite(v).all() for v in _model_state(table, model).values())



@pytest.mark.parametrize("combiner, weights, want", [
    (None, None, 1.0),                       # no bags: each id its own output row
    ("sum", None, 4.0),                      # 3 copies of id 5 in bag 0: 3, raised to 4
    ("mean", None, 2.0),                     # 3 * float32(1/3), a little above 1
    ("sqrtn", None, 2.0),                    # 3 / sqrt(3) = 1.73
    ("sum", [[2.0, 0.5, 1.0, 1.0], [3.0, 0.25, 1.0, 1.0]], 4.0),     # bag 0: 3.5 (the padding id's weight dropped)
    ("mean", [[2.0, 0.5, 1.0, 1.0], [3.0, 0.25, 1.0, 1.0]], 2.0),    # |w| sum over w sum, the margin above 1
    ("max", [[2.0, 0.5, 1.0, 1.0], [5.0, 0.25, 1.0, 1.0]], 8.0),     # the largest |w|: 5, raised to 8
])
def test_the_gradient_factor_bounds_how_often_a_bag_reaches_a_row(backend, combiner, weights, want):
    """How many times one output row's gradient can reach a table row, which the step's finite check
    multiplies the rows' T by: 1 without bags; the bag's scale times the sum of its |weights| (its count
    unweighted), or for max the largest |weight|; as the power of two at or above it."""
    table = rb.HashEmbedding(DIM, 64, combiner=combiner, padding_id=0)
    ids = np.array([[5, 5, 5, 0], [6, 7, 0, 0]], np.int64)
    feature = ids if weights is None else rb.WeightedIds(ids, np.float32(weights))
    assert table.prepare(feature if combiner else ids.reshape(-1)[:3]).gradient_factor() == want
