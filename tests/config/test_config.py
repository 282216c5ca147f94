"""Bad configuration stops with an error that names the key and what is allowed."""

from dataclasses import replace

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
        (["--optim.grad_clip=-1"], ["optim.grad_clip must be >= 0, got -1"]),  # the range checks of fields.py
        (["--train.gc_every=-1"], ["train.gc_every must be >= 0, got -1"]),
        (["--model.moe.experts=4", "--model.moe.z_loss_coef=-1"], ["model.moe.z_loss_coef must be >= 0, got -1"]),
        (["--resilience.stop_timeout_s=0"], ["resilience.stop_timeout_s must be > 0, got 0"]),
        (["--resilience.max_step_rate=0"], ["resilience.max_step_rate must be > 0, got 0"]),
        (["--resilience.spares=-1"], ["resilience.spares must be >= 0, got -1"]),
        (["--resilience.max_node_faults=0"], ["resilience.max_node_faults must be >= 1, got 0"]),
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


@pytest.mark.slow  # trains a step from two directories
def test_the_packaged_default_is_used_from_any_directory(tmp_path, monkeypatch):
    """Run from elsewhere, `megascale train` reads the same default config (its SWA window)."""
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "megascale.cli", "train", "--train.steps", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert f"config {default_config_path()} (packaged default) with 1 override(s)" in done.stderr
    assert "config error: train.steps must be >= 1" in done.stderr
    assert load_config(default_config_path()).model.window == 128  # not the built-in full attention


def test_the_packaged_default_holds_only_what_differs_from_the_schema():
    """default.toml repeats no schema default, and the generated reference (in the doc and in
    --help) states exactly what `megascale train` runs differently from the keys it lists."""
    from pathlib import Path

    from megascale.config.help import _flatten, keys, markdown_reference, packaged_default_line
    from megascale.config.loader import tomllib  # tomli before Python 3.11

    written = _flatten(tomllib.loads(default_config_path().read_text()))
    defaults = {k.name: k.default for k in keys()}
    repeated = [k for k, v in written.items() if defaults[k] == v]
    assert not repeated, f"default.toml repeats the schema's defaults of {repeated}: drop them"
    line = packaged_default_line()
    assert all(f"`{k} = " in line for k in written) and line.count(" = ") == len(written)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert markdown_reference() in doc, "docs/configuration.md is stale: run python -m megascale.config.help"


def test_one_checkpoint_root(tmp_path):
    from megascale.config.operations import CheckpointConfig, checkpoint_root

    assert checkpoint_root(CheckpointConfig(), tmp_path / "run") == str(tmp_path / "run" / "checkpoints")
    assert checkpoint_root(CheckpointConfig(dir="s3://bucket/ck"), tmp_path) == "s3://bucket/ck"


def test_the_driver_edits_a_typed_validated_config():
    """An attempt's config is the job's, changed as a JobConfig and checked: a dp the job's batch
    cannot take fails in the driver, naming the key, instead of reaching the ranks as text."""
    from megascale.config.handoff import attempt_config, config_text
    from megascale.config.loader import config_from_toml

    job = load_config(
        None, ["--train.global_batch=8", "--train.micro_batch=2", "--parallel.redis_url=redis://:pw@h:1/0"]
    )
    cfg = config_from_toml(attempt_config(config_text(job), dp=2, run_dir="/r"), "attempt")
    assert (cfg.parallel.dp, cfg.train.run_dir, cfg.checkpoint.resume, cfg.checkpoint.save_on_signal) == (
        2,
        "/r",
        "auto",
        False,
    )
    assert cfg.model == job.model and "pw" not in cfg.parallel.redis_url
    with pytest.raises(ConfigError, match=r"train.global_batch=8 is 4 micro-batch.*fewer than parallel.dp=5"):
        attempt_config(config_text(job), dp=5, run_dir="/r")
    divide = replace(job, resilience=replace(job.resilience, shrink="divide"))
    with pytest.raises(ConfigError, match=r"train.global_batch=8 must be a multiple of .* parallel.dp"):
        attempt_config(config_text(divide), dp=3, run_dir="/r")


def test_an_attempt_is_checked_with_the_password_the_ranks_get_apart(monkeypatch):
    """The ranks' text has no Redis password (it travels as a file): the driver's check of an
    attempt counts the one it hands them, as the ranks' own check will."""
    from megascale.config.handoff import attempt_config, config_text

    for name in ("MEGASCALE_REDIS_PASSWORD", "MEGASCALE_REDIS_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)
    job = load_config(
        None,
        [
            "--parallel.store=redis",
            "--parallel.redis_start=true",
            "--parallel.redis_url=redis://:s3cret@10.0.0.1:6380/0",
        ],
    )
    text = config_text(job)
    assert "s3cret" not in attempt_config(text, dp=1, run_dir="/r", redis_password="s3cret")
    with pytest.raises(ConfigError, match="without a password"):
        attempt_config(text, dp=1, run_dir="/r")
