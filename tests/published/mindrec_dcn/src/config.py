"""Stand-in for mindrec's DCN config: the fields its scripts read, small sizes, argparse flags."""
import argparse


class DeepCrossConfig:
    def __init__(self):
        self.device_target = "CPU"
        self.device_id = 0
        self.is_distributed = False
        self.data_path = "./data"
        self.dataset_type = "mindrecord"
        self.batch_size = 16
        self.field_size = 6
        self.vocab_size = 120
        self.emb_dim = 4
        self.deep_layer_dim = [8, 8]
        self.cross_layer_num = 3
        self.keep_prob = 1.0
        self.epochs = 1
        self.ckpt_path = "./ckpt"
        self.eval_file_name = "./auc.log"
        self.loss_file_name = "./loss.log"

    def argparse_init(self):
        parser = argparse.ArgumentParser()
        for name in ("data_path", "ckpt_path", "eval_file_name", "loss_file_name", "device_target"):
            parser.add_argument("--" + name, default=getattr(self, name))
        args, _ = parser.parse_known_args()
        self.__dict__.update(vars(args))
