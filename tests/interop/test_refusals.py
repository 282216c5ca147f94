"""What megascale cannot import is refused in one line naming it, before any weight is read or
any rank starts; `megascale import` writes the config that `megascale train` accepts."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megascale.cli import main
from megascale.config import load_config
from megascale.interop.hf_files import InteropError
from megascale.interop.pretrained import Pretrained, load_pretrained
from tests.data.conftest import make_docs, write_bytes_dataset
from tests.interop.conftest import CASES, COMMON, random_hf_model, saved

SMALL = dict(COMMON, num_hidden_layers=1)


def _refused(path, match: str) -> str:
    with pytest.raises(InteropError, match=match) as caught:
        Pretrained(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("name", "config", "match"),
    [
        (
            "olmoe",
            lambda: transformers.OlmoeConfig(**SMALL, num_experts=2, num_experts_per_tok=1),
            r"model_type 'olmoe' is a mixture of experts \(num_experts=2\) that megascale does not map; "
            r"of the mixtures of experts it imports mixtral, qwen2_moe, qwen3_moe",
        ),
        (
            "qwen2_moe-mlp-only-layers",
            lambda: transformers.Qwen2MoeConfig(
                **SMALL,
                num_experts=2,
                num_experts_per_tok=1,
                moe_intermediate_size=8,
                shared_expert_intermediate_size=8,
                mlp_only_layers=[0],
            ),
            r"qwen2_moe: mlp_only_layers=\[0\] has no megascale equivalent \(model.moe.every picks the MoE blocks\)",
        ),
        (
            "gemma",
            lambda: transformers.GemmaConfig(**SMALL, head_dim=8),
            r"model_type 'gemma' is not supported; megascale imports gpt2, gpt_neox, llama, mistral, mixtral, qwen2, "
            r"qwen2_moe, qwen3_moe",
        ),
        (
            "yarn",
            lambda: transformers.LlamaConfig(
                **SMALL, rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
            ),
            r"llama: rope_type 'yarn' \(supported: default, llama3\) has no megascale equivalent",
        ),
        (
            "head-dim",
            lambda: transformers.LlamaConfig(**SMALL, head_dim=16),
            r"llama: head_dim=16 != hidden_size/num_attention_heads=8",
        ),
        (
            "qwen2-some-windows",
            lambda: transformers.Qwen2Config(
                **dict(SMALL, num_hidden_layers=2), use_sliding_window=True, sliding_window=8, max_window_layers=1
            ),
            r"qwen2: sliding-window attention in some layers only",
        ),
        (
            "gpt2-layer-scaled",
            lambda: transformers.GPT2Config(
                n_embd=32, n_layer=1, n_head=4, vocab_size=96, scale_attn_by_inverse_layer_idx=True
            ),
            r"gpt2: scale_attn_by_inverse_layer_idx=true has no megascale equivalent",
        ),
    ],
)
def test_unsupported_checkpoints_are_refused_by_name(name, config, match, tmp_path):
    _refused(saved(random_hf_model(config()), tmp_path / name), match)


def test_pickled_missing_and_misshapen_weights_are_refused(tmp_path):
    hf = random_hf_model(CASES["llama-gqa-llama3-rope"][1]())
    pickled = tmp_path / "pickled"
    hf.config.save_pretrained(pickled)
    torch.save(hf.state_dict(), pickled / "pytorch_model.bin")  # what older transformers wrote
    _refused(pickled, r"holds only pickled weights \(pytorch_model.bin\); megascale never unpickles")

    path = saved(hf, tmp_path / "hf")
    tensors = load_file(path / "model.safetensors")
    up = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, path / "model.safetensors")
    _refused(path, r"model.layers.1.mlp.up_proj.weight \(for megascale's blocks.1.mlp.fc.weight\) is not in the")
    tensors["model.layers.1.mlp.up_proj.weight"] = up[:-1]
    save_file(tensors, path / "model.safetensors")
    _refused(
        path,
        r"gate_proj.weight \(48, 32\), model.layers.1.mlp.up_proj.weight \(47, 32\) do not make "
        r"megascale's blocks.1.mlp.fc.weight \(96, 32\), the shape config.json describes",
    )

    _refused(tmp_path / "nowhere", r"is not a directory")
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", r"has no config.json")


def test_import_writes_the_config_train_accepts_and_init_from_is_checked_first(tmp_path, capsys):
    hf_dir = saved(random_hf_model(CASES["mistral-swa"][1]()), tmp_path / "hf")
    assert main(["import", str(hf_dir), "--out", str(tmp_path / "job"), "--parallel.tp=2"]) == 0
    out = capsys.readouterr().out
    assert "mistral checkpoint" in out and "megascale train --config" in out
    cfg = load_config(tmp_path / "job" / "config.toml")
    model, _ = load_pretrained(hf_dir)
    assert cfg.model == model.cfg and cfg.parallel.tp == 2
    assert cfg.checkpoint.init_from == str(hf_dir.resolve())

    # a model option that changes the weights: refused by import, and by train before any rank
    assert main(["import", str(hf_dir), "--out", str(tmp_path / "bad"), "--model.hidden=64"]) == 2
    assert "model.hidden is 64 here but 32 in that checkpoint" in capsys.readouterr().err
    code = main(["train", "--config", str(tmp_path / "job" / "config.toml"), "--model.layers=3"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the line naming the config file
    assert code == 2 and err.startswith("megascale train: checkpoint.init_from=")
    assert "model.layers is 3 here but 2 in that checkpoint" in err and "megascale import" in err

    # kv heads that the tensor-parallel degree cannot split: the config check names them
    code = main(["train", "--config", str(tmp_path / "job" / "config.toml"), "--parallel.tp=4"])
    assert code == 2 and "must divide model.kv_heads=2" in capsys.readouterr().err

    olmoe = transformers.OlmoeConfig(**SMALL, num_experts=2, num_experts_per_tok=1)
    moe = saved(random_hf_model(olmoe), tmp_path / "moe")
    assert main(["import", str(moe), "--out", str(tmp_path / "moe-job")]) == 2
    assert "mixture of experts" in capsys.readouterr().err
    assert not (tmp_path / "moe-job" / "config.toml").exists()


def test_trainer_starts_from_the_imported_weights(tmp_path):
    """One process, through the real Trainer: every parameter is the checkpoint's."""
    from megascale.train.trainer import Trainer

    config = transformers.Qwen2Config(**dict(COMMON, vocab_size=257), num_key_value_heads=2, tie_word_embeddings=True)
    hf_dir = saved(random_hf_model(config), tmp_path / "hf")
    data = write_bytes_dataset(tmp_path / "tokens", make_docs(20))
    assert (
        main(
            [
                "import",
                str(hf_dir),
                "--out",
                str(tmp_path / "job"),
                "--model.seq_len=16",
                f"--data.path={data}",
                "--train.global_batch=2",
                "--train.micro_batch=2",
                "--train.tensorboard=false",
            ]
        )
        == 0
    )
    want, _ = load_pretrained(hf_dir)
    trainer = Trainer(load_config(tmp_path / "job" / "config.toml"))
    try:
        got = dict(trainer.runner.named_parameters())
        assert got.keys() == dict(want.named_parameters()).keys()
        for name, value in want.named_parameters():
            assert torch.equal(got[name], value), name
    finally:
        trainer.close()


def test_a_tied_model_on_two_stages_is_refused_with_advice_import_takes(tmp_path, capsys):
    hf_dir = saved(random_hf_model(CASES["qwen2-tied"][1]()), tmp_path / "hf")
    assert main(["import", str(hf_dir), "--out", str(tmp_path / "pp"), "--parallel.pp=2"]) == 2
    err = capsys.readouterr().err
    assert "keep parallel.pp=1 and use parallel.tp or parallel.dp" in err and "tie_embeddings=false" not in err
    # what the old advice led to: an option that changes the weights, which import refuses
    assert (
        main(
            [
                "import",
                str(hf_dir),
                "--out",
                str(tmp_path / "untied"),
                "--parallel.pp=2",
                "--model.tie_embeddings=false",
            ]
        )
        == 2
    )
    assert "model.tie_embeddings is False here but True in that checkpoint" in capsys.readouterr().err
    assert main(["import", str(hf_dir), "--out", str(tmp_path / "tp"), "--parallel.tp=2"]) == 0  # the advice works
