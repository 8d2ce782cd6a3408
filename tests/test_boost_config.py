"""AutoBoost configuration: presets, modes, precedence, defaults, errors, no shared state."""
import dataclasses
import json

import pytest
from mindspore import nn

import recboost as rb

SEED_DEFAULTS = {  # the seed's documented defaults (plus recboost's explicit seeds)
    "common": {"gradient_split_groups": [50, 100], "device_number": 8},
    "less_bn": {"fn_flag": True, "gc_flag": True},
    "grad_freeze": {"param_groups": 10, "freeze_type": 1, "freeze_p": 0.7, "total_steps": 65536, "seed": 0},
    "grad_accumulation": {"grad_accumulation_step": 1},
    "dim_reduce": {"rho": 0.55, "gamma": 0.9, "alpha": 0.001, "sigma": 0.4, "n_components": 32,
                   "pca_mat_path": None, "weight_load_dir": None, "timeout": 1800, "seed": 0},
}
ALGOS = ["less_bn", "grad_freeze", "adasum", "grad_accumulation", "dim_reduce", "loss_scale_group"]


def _on(boost):
    return sorted(k for k, v in boost.boost_config.items() if v)


def test_defaults_are_the_seeds():
    assert rb.AutoBoost().settings == SEED_DEFAULTS
    assert rb.AutoBoost("O2", {"grad_freeze": {"freeze_p": 0.5}}).settings["grad_freeze"]["total_steps"] == 65536


@pytest.mark.parametrize("level, expected", [("O0", []), ("O1", ["grad_freeze", "less_bn"]),
                                             ("O2", ["adasum", "grad_freeze", "less_bn"])])
def test_level_presets_as_mindspore_shows_them(level, expected):
    # MindSpore's presets: O1 = less_bn + grad_freeze, O2 = + adasum (boost_config shows the level's
    # flags; which algorithm runs is decided by the train step's precedence)
    assert _on(rb.AutoBoost(level)) == expected
    assert rb.AutoBoost(level).level == level


def test_modes():
    manual = lambda **kw: rb.AutoBoost("O0", {"boost": dict(mode="manual", **kw)})  # noqa: E731
    assert _on(manual(less_bn=True, adasum=True)) == ["adasum", "less_bn"]
    assert _on(manual(less_bn=True, grad_freeze=True, adasum=True)) == ["adasum", "grad_freeze", "less_bn"]
    assert _on(manual(grad_freeze=True, dim_reduce=True, grad_accumulation=True)) == \
        ["dim_reduce", "grad_accumulation", "grad_freeze"]
    assert _on(manual(grad_accumulation=True)) == ["grad_accumulation"]
    assert _on(rb.AutoBoost("O1", {"boost": {"mode": "manual", "grad_freeze": False}})) == ["less_bn"]
    assert _on(rb.AutoBoost("O0", {"boost": {"mode": "enable_all"}})) == sorted(ALGOS)
    assert _on(rb.AutoBoost("O2", {"boost": {"mode": "disable_all"}})) == []
    # auto ignores the per-algorithm flags (the level decides)
    assert _on(rb.AutoBoost("O0", {"boost": {"mode": "auto", "adasum": True}})) == []


def test_config_is_frozen_and_validated_once():
    boost = rb.AutoBoost("O1", {"grad_freeze": {"freeze_p": 0.5}})
    assert boost.config.grad_freeze.freeze_p == 0.5 and boost.config.enabled("less_bn")
    with pytest.raises(dataclasses.FrozenInstanceError):
        boost.config.grad_freeze.freeze_p = 0.9
    with pytest.raises(dataclasses.FrozenInstanceError):
        boost.config.flags = ()
    assert boost.config.common.gradient_split_groups == (50, 100)      # immutable inside the config
    assert boost.settings["common"]["gradient_split_groups"] == [50, 100]   # MindSpore's list view


def test_not_a_singleton_and_no_shared_presets():
    a, b = rb.AutoBoost("O1"), rb.AutoBoost("O0")
    assert _on(a) == ["grad_freeze", "less_bn"] and _on(b) == []
    a.settings["grad_freeze"]["freeze_p"] = 0.1
    a.settings["common"]["gradient_split_groups"].append(7)
    a.boost_config["adasum"] = True
    c = rb.AutoBoost("O1")
    assert c.settings == SEED_DEFAULTS and _on(c) == ["grad_freeze", "less_bn"]


def test_json_file_and_dict_are_equivalent(tmp_path):
    cfg = {"boost": {"mode": "manual", "grad_accumulation": True},
           "grad_accumulation": {"grad_accumulation_step": 4}, "common": {"device_number": 1}}
    path = tmp_path / "boost.json"
    path.write_text(json.dumps(cfg))
    from_file, from_dict = rb.AutoBoost("O0", str(path)), rb.AutoBoost("O0", cfg)
    assert from_file.settings == from_dict.settings and from_file.boost_config == from_dict.boost_config
    assert from_file.settings["grad_accumulation"]["grad_accumulation_step"] == 4
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be parsed"):
        rb.AutoBoost("O0", str(bad))
    with pytest.raises(ValueError, match="existing JSON file"):
        rb.AutoBoost("O0", str(tmp_path / "missing.json"))


@pytest.mark.parametrize("level, cfg, message", [
    ("O3", "", "For 'AutoBoost', 'level' must be one of ['O0', 'O1', 'O2'], but got 'O3'."),
    ("O1", {"boost": {"mode": "fast"}}, "For 'AutoBoost', 'boost.mode' must be one of "
                                        "['auto', 'manual', 'enable_all', 'disable_all'], but got 'fast'."),
    ("O1", {"boosts": {}}, "the section of 'boost_config_dict' must be one of"),
    ("O1", {"boost": {"less_bnn": True}}, "the key of section 'boost' must be one of"),
    ("O1", {"grad_freeze": {"freeze_q": 0.5}}, "the key of section 'grad_freeze' must be one of"),
    ("O1", {"grad_freeze": {"freeze_p": 1.0}}, "'grad_freeze.freeze_p' must be a number in [0, 1), but got 1.0"),
    ("O1", {"grad_freeze": {"freeze_type": 2}}, "'grad_freeze.freeze_type' must be an int <= 1, but got 2"),
    ("O1", {"dim_reduce": {"n_components": 0}}, "'dim_reduce.n_components' must be an int >= 1, but got 0"),
    ("O1", {"dim_reduce": {"rho": 0}}, "'dim_reduce.rho' must be a number in (0, 1], but got 0.0"),
    ("O1", {"dim_reduce": {"timeout": 0}}, "'dim_reduce.timeout' must be a number > 0, but got 0.0"),
])
def test_unknown_or_bad_values_are_named(level, cfg, message):
    with pytest.raises(ValueError) as err:
        rb.AutoBoost(level, cfg)
    assert message in str(err.value)


def test_bad_types():
    with pytest.raises(TypeError, match="'boost_config_dict' must be a dict"):
        rb.AutoBoost("O1", 42)
    with pytest.raises(TypeError, match="'boost.adasum' must be a bool"):
        rb.AutoBoost("O1", {"boost": {"mode": "manual", "adasum": 1}})
    with pytest.raises(TypeError, match="'less_bn.fn_flag' must be a bool, but got 'yes'"):
        rb.AutoBoost("O1", {"less_bn": {"fn_flag": "yes"}})
    with pytest.raises(TypeError, match=r"'common.gradient_split_groups\[1\]' must be an int"):
        rb.AutoBoost("O1", {"common": {"gradient_split_groups": [3, "x"]}})
    with pytest.raises(ValueError, match="'level' must be one of"):
        rb.AutoBoost(["O1"])
    # MindSpore's list(int) crashes; one split point is meant
    assert rb.AutoBoost("O1", {"common": {"gradient_split_groups": 3}}).settings["common"][
        "gradient_split_groups"] == [3]


def test_process_returns_network_and_optimizer():
    net = nn.WithLossCell(nn.Dense(4, 1), nn.MSELoss())
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    out_net, out_opt = rb.AutoBoost("O0").network_auto_process_train(net, opt)
    assert out_net is net and out_opt is opt
    boost = rb.AutoBoost("O1")      # MindSpore's O1: LessBN (with GC) and gradient freezing, both
    out_net, out_opt = boost.network_auto_process_train(net, opt)
    assert isinstance(out_net, rb.LessBN) and isinstance(out_opt, rb.FreezeOpt)
    assert out_opt._recboost_boost is boost
    assert isinstance(rb.AutoBoost("O1").network_auto_process_eval(net), rb.LessBN)
    assert rb.AutoBoost("O0").network_auto_process_eval(net) is net
    manual = rb.AutoBoost("O0", {"boost": {"mode": "manual", "less_bn": True}, "less_bn": {"gc_flag": False}})
    assert isinstance(manual.network_auto_process_eval(net), rb.LessBN)
    with pytest.raises(TypeError, match="'optimizer' must be a mindspore.nn.Optimizer"):
        boost.network_auto_process_train(net, None)


def test_a_recmodel_checks_its_boost_config_when_it_is_made():
    """As Model, which builds its train network when it is made: a bad boost_config_dict is refused by
    RecModel(...) itself, before a batch's ids reach a table (it was refused at the first step, after the
    prefetcher had admitted the ids)."""
    net = rb.WideDeep(4, 6, 8, (16,), embedding=rb.HashEmbedding(9, 64, input_index=1, seed=0, name="t"))
    for config, message in (({"grad_freeze": {"freeze_p": 1.0}}, r"'grad_freeze.freeze_p' must be a number in "
                                                                 r"\[0, 1\), but got 1.0"),
                            ("missing.json", "existing JSON file")):
        with pytest.raises(ValueError, match=message):
            rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params()), boost_level="O1",
                        boost_config_dict=config)
    rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params()), boost_level="O1",
                boost_config_dict={"grad_freeze": {"freeze_p": 0.5}})
