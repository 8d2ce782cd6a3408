"""Metrics: exact AUC (ties as Mann-Whitney halves), log loss, accuracy, MindSpore protocol."""
import itertools
import warnings

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn

import recboost


def _pairwise_auc(labels, scores):
    """Brute force: over every (positive, negative) pair, 1 if the positive scores higher, 1/2 on a tie."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    total = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return total / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(8))
def test_roc_auc_matches_pairwise_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 60))
    labels = rng.integers(0, 2, n)
    labels[:2] = [0, 1]
    scores = np.round(rng.random(n), 1)          # one decimal: many ties, also across classes
    assert recboost.roc_auc(labels, scores) == pytest.approx(_pairwise_auc(labels, scores), abs=1e-12)


def test_roc_auc_known_values():
    assert recboost.roc_auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == pytest.approx(0.75)
    assert recboost.roc_auc([0, 1], [0.5, 0.5]) == 0.5
    assert recboost.roc_auc([1, 0], [0.9, 0.1]) == 1.0
    assert recboost.roc_auc([1, 0], [0.1, 0.9]) == 0.0
    # logits and probabilities rank the same
    z = np.linspace(-3, 3, 13)
    y = (np.arange(13) % 3 == 0).astype(int)
    assert recboost.roc_auc(y, z) == recboost.roc_auc(y, 1 / (1 + np.exp(-z)))


def test_streaming_auc_is_exact_across_merges():
    rng = np.random.default_rng(0)
    n = 300_000                                   # several internal merges (threshold 65536)
    labels = (rng.random(n) < 0.3).astype(np.float32)
    scores = np.round(rng.random(n) * 0.5 + labels * 0.2, 4).astype(np.float32)
    metric = recboost.AUC()
    for lo in range(0, n, 7919):
        metric.update(Tensor(scores[lo:lo + 7919].reshape(-1, 1)), labels[lo:lo + 7919].reshape(-1, 1))
    # reference: Mann-Whitney U from average ranks (a formula independent of the count merge)
    _, inverse, counts = np.unique(scores.astype(np.float64), return_inverse=True, return_counts=True)
    first_rank = np.cumsum(counts) - counts + 1
    avg_rank = (first_rank + (counts - 1) / 2.0)[inverse]
    n_pos, n_neg = labels.sum(), n - labels.sum()
    u = avg_rank[labels == 1].sum() - n_pos * (n_pos + 1) / 2
    assert metric.eval() == pytest.approx(u / (n_pos * n_neg), abs=1e-12)
    assert metric._values.size <= 10_001          # memory follows distinct scores, not samples
    metric.clear()
    with pytest.raises(RuntimeError, match="at least one sample"):
        metric.eval()


def test_auc_single_class_and_bad_inputs():
    with pytest.raises(ValueError, match="only one class"):
        recboost.roc_auc([1, 1, 1], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="'roc_auc', the labels must be 0 or 1, but got \\[2"):
        recboost.roc_auc([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="the scores must be finite"):
        recboost.roc_auc([0, 1], [0.1, np.nan])
    with pytest.raises(ValueError, match="the number of scores and labels must be equal"):
        recboost.roc_auc([0, 1, 1], [0.1, 0.2])
    with pytest.raises(ValueError, match="'AUC.update', the inputs must be \\(scores, labels\\)"):
        recboost.AUC().update([0.1])


def test_log_loss_matches_formula_and_clips():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 500)
    p = rng.random(500)
    expect = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert recboost.log_loss(y, p) == pytest.approx(expect, rel=1e-12)
    assert recboost.log_loss([1, 0], [0.0, 1.0]) == pytest.approx(-np.log(1e-7), rel=1e-9)
    metric = recboost.LogLoss()
    for lo in range(0, 500, 64):
        metric.update(p[lo:lo + 64], y[lo:lo + 64])
    assert metric.eval() == pytest.approx(expect, rel=1e-12)
    logits = np.log(p / (1 - p))
    assert recboost.LogLoss(from_logits=True)(logits, y) == pytest.approx(expect, rel=1e-9)
    with warnings.catch_warnings():                 # logits exp overflows on: probabilities 0 and 1, no warning
        warnings.simplefilter("error")
        assert recboost.LogLoss(from_logits=True)(np.array([-1e39, 1e39]), np.array([0, 1])) == \
            pytest.approx(-np.log(1 - 1e-7), rel=1e-9)
    with pytest.raises(RuntimeError):
        recboost.LogLoss().eval()
    with pytest.raises(ValueError, match=r"'eps' must be a number in \(0.0, 0.5\], but got 0.0"):
        recboost.LogLoss(eps=0)


def test_accuracy_threshold_and_logits():
    metric = recboost.Accuracy()
    metric.update(np.array([0.5, 0.49, 0.9, 0.1]), np.array([1, 1, 0, 0]))
    assert metric.eval() == 0.5                   # 0.5 counts as positive
    metric.update([[0.7]], [[1]])
    assert metric.eval() == pytest.approx(3 / 5)
    assert recboost.Accuracy(from_logits=True)(np.array([0.0, -0.1, 3.0]), np.array([1, 0, 0])) \
        == pytest.approx(2 / 3)
    assert recboost.Accuracy(threshold=0.95)([0.9, 0.96], [1, 1]) == 0.5


def test_metrics_are_mindspore_metrics_with_indexes():
    for cls in (recboost.AUC, recboost.LogLoss, recboost.Accuracy):
        assert isinstance(cls(), ms.train.Metric)
    metric = recboost.AUC().set_indexes([1, 2])
    metric.update(np.zeros(4), np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]))
    assert metric.eval() == pytest.approx(0.75)


def test_metrics_in_model_eval(graph_mode):
    """The metrics plug into mindspore.train.Model unchanged."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 4)).astype(np.float32)
    w = np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)
    y = (x @ w + 0.3 * rng.standard_normal((256, 1)) > 0).astype(np.float32)
    net = nn.SequentialCell([nn.Dense(4, 1, weight_init=Tensor(w.T), bias_init="zeros"), nn.Sigmoid()])
    model = ms.train.Model(net, loss_fn=nn.BCELoss(reduction="mean"),
                           metrics={"auc": recboost.AUC(), "logloss": recboost.LogLoss(),
                                    "acc": recboost.Accuracy()})
    ds = ms.dataset.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(64)
    res = model.eval(ds, dataset_sink_mode=False)
    p = 1 / (1 + np.exp(-(x @ w)))
    assert res["auc"] == pytest.approx(recboost.roc_auc(y, p), abs=1e-6)
    assert res["logloss"] == pytest.approx(recboost.log_loss(y, p), rel=1e-5)
    assert res["acc"] == pytest.approx(np.mean((p >= 0.5) == (y == 1)), abs=1e-9)
