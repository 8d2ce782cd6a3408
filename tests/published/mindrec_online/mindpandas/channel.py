"""Stand-in for mindpandas.channel.DataReceiver: ``recv()`` returns the next chunk a producer sent (a numpy
object array of rows ``[ids, weights, [label]]``), or None when nothing has arrived yet. The producer
here is a seeded generator: every third call finds nothing, the others a chunk of 5 to 40 rows."""
import numpy as np


class DataReceiver:
    def __init__(self, address=None, namespace=None, dataset_name=None, shard_id=0, field_size=5, vocab=200):
        self._rng = np.random.default_rng(shard_id + 17)
        self._calls, self._field_size, self._vocab = 0, field_size, vocab

    def recv(self):
        self._calls += 1
        if self._calls % 3 == 0:
            return None
        rows = np.empty((int(self._rng.integers(5, 41)), 3), dtype=object)
        for row in rows:
            ids = self._rng.integers(0, self._vocab, self._field_size)
            row[0], row[1] = ids.tolist(), self._rng.random(self._field_size).tolist()
            row[2] = [float((ids[0] < self._vocab // 3) ^ (self._rng.random() < 0.1))]
        return rows
