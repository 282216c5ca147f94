"""Bad configuration stops with an error that names the key and what is allowed."""

import pytest

from megascale.config import ConfigError, JobConfig, dump_config, load_config


def _error(overrides, path=None):
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["--model.heads=5"], ["model.heads", "model.hidden"]),  # heads must divide hidden
        (["--model.window=0"], ["model.window"]),
        (["--model.window=-3"], ["model.window"]),
        (["--model.layers=0"], ["model.layers"]),
        (["--model.laers=4"], ["model.laers", "layers"]),  # unknown key, allowed keys listed
        (["--model.layers=four"], ["model.layers", "int"]),  # wrong type
        (["--model.layers=2.5"], ["model.layers", "int"]),
        (["--model.block=diagonal"], ["model.block", "serial", "parallel"]),
        (["--optim.name=sgd"], ["optim.name", "lamb", "adamw"]),
        (["--optim.lr=0"], ["optim.lr"]),
        (["--optim.beta2=1.5"], ["optim.beta2"]),
        (["--train.global_batch=10", "--train.micro_batch=4"], ["train.global_batch", "train.micro_batch"]),
        (["--parallel.tp=3"], ["parallel.tp", "model.heads"]),
        (["--model.layers=3", "--parallel.pp=2", "--parallel.pp_split=even"], ["model.layers", "parallel.pp"]),
        (["--model.layers=1", "--parallel.pp=2"], ["model.layers", "pipeline chunks"]),
        (["--model.layers=4", "--parallel.pp=2", "--parallel.pp_split=[1,2]"], ["parallel.pp_split", "model.layers=4"]),
        (["--parallel.vpp=2"], ["parallel.vpp", "parallel.pp"]),
        (["--nosection.key=1"], ["nosection"]),
        (["model.layers"], ["--section.key=value"]),
    ],
)
def test_bad_values_name_the_key(overrides, names):
    message = _error(overrides)
    for name in names:
        assert name in message, (name, message)


def test_toml_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model\nlayers = 2\n")
    assert "bad.toml" in _error([], path)
    assert "does not exist" in _error([], tmp_path / "missing.toml")


def test_overrides_and_round_trip(tmp_path):
    cfg = load_config("configs/default.toml", ["--model.layers=8", "--model.window=none", "--optim.lr=1e-3"])
    assert cfg.model.layers == 8 and cfg.model.window is None and cfg.optim.lr == 1e-3
    path = tmp_path / "resolved.toml"
    dump_config(cfg, path)
    assert load_config(path) == cfg


def test_shipped_configs_are_valid():
    assert isinstance(load_config("configs/default.toml"), JobConfig)
    big = load_config("configs/gpt-175b.toml")
    assert big.model.layers == 96 and big.model.hidden == 12288
