"""RecModel: train/online_train against the bare TrainOneStepCell loop, callbacks, checkpoints."""
import os

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.train.callback import Callback, CheckpointConfig, LossMonitor, ModelCheckpoint, TimeMonitor

import recboost as rb
from _stopping import StopAfter

DENSE, FIELDS, VOCAB, BATCH = 4, 3, 50, 32


def _stream(seed=0, n=None):
    """Deterministic small click batches: (dense, ids, label)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=VOCAB)
    k = 0
    while n is None or k < n:
        dense = rng.normal(size=(BATCH, DENSE)).astype(np.float32)
        ids = rng.integers(0, VOCAB, size=(BATCH, FIELDS)).astype(np.int32)
        logit = w[ids].sum(1) + dense[:, 0]
        label = (rng.random(BATCH) < 1 / (1 + np.exp(-logit))).astype(np.float32)[:, None]
        yield dense, ids, label
        k += 1


def _model(seed=0, **kwargs):
    ms.set_seed(seed)
    net = rb.WideDeep(DENSE, FIELDS, 4, (8,), vocab_size=VOCAB)
    opt = nn.Adam(net.trainable_params(), 0.01)
    return net, rb.RecModel(net, nn.BCEWithLogitsLoss(), opt, **kwargs)


class _Losses(Callback):
    def __init__(self):
        self.losses, self.events = [], []

    def on_train_begin(self, run_context):
        self.events.append("begin")

    def on_train_epoch_begin(self, run_context):
        self.events.append("epoch_begin")

    def on_train_step_end(self, run_context):
        out = run_context.original_args().net_outputs
        self.losses.append(float((out[0] if isinstance(out, tuple) else out).asnumpy()))

    def on_train_epoch_end(self, run_context):
        self.events.append("epoch_end")

    def on_train_end(self, run_context):
        self.events.append("end")


_StopAt = StopAfter         # request_stop() once the step count is reached


class _Loss(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net, self.loss = net, nn.BCEWithLogitsLoss()

    def construct(self, dense, ids, label):
        return self.loss(self.net(dense, ids), label)


def _bare_losses(steps, seed=0):
    ms.set_seed(seed)
    net = rb.WideDeep(DENSE, FIELDS, 4, (8,), vocab_size=VOCAB)
    cell = nn.TrainOneStepCell(_Loss(net), nn.Adam(net.trainable_params(), 0.01))
    losses = [float(cell(*map(Tensor, batch)).asnumpy()) for batch in _stream(n=steps)]
    return losses, net


@pytest.mark.slow
def test_online_train_and_train_equal_the_bare_loop_exactly(graph_mode):
    bare, bare_net = _bare_losses(12)
    net, model = _model()
    rec = _Losses()
    model.online_train(_stream(), callbacks=[rec, _StopAt(12)], dataset_sink_mode=False)
    assert rec.losses == bare
    for a, b in zip(net.trainable_params(), bare_net.trainable_params()):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    net, model = _model()
    rec = _Losses()
    model.train(1, list(_stream(n=12)), callbacks=rec)
    assert rec.losses == bare
    assert rec.events == ["begin", "epoch_begin", "epoch_end", "end"]
    assert model.step == 12 and model.samples == 12 * BATCH and model.overflow_steps == 0


def test_online_train_over_a_generator_dataset_with_mindspore_callbacks(graph_mode, capsys):
    bare, _ = _bare_losses(6)
    dataset = ms.dataset.GeneratorDataset(lambda: _stream(), ["dense", "ids", "label"], shuffle=False)
    net, model = _model()
    rec = _Losses()
    model.online_train(dataset, callbacks=[rec, LossMonitor(1), TimeMonitor(), _StopAt(6)], sink_size=2)
    assert rec.losses == pytest.approx(bare, rel=0, abs=0)
    out = capsys.readouterr().out
    assert "epoch: 3 step: 2, loss is" in out             # LossMonitor: 3 "epochs" of 2 steps
    assert out.count("per step time") == 3                # TimeMonitor, once per "epoch"
    assert rec.events.count("epoch_begin") == 3            # sink_size=2 steps per "epoch"


class _Params(Callback):
    """Records what callbacks see in run_context.original_args() at each step end."""

    def __init__(self):
        self.seen = []

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        self.seen.append((isinstance(cb, dict), hasattr(cb, "no_such_key"), getattr(cb, "no_such_key", "none"),
                          cb.batch_num, cb.cur_epoch_num, cb.cur_step_num, cb["cur_step_num"]))


def test_mindspore_model_checkpoint_saves_the_trained_parameters(graph_mode, tmp_path, capsys):
    """MindSpore's own ModelCheckpoint, LossMonitor and TimeMonitor run on recboost's callback
    parameters (not MindSpore's private InternalCallbackParam): the .ckpt files hold the parameters
    of the step they name."""
    net, model = _model()
    ckpt = ModelCheckpoint(prefix="wd", directory=str(tmp_path),
                           config=CheckpointConfig(save_checkpoint_steps=3, keep_checkpoint_max=10))
    params, at_step_3 = _Params(), {}

    class _Grab(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == 3:
                at_step_3.update({p.name: p.asnumpy().copy() for p in net.trainable_params()})

    model.online_train(_stream(), callbacks=[_Grab(), ckpt, params, LossMonitor(3), TimeMonitor(), _StopAt(6)],
                       dataset_sink_mode=False, sink_size=3)
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".ckpt")) == ["wd-1_3.ckpt", "wd-2_3.ckpt"]
    for name, expected in (("wd-1_3.ckpt", at_step_3), ("wd-2_3.ckpt", {p.name: p.asnumpy()
                                                                         for p in net.trainable_params()})):
        saved = ms.load_checkpoint(str(tmp_path / name))
        for pname, value in expected.items():
            np.testing.assert_array_equal(saved[pname].asnumpy(), value, err_msg=pname)
    assert at_step_3 and os.path.basename(ckpt.latest_ckpt_file_name) == "wd-2_3.ckpt"
    assert params.seen == [(True, False, "none", 3, 1 + (k - 1) // 3, k, k) for k in range(1, 7)]
    out = capsys.readouterr().out
    assert "epoch: 1 step: 3, loss is" in out and "epoch: 2 step: 3, loss is" in out
    assert out.count("per step time") == 2


def test_stream_end_stops_training(graph_mode):
    net, model = _model()
    model.online_train(_stream(n=5), dataset_sink_mode=False)
    assert model.step == 5 and model.batches_consumed == 5


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"sink_size": 0}, ValueError, "'sink_size' must be an int >= 1, but got 0"),
    ({"sink_size": 1.5}, TypeError, "'sink_size' must be an int"),
    ({"dataset_sink_mode": "yes"}, TypeError, "'dataset_sink_mode' must be a bool, but got 'yes'"),
    ({"callbacks": [object()]}, TypeError, "'callbacks' must be a Callback or a list of Callback"),
])
def test_online_train_bad_arguments(kwargs, exc, match):
    net, model = _model()
    with pytest.raises(exc, match=match):
        model.online_train(_stream(n=2), **kwargs)
    assert model.step == 0


def test_constructor_rejects_unknown_kwargs():
    net = rb.WideDeep(DENSE, FIELDS, 4, (8,), vocab_size=VOCAB)
    with pytest.raises(TypeError, match="keyword arguments must be among .* but got 'loss_scale'"):
        rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params()), loss_scale=2)
    with pytest.raises(ValueError, match="'boost_level' must be one of"):
        rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params()), boost_level="O4")


def test_nan_batch_is_skipped_and_counted(graph_mode):
    net, model = _model()
    batches = list(_stream(n=4))
    model.online_train(batches[:2], dataset_sink_mode=False)
    before = [p.asnumpy().copy() for p in net.trainable_params()]
    dense, ids, label = batches[2]
    bad = (np.full_like(dense, np.nan), ids, label)
    model.online_train([bad], dataset_sink_mode=False)
    assert model.skipped_batches["nonfinite"] == 1 and model.step == 2
    for p, b in zip(net.trainable_params(), before):
        np.testing.assert_array_equal(p.asnumpy(), b)
    empty = tuple(a[:0] for a in batches[3])
    model.online_train([empty, batches[3]], dataset_sink_mode=False)
    assert model.skipped_batches == {"empty": 1, "bad_label": 0, "nonfinite": 1} and model.step == 3


def _params(net):
    return [p.asnumpy().copy() for p in net.trainable_params()]


def test_checkpoint_resume_is_exact(graph_mode, tmp_path):
    # uninterrupted: 14 steps
    net_a, model_a = _model()
    model_a.online_train(_stream(), callbacks=_StopAt(14), dataset_sink_mode=False)
    # interrupted at 8 (checkpoints every 4 steps, keep 2), then resumed in a fresh model
    net_b, model_b = _model()
    ckpt = rb.OnlineCheckpoint(tmp_path, every_steps=4, keep=2, save_on_end=False)
    model_b.online_train(_stream(), callbacks=[ckpt, _StopAt(9)], dataset_sink_mode=False)
    assert sorted(os.listdir(tmp_path)) == ["recboost-4.npz", "recboost-8.npz"]     # the lock is released
    assert rb.latest_checkpoint(str(tmp_path)).endswith("recboost-8.npz")
    net_c, model_c = _model(seed=123)      # different init: everything must come from the file
    model_c.online_train(_stream(), callbacks=_StopAt(14), dataset_sink_mode=False, resume_from=str(tmp_path))
    assert model_c.step == 14 and model_c.batches_consumed == 14
    for a, c in zip(_params(net_a), _params(net_c)):
        np.testing.assert_array_equal(a, c)
    # optimizer state too
    opt_a = {p.name: p.asnumpy() for p in model_a.train_network.optimizer.get_parameters()}
    opt_c = {p.name: p.asnumpy() for p in model_c.train_network.optimizer.get_parameters()}
    for name in opt_a:
        np.testing.assert_array_equal(opt_a[name], opt_c[name])


def test_bad_checkpoints_are_refused_without_partial_load(graph_mode, tmp_path):
    net, model = _model()
    model.online_train(_stream(n=3), dataset_sink_mode=False)
    path = str(tmp_path / "recboost-3.npz")
    model.save_checkpoint(path)
    fresh_net, fresh = _model(seed=5)
    before = _params(fresh_net)
    data = open(path, "rb").read()
    (tmp_path / "trunc.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="trunc.npz' cannot be read"):
        fresh.load_checkpoint(str(tmp_path / "trunc.npz"))
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(ValueError, match="junk.npz' cannot be read"):
        fresh.load_checkpoint(str(tmp_path / "junk.npz"))
    ms.set_seed(0)
    other_net = rb.WideDeep(DENSE, FIELDS, 8, (8,), vocab_size=VOCAB)        # different dim
    other = rb.RecModel(other_net, nn.BCEWithLogitsLoss(), nn.Adam(other_net.trainable_params(), 0.01))
    with pytest.raises(ValueError, match="recboost-3.npz' has parameter .* of shape"):
        other.load_checkpoint(path)
    for a, b in zip(before, _params(fresh_net)):
        np.testing.assert_array_equal(a, b)
    assert fresh.step == 0
    fresh.load_checkpoint(path)
    assert fresh.step == 3
    for a, b in zip(_params(net), _params(fresh_net)):
        np.testing.assert_array_equal(a, b)


def test_stream_error_reaches_caller_and_checkpoint_survives(graph_mode, tmp_path):
    def broken():
        for k, batch in enumerate(_stream()):
            if k == 6:
                raise RuntimeError("upstream went away")
            yield batch
    net, model = _model()
    ckpt = rb.OnlineCheckpoint(tmp_path, every_steps=2, keep=3)
    with pytest.raises(RuntimeError, match="upstream went away"):
        model.online_train(broken(), callbacks=ckpt, dataset_sink_mode=False)
    assert model.step == 6
    latest = rb.latest_checkpoint(str(tmp_path))
    assert latest.endswith("recboost-6.npz")
    fresh_net, fresh = _model(seed=9)
    fresh.load_checkpoint(latest)
    for a, b in zip(_params(net), _params(fresh_net)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_progress_monitor_prints_lines(graph_mode):
    lines = []
    net, model = _model()
    mon = rb.ProgressMonitor(every_steps=5, every_seconds=None, eval_every=1, printer=lines.append)
    model.online_train(_stream(), callbacks=[mon, _StopAt(10)], dataset_sink_mode=False)
    assert len(lines) == 2
    assert lines[0].startswith("step 5 | ") and "samples/s" in lines[0] and "loss " in lines[0]
    assert "auc " in lines[1]
    auc = float(lines[1].split("auc ")[1].split()[0])
    assert 0.5 < auc <= 1.0


# ---- train(sink_size): MindSpore's meaning ---------------------------------------------------------
@pytest.mark.slow
def test_train_in_sink_mode_takes_sink_size_batches_per_epoch_going_round_the_dataset(graph_mode, capsys):
    """5 batches, 3 epochs of sink_size=2: batches 0 1 | 2 3 | 4 0, as MindSpore's sink mode takes them."""
    data = list(_stream(n=5))
    order = [0, 1, 2, 3, 4, 0]
    ms.set_seed(0)
    ref_net = rb.WideDeep(DENSE, FIELDS, 4, (8,), vocab_size=VOCAB)
    cell = nn.TrainOneStepCell(_Loss(ref_net), nn.Adam(ref_net.trainable_params(), 0.01))
    bare = [float(cell(*map(Tensor, data[k])).asnumpy()) for k in order]
    net, model = _model()
    rec, params = _Losses(), _Params()
    model.train(3, data, callbacks=[rec, params], dataset_sink_mode=True, sink_size=2)
    assert rec.losses == bare and model.step == 6
    assert rec.events == ["begin"] + ["epoch_begin", "epoch_end"] * 3 + ["end"]
    assert [(s[3], s[4]) for s in params.seen] == [(2, 1), (2, 1), (2, 2), (2, 2), (2, 3), (2, 3)]
    for a, b in zip(net.trainable_params(), ref_net.trainable_params()):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    # sink_size=-1: the whole dataset per epoch; callbacks see its size as the epoch's steps
    net, model = _model()
    params = _Params()
    model.train(2, data, callbacks=params, dataset_sink_mode=True)
    assert model.step == 10 and [(s[3], s[4]) for s in params.seen] == [(5, 1)] * 5 + [(5, 2)] * 5
    assert "train: dataset sink mode is not supported on CPU" in capsys.readouterr().err


def test_train_sink_mode_needs_a_dataset_it_can_go_round(graph_mode):
    net, model = _model()
    with pytest.raises(ValueError, match="'train_dataset' must be a dataset that can be iterated again .* but got "
                                         "'a pass without batches'"):
        model.train(2, _stream(n=3), dataset_sink_mode=True, sink_size=2)
    assert model.step == 3                     # the steps before the end of the generator stay trained


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"sink_size": 4}, ValueError, r"'sink_size' must be -1 when 'dataset_sink_mode' is False .*, but got 4\."),
    ({"sink_size": 0, "dataset_sink_mode": True}, ValueError, "'sink_size' must be -1 or an int >= 1, but got 0"),
    ({"sink_size": -2, "dataset_sink_mode": True}, ValueError, "'sink_size' must be an int >= -1, but got -2"),
    ({"sink_size": 2.0, "dataset_sink_mode": True}, TypeError, "'sink_size' must be an int, but got 2.0"),
])
def test_train_bad_sink_size(kwargs, exc, match):
    net, model = _model()
    with pytest.raises(exc, match="For 'RecModel.train', " + match):
        model.train(1, list(_stream(n=2)), **kwargs)
    assert model.step == 0


# ---- eval_indexes: MindSpore's meaning -------------------------------------------------------------
class _EvalCell(nn.Cell):
    """An eval network returning (label, loss, probability): eval_indexes [1, 2, 0]."""

    def __init__(self, net):
        super().__init__()
        self.net, self.loss = net, nn.BCEWithLogitsLoss()

    def construct(self, dense, ids, label):
        logit = self.net(dense, ids)
        return label, self.loss(logit, label), ops.sigmoid(logit)


@pytest.mark.slow
def test_eval_indexes_pick_loss_prediction_and_label_of_the_eval_network(graph_mode):
    net, model = _model()
    model.online_train(_stream(), callbacks=_StopAt(10), dataset_sink_mode=False)
    data = list(_stream(seed=7, n=4))
    metrics = {"loss": ms.train.Loss(), "auc": rb.AUC(), "log_loss": rb.LogLoss()}
    evaluator = rb.RecModel(net, nn.BCEWithLogitsLoss(), metrics=metrics, eval_network=_EvalCell(net),
                            eval_indexes=[1, 2, 0])
    result = evaluator.eval(data)
    logits = [model.predict(d, i).asnumpy().astype(np.float64).ravel() for d, i, _ in data]
    labels = [y.ravel().astype(np.float64) for _, _, y in data]
    probs = np.concatenate([1 / (1 + np.exp(-z)) for z in logits])
    bce = [np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))) for z, y in zip(logits, labels)]
    assert result["auc"] == pytest.approx(rb.roc_auc(np.concatenate(labels), probs), abs=1e-3)   # float32 ties
    assert result["log_loss"] == pytest.approx(rb.log_loss(np.concatenate(labels), probs), rel=1e-5)
    assert result["loss"] == pytest.approx(np.mean(bce), rel=1e-5)
    # predict uses the network, not the (loss, prediction, label) eval network
    np.testing.assert_array_equal(evaluator.predict(data[0][0], data[0][1]).asnumpy().ravel(), logits[0])
    wrong = rb.RecModel(net, nn.BCEWithLogitsLoss(), metrics={"auc"}, eval_network=_EvalCell(net),
                        eval_indexes=[1, 3, 0])
    with pytest.raises(ValueError, match=r"For 'RecModel.eval', 'eval_indexes' of the RecModel must be positions "
                                         r"among the 3 outputs of 'eval_network', but got \[1, 3, 0\]"):
        wrong.eval(data)
    assert evaluator.eval(data, callbacks=[LossMonitor()]) == result    # a callback with no eval hook: as Model


@pytest.mark.slow
def test_load_checkpoint_in_the_same_process_is_seen_by_the_compiled_cells(ms_mode, tmp_path):
    """Loading a checkpoint into a model that has already trained and predicted must reach the cells
    it compiled (in PyNative mode they are mindspore.jit-compiled: a value swapped in with set_data
    would not be seen): predictions equal those at the save, and training again from the loaded
    state repeats the first run exactly."""
    ms.set_seed(0)
    net = nn.Dense(4, 1)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 0.05))
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((8, 4)).astype(np.float32), rng.integers(0, 2, (8, 1)).astype(np.float32))
               for _ in range(6)]
    x = batches[0][0]
    model.online_train(batches[:3], dataset_sink_mode=False)
    at_save = model.predict(x).asnumpy()
    path = model.save_checkpoint(str(tmp_path / "recboost-3.npz"))
    model.online_train(batches[3:], dataset_sink_mode=False)
    first_run = net.weight.asnumpy().copy()
    assert not np.array_equal(model.predict(x).asnumpy(), at_save)
    model.load_checkpoint(path)
    np.testing.assert_array_equal(model.predict(x).asnumpy(), at_save)
    model.online_train(batches[3:], dataset_sink_mode=False)
    np.testing.assert_array_equal(net.weight.asnumpy(), first_run)


@pytest.mark.parametrize("hidden, error, message", [
    (16, TypeError, r"'hidden' must be a list or tuple of layer sizes \(ints >= 1\), but got 16\."),
    (None, TypeError, r"'hidden' must be a list or tuple of layer sizes \(ints >= 1\), but got None\."),
    ("ab", TypeError, r"'hidden' must be a list or tuple of layer sizes \(ints >= 1\), but got 'ab'\."),
    ([8, 0], ValueError, r"'hidden\[1\]' must be an int >= 1, but got 0\."),
    ([16.5], TypeError, r"'hidden\[0\]' must be an int, but got 16.5\.")])
def test_widedeep_refuses_bad_layer_sizes_naming_them(hidden, error, message):
    """A layer size that is not a list of ints >= 1 is refused naming 'hidden' or the layer (an int was
    iterated: "'int' object is not iterable"; a string's characters were taken as sizes)."""
    with pytest.raises(error, match=r"For 'WideDeep', " + message):
        rb.WideDeep(vocab_size=100, hidden=hidden)
    assert [len(layer.weight.shape) for layer in rb.WideDeep(vocab_size=100, hidden=[8]).mlp.cells()
            if hasattr(layer, "weight")] == [2, 2]
