"""Stand-in for mindrec's Wide&Deep config (its src/model_utils/config.py reads default_config.yaml, our code):
default_config.yaml's fields, with the values of its dynamic-embedding run script
(scripts/run_dynamic_embed_standalone_train_for_gpu.sh: --dynamic_embedding=True --sparse=True) at small sizes,
on CPU, for two epochs."""
import types

config = types.SimpleNamespace(
    device_target="CPU", data_path="./data", epochs=2, full_batch=False, batch_size=16, eval_batch_size=16,
    field_size=4, vocab_size=100, vocab_cache_size=0, emb_dim=8, deep_layer_dim=[32, 16, 16, 8],
    deep_layer_act="relu", keep_prob=1.0, dropout_flag=False, use_mixed_precision=True, ckpt_path="./ckpt",
    stra_ckpt="./checkpoints", eval_file_name="eval.log", loss_file_name="loss.log", dataset_type="mindrecord",
    parameter_server=0, field_slice=False, sparse=True, dynamic_embedding=True, deep_table_slice_mode="column_slice",
    weight_bias_init=["normal", "normal"], emb_init="normal", init_args=[-0.01, 0.01], l2_coef=8e-5,
    manual_shape=None)
