"""Train DCN: mindrec's models/deep_and_cross/train.py, in its shape (a complete train cell given to Model
with no optimizer; TimeMonitor, a loss callback and ModelCheckpoint)."""
from mindspore import Model, context
from mindspore.train.callback import ModelCheckpoint, CheckpointConfig, TimeMonitor
from src.deep_and_cross import PredictWithSigmoid, TrainStepWrap, NetWithLossClass, DeepCrossModel
from src.callbacks import LossCallBack
from src.datasets import create_dataset, DataType
from src.config import DeepCrossConfig


def get_DCN_net(configure):
    DCN_net = DeepCrossModel(configure)
    loss_net = NetWithLossClass(DCN_net)
    train_net = TrainStepWrap(loss_net)
    eval_net = PredictWithSigmoid(DCN_net)
    return train_net, eval_net


def test_train(configure):
    context.set_context(mode=context.GRAPH_MODE, device_target=configure.device_target,
                        device_id=configure.device_id)
    ds_train = create_dataset(configure.data_path, train_mode=True, epochs=1, batch_size=configure.batch_size,
                              data_type=DataType.MINDRECORD, target_column=configure.field_size + 1)
    print("ds_train.size: {}".format(ds_train.get_dataset_size()))
    train_net, _ = get_DCN_net(configure)
    train_net.set_train()
    model = Model(train_net)
    callback = LossCallBack(config=configure)
    ckptconfig = CheckpointConfig(save_checkpoint_steps=ds_train.get_dataset_size(), keep_checkpoint_max=5)
    ckpoint_cb = ModelCheckpoint(prefix='deepcross_train', directory=configure.ckpt_path, config=ckptconfig)
    model.train(configure.epochs, ds_train,
                callbacks=[TimeMonitor(ds_train.get_dataset_size()), callback, ckpoint_cb])


if __name__ == "__main__":
    config = DeepCrossConfig()
    config.argparse_init()
    test_train(config)
