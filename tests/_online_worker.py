"""Child process for the crash tests: online training with checkpoints, resumable.

    python tests/_online_worker.py CKPT_DIR OUT_FILE TOTAL_STEPS [--slow-writes] [--background]

Resumes from the latest checkpoint in CKPT_DIR when there is one, trains to TOTAL_STEPS on the
deterministic stream of test_recmodel, checkpointing every 2 steps, prints "step N" after each step
(the harness kills it at random moments), and at the end writes the parameters to OUT_FILE.
``--slow-writes`` makes each checkpoint write take longer, so kills land inside writes too.
``--background`` writes them in the background (``OnlineCheckpoint(background=True)``), each slowed
longer: the steps go on during most of the run's writes.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import mindspore as ms  # noqa: E402
from mindspore.train.callback import Callback  # noqa: E402

import recboost as rb  # noqa: E402
from test_recmodel import _model, _stream  # noqa: E402


class _Report(Callback):
    def __init__(self, total):
        self.total = total

    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        print("step %d" % step, flush=True)
        if step >= self.total:
            run_context.request_stop()


def main():
    ckpt_dir, out_file, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    background = "--background" in sys.argv
    if "--slow-writes" in sys.argv:
        real_write = rb._write_checkpoint_file

        def slow_write(fh, manifest, arrays):
            real_write(fh, manifest, arrays)
            fh.flush()
            time.sleep(0.2 if background else 0.05)        # a kill now leaves a half-finished temporary file
        rb._write_checkpoint_file = slow_write
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    net, model = _model()
    os.makedirs(ckpt_dir, exist_ok=True)
    resume = ckpt_dir if rb.latest_checkpoint(ckpt_dir) else None
    if resume:
        print("resume %s" % rb.latest_checkpoint(ckpt_dir), flush=True)
    if model.step < total:
        model.online_train(_stream(), callbacks=[rb.OnlineCheckpoint(ckpt_dir, every_steps=2, keep=2,
                                                                     background=background),
                                                 _Report(total)],
                           dataset_sink_mode=False, resume_from=resume)
    if resume and model.step == 0:
        raise SystemExit("resume did not restore the step")
    params = {p.name: p.asnumpy() for p in net.trainable_params()}
    rb._atomic_write(out_file, lambda fh: np.savez(fh, **params))
    print("done %d" % model.step, flush=True)


if __name__ == "__main__":
    main()
