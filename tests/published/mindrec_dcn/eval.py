"""Evaluate DCN: mindrec's models/deep_and_cross/eval.py, in its shape (the checkpoint loaded into the
eval network; Model(train_net, eval_network=eval_net, metrics={"auc": ...}).eval(ds, callbacks=EvalCallBack))."""
from mindspore import Model, context
from mindspore.train.serialization import load_checkpoint, load_param_into_net
from src.deep_and_cross import PredictWithSigmoid, TrainStepWrap, NetWithLossClass, DeepCrossModel
from src.callbacks import EvalCallBack
from src.datasets import create_dataset, DataType
from src.metrics import AUCMetric
from src.config import DeepCrossConfig


def get_DCN_net(configure):
    DCN_net = DeepCrossModel(configure)
    loss_net = NetWithLossClass(DCN_net)
    train_net = TrainStepWrap(loss_net)
    eval_net = PredictWithSigmoid(DCN_net)
    return train_net, eval_net


def test_eval(configure):
    ds_eval = create_dataset(configure.data_path, train_mode=False, epochs=1, batch_size=configure.batch_size,
                             data_type=DataType.MINDRECORD, target_column=configure.field_size + 1)
    print("ds_eval.size: {}".format(ds_eval.get_dataset_size()))
    train_net, eval_net = get_DCN_net(configure)
    param_dict = load_checkpoint(configure.ckpt_path)
    load_param_into_net(eval_net, param_dict)
    auc_metric = AUCMetric()
    model = Model(train_net, eval_network=eval_net, metrics={"auc": auc_metric})
    eval_callback = EvalCallBack(model, ds_eval, auc_metric, configure)
    model.eval(ds_eval, callbacks=eval_callback)


if __name__ == "__main__":
    config = DeepCrossConfig()
    config.argparse_init()
    context.set_context(mode=context.GRAPH_MODE, device_target=config.device_target)
    test_eval(config)
