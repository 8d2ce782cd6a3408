"""Stand-in for mindrec's AUCMetric (our code, as mindrec_dcn's): update(*inputs) keeps inputs[1] (probabilities) and inputs[2]
(labels); eval is the rank AUC (mindrec uses sklearn's roc_auc_score) and prints it."""
import numpy as np
from mindspore.train import Metric


class AUCMetric(Metric):
    def __init__(self):
        super().__init__()
        self.clear()

    def clear(self):
        self.true_labels = []
        self.pred_probs = []

    def update(self, *inputs):
        self.pred_probs.extend(inputs[1].asnumpy().flatten().tolist())
        self.true_labels.extend(inputs[2].asnumpy().flatten().tolist())

    def eval(self):
        labels, probs = np.asarray(self.true_labels), np.asarray(self.pred_probs)
        order = np.argsort(probs, kind="mergesort")
        ranks = np.empty(len(probs))
        sorted_probs = probs[order]
        i = 0
        while i < len(probs):                       # average ranks over ties
            j = i
            while j + 1 < len(probs) and sorted_probs[j + 1] == sorted_probs[i]:
                j += 1
            ranks[order[i:j + 1]] = (i + j) / 2 + 1
            i = j + 1
        pos = labels == 1
        n_pos, n_neg = pos.sum(), (~pos).sum()
        auc = (ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
        print("auc: {!r}".format(float(auc)))
        return float(auc)
