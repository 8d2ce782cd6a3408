"""Stop callbacks for tests. ``StopAfter``: a stop after a number of steps. ``StopWithPrepared``, for
tests that compare runs which stop mid-stream: the prefetch thread prepares batches ahead on its own
thread (their ids are counted when prepared), so how many it holds when a callback stops the run
depends on the machine's load. Stopping only once it holds its full depth makes every such run
consume the same batches."""
import time

from mindspore.train.callback import Callback


class StopAfter(Callback):
    """Request a stop once the model's step count reaches ``steps`` (MindSpore's public Callback)."""

    def __init__(self, steps):
        self.steps = steps

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num >= self.steps:
            run_context.request_stop()


class StopWithPrepared(StopAfter):
    """Stop after ``steps`` steps, once ``model``'s prefetch thread holds its full depth of prepared
    batches (waits up to 30 s; the stream must go on that far)."""

    def __init__(self, steps, model):
        super().__init__(steps)
        self.model = model

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num >= self.steps:
            deadline = time.monotonic() + 30
            while len(self.model._prefetcher._items) < self.model._prefetch_depth and time.monotonic() < deadline:
                time.sleep(0.01)
        super().on_train_step_end(run_context)
