"""Bad configuration stops with an error that names the key and what is allowed."""

import pytest

from megascale.config import ConfigError, JobConfig, default_config_path, dump_config, load_config


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
        (["--optim.lr=-0.1"], ["optim.lr"]),
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
    cfg = load_config(default_config_path(), ["--model.layers=8", "--model.window=none", "--optim.lr=1e-3"])
    assert cfg.model.layers == 8 and cfg.model.window is None and cfg.optim.lr == 1e-3
    path = tmp_path / "resolved.toml"
    dump_config(cfg, path)
    assert load_config(path) == cfg


def test_shipped_configs_are_valid():
    assert isinstance(load_config(default_config_path()), JobConfig)
    big = load_config("configs/gpt-175b.toml")
    assert big.model.layers == 96 and big.model.hidden == 12288


def test_every_key_has_a_description_and_is_documented():
    from pathlib import Path

    from megascale.config.help import keys

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    undocumented = [k.name for k in keys() if not k.doc]
    assert not undocumented, f"give these fields a description (schema.opt): {undocumented}"
    missing = [k.name for k in keys() if f"`{k.name}`" not in doc]
    assert not missing, f"docs/configuration.md lacks {missing}: regenerate with python -m megascale.config.help"


def test_help_lists_every_key_and_one_section(capsys):
    from megascale.cli import main
    from megascale.config.help import keys

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--nproc" in out and all(f"--{k.name} " in out for k in keys())
    assert main(["train", "--help", "optim"]) == 0
    out = capsys.readouterr().out
    assert "--optim.lr float  (default 0.002)" in out and "--model.layers int" not in out
    assert main(["launch", "--help", "nosuch"]) == 0
    assert "unknown section 'nosuch'" in capsys.readouterr().out


def test_overrides_in_both_forms():
    from megascale.cli import split_overrides

    overrides, leftover = split_overrides(["--model.layers", "2", "--optim.lr=1e-3", "--train.seed", "-1", "stray"])
    assert overrides == ["--model.layers=2", "--optim.lr=1e-3", "--train.seed=-1"] and leftover == ["stray"]
    cfg = load_config(None, overrides)
    assert (cfg.model.layers, cfg.optim.lr, cfg.train.seed) == (2, 1e-3, -1)


def test_the_packaged_default_is_used_from_any_directory(tmp_path, monkeypatch):
    """Run from elsewhere, `megascale train` reads the same default config (its SWA window)."""
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    done = subprocess.run([sys.executable, "-m", "megascale.cli", "train", "--train.steps", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"config {default_config_path()} (packaged default) with 1 override(s)" in done.stderr
    assert "config error: train.steps must be >= 1" in done.stderr
    assert load_config(default_config_path()).model.window == 128  # not the built-in full attention
