"""Worker of tests/test_tables_dist.py's resharding and failure tests, launched by msrun (2 ranks, CPU).

(The 1 -> 2 resume runs in tests/_tables_dist_worker.py's launch, ``--resume``.)
``<out> kill [row_wise]``: the ranks train their halves with an OnlineCheckpoint (every 2 steps): one
directory per rank (``<out>/kill_<r>``) for data-parallel tables, one for both (``<out>/kill_row_wise``,
rank 0 writes the manifests and keeps only the last, with its parts) for row-wise ones; rank 1 kills itself (SIGKILL) at the end of step 5.
The job must end, not hang, and the last checkpoint must load in one process (2 -> 1 ranks): the
test checks both. ``<out> stall``: the same, but rank 1 stalls (sleeps 10 minutes) instead of dying:
rank 0's exchange watchdog (``RECBOOST_EXCHANGE_TIMEOUT``) must end it.
"""
import os
import signal
import sys
import time

import mindspore as ms
from mindspore.train.callback import Callback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _tables_dist_worker as worker  # noqa: E402
from _dist import init_data_parallel  # noqa: E402
import recboost as rb  # noqa: E402

KILL_STEP = 5


class _Die(Callback):
    """Rank 1 dies without a word at the end of step KILL_STEP (or, ``stall``, sleeps for 10 minutes)."""

    def __init__(self, stall=False):
        self.stall = stall

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == KILL_STEP:
            if self.stall:
                time.sleep(600)
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    out_dir, mode = sys.argv[1], sys.argv[2]
    sharding = sys.argv[-1] if sys.argv[-1] == "row_wise" else None
    rank, size = init_data_parallel()
    table, model, hook = worker.make_model(sharding)
    batches = worker.global_batches()
    directory = os.path.join(out_dir, "kill_row_wise" if sharding else "kill_%d" % rank)
    ckpt = rb.OnlineCheckpoint(directory, every_steps=2, keep=1 if sharding else 2, save_on_end=False)
    callbacks = [hook, ckpt] + ([_Die(mode == "stall")] if rank == 1 else [])
    model.train(1, [worker.half(b, rank) for b in batches], callbacks=callbacks)


if __name__ == "__main__":
    main()
