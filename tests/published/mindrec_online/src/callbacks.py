"""Stand-in for the online example's LossCallBack: old-style ``step_end`` writing the wide and deep losses
(``net_outputs[0]``, ``[1]``) with the epoch and the step in it (``batch_num``). The stand-in's one
addition: it asks to stop after ``config.stop_after_steps`` steps, so a test ends the endless stream (the
published script runs until it is killed)."""
from mindspore.train.callback import Callback


class LossCallBack(Callback):
    def __init__(self, config=None, per_print_times=1):
        super().__init__()
        self._per_print_times = per_print_times
        self.config = config

    def step_end(self, run_context):
        cb_params = run_context.original_args()
        if cb_params.net_outputs is None:
            return
        wide_loss, deep_loss = cb_params.net_outputs[0].asnumpy(), cb_params.net_outputs[1].asnumpy()
        cur_step_in_epoch = (cb_params.cur_step_num - 1) % cb_params.batch_num + 1
        cur_num = cb_params.cur_step_num
        if self._per_print_times != 0 and cur_num % self._per_print_times == 0 and self.config is not None:
            with open(self.config.loss_file_name, "a+") as loss_file:
                loss_file.write("epoch: %s, step: %s, wide_loss: %r, deep_loss: %r\n" % (
                    cb_params.cur_epoch_num, cur_step_in_epoch, float(wide_loss), float(deep_loss)))
        if self.config is not None and cur_num >= self.config.stop_after_steps:
            run_context.request_stop()
