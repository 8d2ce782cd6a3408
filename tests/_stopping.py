"""Stop callbacks for tests. ``StopAfter``: a stop after a number of steps. Runs that stop mid-stream
compare alike: the stop's pause of the prefetch thread waits until it holds its full depth of prepared
batches (``_Prefetcher.pause``), so the batches whose ids are counted do not depend on the load."""

from mindspore.train.callback import Callback


class StopAfter(Callback):
    """Request a stop once the model's step count reaches ``steps`` (MindSpore's public Callback)."""

    def __init__(self, steps):
        self.steps = steps

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num >= self.steps:
            run_context.request_stop()
