"""Online training: mindrec's examples/online_learning/online_train.py, in its shape (a streaming
dataset fed by a mindpandas DataReceiver; RecModel(train_net).online_train(dataset, callbacks=[TimeMonitor,
LossCallBack, ModelCheckpoint], dataset_sink_mode=True))."""
from mindspore import context
from mindspore_rec import RecModel as Model
from src.wide_and_deep import PredictWithSigmoid, TrainStepWrap, NetWithLossClass, WideDeepModel
from src.callbacks import LossCallBack
from src.model_utils.config import config

import numpy as np
import mindpandas as mpd
import mindspore.dataset as ds
from mindpandas.channel import DataReceiver
from mindspore.train.callback import ModelCheckpoint, CheckpointConfig, TimeMonitor


class StreamingDataset:
    def __init__(self, receiver):
        self.data_ = []
        self.receiver_ = receiver

    def __getitem__(self, item):
        while not self.data_:
            data = self.receiver_.recv()
            if data is not None:
                self.data_ = data.tolist()
        last_row = self.data_.pop()
        return (np.array(last_row[0], dtype=np.int32), np.array(last_row[1], dtype=np.float32),
                np.array(last_row[2], dtype=np.float32))

    def __len__(self):
        return 2**20 - 1


def GetWideDeepNet(configure):
    WideDeep_net = WideDeepModel(configure)
    loss_net = NetWithLossClass(WideDeep_net, configure)
    train_net = TrainStepWrap(loss_net)
    eval_net = PredictWithSigmoid(WideDeep_net)
    return train_net, eval_net


if __name__ == '__main__':
    context.set_context(mode=context.GRAPH_MODE, device_target=config.device_target)

    receiver = DataReceiver(address=config.address, namespace=config.namespace,
                            dataset_name=config.dataset_name, shard_id=0)
    stream_dataset = StreamingDataset(receiver)

    dataset = ds.GeneratorDataset(stream_dataset, column_names=["id", "weight", "label"])
    dataset = dataset.batch(config.batch_size)

    train_net, _ = GetWideDeepNet(config)
    train_net.set_train()

    model = Model(train_net)
    callback = LossCallBack(config=config)

    ckptconfig = CheckpointConfig(save_checkpoint_steps=100, keep_checkpoint_max=5)
    ckpoint_cb = ModelCheckpoint(prefix='widedeep_train', directory="./ckpt", config=ckptconfig)

    model.online_train(dataset, callbacks=[TimeMonitor(1), callback, ckpoint_cb], dataset_sink_mode=True)
