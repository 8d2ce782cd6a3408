"""Stand-ins for mindrec's Wide&Deep callbacks (our code), with the same hooks: LossCallBack's old-style
``step_end`` writes the wide and deep losses (``net_outputs[0]``, ``[1]``); EvalCallBack's ``epoch_end``
clears the AUC metric and runs ``model.eval`` again, writing what it returns."""
from mindspore.train.callback import Callback


def add_write(file_path, out_str):
    with open(file_path, "a+", encoding="utf-8") as file_out:
        file_out.write(out_str + "\n")


class LossCallBack(Callback):
    def __init__(self, config=None, per_print_times=1):
        super().__init__()
        self._per_print_times = per_print_times
        self.config = config

    def step_end(self, run_context):
        cb_params = run_context.original_args()
        wide_loss, deep_loss = cb_params.net_outputs[0].asnumpy(), cb_params.net_outputs[1].asnumpy()
        cur_step_in_epoch = (cb_params.cur_step_num - 1) % cb_params.batch_num + 1
        if self.config is not None and cb_params.cur_step_num % self._per_print_times == 0:
            add_write(self.config.loss_file_name, "epoch: %s, step: %s, wide_loss: %r, deep_loss: %r" % (
                cb_params.cur_epoch_num, cur_step_in_epoch, float(wide_loss), float(deep_loss)))


class EvalCallBack(Callback):
    def __init__(self, model, eval_dataset, auc_metric, config, print_per_step=1, host_device_mix=False):
        super().__init__()
        self.model = model
        self.eval_dataset = eval_dataset
        self.aucMetric = auc_metric
        self.aucMetric.clear()
        self.eval_file_name = config.eval_file_name
        self.host_device_mix = host_device_mix

    def epoch_end(self, run_context):
        self.aucMetric.clear()
        out = self.model.eval(self.eval_dataset, dataset_sink_mode=(not self.host_device_mix))
        add_write(self.eval_file_name, "EvalCallBack model.eval(): {!r}".format(list(out.values())))
