"""Resume is exact: 10 steps, stop, resume, 10 more == 20 straight (losses and parameters)."""

from __future__ import annotations

import json

import pytest

from tests.checkpoint.conftest import assert_same_params, train


@pytest.mark.parametrize("async_save", [True, False])
def test_resume_is_exact(tmp_path, straight_run, async_save):
    mode = f"--checkpoint.async_save={str(async_save).lower()}"
    first, _, _ = train(tmp_path, 10, mode, "--checkpoint.every=5")
    second, params, trainer = train(tmp_path, 20, mode, "--checkpoint.every=5")
    assert trainer.checkpoints.last_restore["step"] == 10
    assert first + second == straight_run[0]
    assert_same_params(params, straight_run[1])


def test_layout_on_disk_and_keep(tmp_path):
    train(tmp_path, 20, "--checkpoint.every=5", "--checkpoint.keep=2")
    root = tmp_path / "checkpoints"
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_000000015", "step_000000020"]
    assert (root / "latest").read_text() == "step_000000020"
    manifest = json.loads((root / "step_000000020" / "manifest.json").read_text())
    assert manifest["step"] == 20 and manifest["world_size"] == 1
    assert set(manifest["files"]) == {"rank-00000.bin"}
    info = manifest["files"]["rank-00000.bin"]
    assert info["size"] == (root / "step_000000020" / "rank-00000.bin").stat().st_size
    assert len(info["sha256"]) == 64
    fields = {t["field"] for t in manifest["tensors"]}
    assert {"value", "optim.exp_avg", "optim.exp_avg_sq", "python", "numpy", "torch"} <= fields
    assert all(state["step"] == {"kind": "int", "value": 20} for state in manifest["plain"].values())


def test_resume_none_starts_fresh(tmp_path):
    train(tmp_path, 5, "--checkpoint.every=5")
    losses, _, trainer = train(tmp_path, 5, "--checkpoint.resume=none", "--checkpoint.every=0")
    assert trainer.checkpoints.last_restore is None and len(losses) == 5
