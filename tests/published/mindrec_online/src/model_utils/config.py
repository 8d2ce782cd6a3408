"""Stand-in for the online example's config (its src/model_utils/config.py reads default_config.yaml):
the fields the script and the stand-in network read, at small sizes. ``stop_after_steps``: see
src/callbacks.py."""
import types

config = types.SimpleNamespace(
    device_target="CPU", address="127.0.0.1", namespace="demo", dataset_name="criteo", batch_size=8,
    field_size=5, vocab_size=200, emb_dim=4, deep_layer_dim=[8, 8, 8, 8], deep_layer_act="relu",
    weight_bias_init=["normal", "normal"], emb_init="normal", init_args=[-0.01, 0.01], l2_coef=8e-5,
    dropout_flag=False, use_mixed_precision=False, sparse=False, parameter_server=0, vocab_cache_size=0,
    loss_file_name="loss.log", stop_after_steps=100)
