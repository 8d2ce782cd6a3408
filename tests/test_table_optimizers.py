"""Table optimizers with schedules (issue 39 item 2): a sparse optimizer's learning rate as nn.Adam takes it
(a float, a LearningRateSchedule, a per-step array), seen at the step MindSpore's global_step gives, kept
through checkpoints and compared on resume; a skipped step advances neither."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn

import recboost as rb
from test_reliability import _huge_step_is_skipped, _row_model

DIM = 4
ms.set_device("CPU")            # before any kernel runs: the graph-mode tests set it again

SCHEDULES = {
    "exponential": lambda: nn.ExponentialDecayLR(0.1, 0.9, 7),
    "exponential_stair": lambda: nn.ExponentialDecayLR(0.1, 0.5, 3, is_stair=True),
    "cosine": lambda: nn.CosineDecayLR(0.001, 0.1, 300),
    "polynomial": lambda: nn.PolynomialDecayLR(0.1, 0.01, 200, 0.5),
    "warmup": lambda: nn.WarmUpLR(0.1, 100),
    "inverse": lambda: nn.InverseDecayLR(0.1, 0.9, 10),
    "natural_exp": lambda: nn.NaturalExpDecayLR(0.1, 0.9, 10),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_schedule_gives_the_float32_value_mindspores_optimizer_uses_at_each_step(name):
    """``rate(step)`` is the schedule called on that step alone, as ``Optimizer.get_lr`` calls it on
    ``global_step`` (an int32 Tensor of shape [1]), bit for bit."""
    opt = rb.SparseAdam(SCHEDULES[name]())
    schedule = SCHEDULES[name]()
    for step in list(range(0, 12)) + list(range(250, 262)) + [511, 512, 1000]:
        want = np.float32(schedule(Tensor(np.int32([step]))).asnumpy().reshape(()))
        got = opt.rate(step)
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes(), (step, got, want)


def _one_row_each(emb, rng, ids):
    """One update of ``emb`` on ``ids`` (each once) with a random gradient; returns that gradient."""
    batch = emb.prepare(ids)
    emb.take(batch)
    grad = rng.standard_normal((ids.size, DIM)).astype(np.float32)
    emb.apply_gradients(batch, grad)
    return grad


@pytest.mark.parametrize("make", [rb.SparseAdam, rb.SparseSGD], ids=["adam", "sgd"])
def test_a_table_and_mindspores_dense_optimizer_decay_together(backend, make):
    """A table whose every row is touched once per step against MindSpore's dense nn.Adam / nn.SGD with the
    same ExponentialDecayLR on a Parameter of the same rows, given the same gradients: equal rows after each
    of 8 steps (a table that kept the schedule's first rate would be off by far more from the second step)."""
    vocab = 6
    ids = np.arange(100, 100 + vocab, dtype=np.int64)
    emb = rb.HashEmbedding(DIM, 16, optimizer=make(nn.ExponentialDecayLR(0.05, 0.5, 2)), seed=1, init_stddev=0.5)
    batch = emb.prepare(ids)
    emb.take(batch)
    weight = Parameter(Tensor(emb.weight[batch.rows].copy()), name="w")
    dense_cls = nn.Adam if make is rb.SparseAdam else nn.SGD
    dense = dense_cls([weight], learning_rate=nn.ExponentialDecayLR(0.05, 0.5, 2))
    rng = np.random.default_rng(0)
    for step in range(8):
        perm = rng.permutation(vocab)
        grad = _one_row_each(emb, rng, ids[perm])
        dense_grad = np.empty_like(grad)
        dense_grad[perm] = grad
        dense((Tensor(dense_grad),))
        assert int(dense.global_step.asnumpy()[0]) == emb.store.steps == step + 1
        np.testing.assert_allclose(emb.weight[emb.cache.find(ids)], weight.asnumpy(), rtol=1e-5, atol=1e-7)


def test_a_per_step_array_is_read_at_the_tables_step_and_ends_with_an_error(backend):
    """A per-step list: step k's update uses entry k (SGD: w -= lr_k * g exactly); the update after the last
    entry is refused naming learning_rate (MindSpore's gather fails there), and changes no row."""
    rates = [0.5, 0.25, 0.125]
    emb = rb.HashEmbedding(DIM, 16, optimizer=rb.SparseSGD(rates), seed=1, init_stddev=0.5)
    rng = np.random.default_rng(0)
    ids = np.array([7, 8], np.int64)
    for lr in rates:
        batch = emb.prepare(ids)
        emb.take(batch)
        before = emb.weight[batch.rows].copy()
        grad = rng.standard_normal((2, DIM)).astype(np.float32)
        emb.apply_gradients(batch, grad)
        np.testing.assert_array_equal(emb.weight[batch.rows], before - np.float32(lr) * grad)
    batch = emb.prepare(ids)
    emb.take(batch)
    before = emb.weight.copy()
    with pytest.raises(ValueError, match=r"For 'SparseSGD', 'learning_rate' \(a per-step array of 3 entries\) must "
                                         r"be an entry for every step \(steps 0 to 2\), but got 'step 3'"):
        emb.apply_gradients(batch, np.ones((2, DIM), np.float32))
    np.testing.assert_array_equal(emb.weight, before)
    assert emb.store.steps == 3


@pytest.mark.parametrize("bad", [[], [[0.1, 0.2]], [0.1, -0.1], [0.1, float("nan")], "fast"])
def test_a_bad_learning_rate_is_refused_naming_it(bad):
    with pytest.raises((ValueError, TypeError), match=r"For 'SparseAdagrad', 'learning_rate' must be "):
        rb.SparseAdagrad(bad)


def test_settings_record_the_schedule_and_a_resume_with_another_is_refused_or_logged(capfd):
    """``settings()`` records the schedule (its class and arguments) or the per-step array (length and
    digest); a state trained with one schedule is refused by a table with another (strict), and logged and
    loaded with strict=False."""
    opt = rb.SparseAdam(nn.ExponentialDecayLR(0.1, 0.9, 7))
    assert opt.settings()["learning_rate"] == {"schedule": "ExponentialDecayLR", "learning_rate": 0.1,
                                               "decay_rate": 0.9, "decay_steps": 7, "is_stair": False}
    per_step = rb.SparseSGD([0.1, 0.2]).settings()["learning_rate"]
    assert per_step["per_step"] == 2 and per_step != rb.SparseSGD([0.1, 0.3]).settings()["learning_rate"]
    assert rb.SparseSGD(0.1).settings() == {"learning_rate": 0.1}
    assert opt == rb.SparseAdam(nn.ExponentialDecayLR(0.1, 0.9, 7)) != rb.SparseAdam(nn.ExponentialDecayLR(0.1, 0.8, 7))
    emb = rb.HashEmbedding(DIM, 16, optimizer=opt, seed=1)
    _one_row_each(emb, np.random.default_rng(0), np.array([1, 2], np.int64))
    state = emb.state_dict()
    other = rb.HashEmbedding(DIM, 16, optimizer=rb.SparseAdam(nn.ExponentialDecayLR(0.1, 0.8, 7)), seed=1)
    with pytest.raises(ValueError, match=r"the setting 'optimizer_settings' of hash table"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)
    assert "goes on with optimizer_settings=" in capfd.readouterr().err and other.store.steps == 1


@pytest.mark.parametrize("row_dtype", ["float32", "bfloat16"])
def test_the_schedules_step_comes_back_with_a_state(backend, row_dtype):
    """Trained 3 steps, saved, trained 3 more: a table loaded from the save and trained on the same 3 batches
    ends bit for bit equal (its schedule resumes at step 3, not 0)."""
    make = lambda: rb.HashEmbedding(DIM, 32, optimizer=rb.SparseAdagrad(nn.ExponentialDecayLR(0.1, 0.5, 1)),
                                    seed=1, init_stddev=0.5, row_dtype=row_dtype)
    emb, rng = make(), np.random.default_rng(0)
    batches = [rng.integers(0, 10, 5) for _ in range(6)]
    grads = [rng.standard_normal((5, DIM)).astype(np.float32) for _ in range(6)]

    def train(table, part):
        for ids, grad in part:
            batch = table.prepare(ids)
            table.take(batch)
            table.apply_gradients(batch, grad)

    train(emb, list(zip(batches, grads))[:3])
    state = emb.state_dict()
    assert state["steps"] == 3
    train(emb, list(zip(batches, grads))[3:])
    resumed = make()
    resumed.load_state_dict(state)
    train(resumed, list(zip(batches, grads))[3:])
    np.testing.assert_array_equal(resumed.weight, emb.weight)
    np.testing.assert_array_equal(resumed.slots["accum"], emb.slots["accum"])
    fresh = make()
    fresh.load_state_dict(dict(state, steps=0))
    train(fresh, list(zip(batches, grads))[3:])
    assert not np.array_equal(fresh.weight, emb.weight)          # the step matters


def test_a_skipped_step_advances_neither_the_tables_step_nor_global_step(graph_mode, backend):
    """SparseFtrl with a schedule (its rate enters the update bound's divisor): a huge step is still skipped,
    and the table's step stays with the dense optimizer's global_step through the skip."""
    table, model, good = _row_model(rb.SparseFtrl(nn.ExponentialDecayLR(0.01, 0.5, 1)))
    _huge_step_is_skipped(table, model, good, np.float32(1e25))
    global_step = [p for p in model.state_parameters() if p.name.endswith("global_step")]
    assert len(global_step) == 1
    assert table.store.steps == int(global_step[0].asnumpy()[0]) == 3 and model.step == 4
