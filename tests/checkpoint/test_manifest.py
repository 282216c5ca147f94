"""Crafted manifests: every defect is a CheckpointError naming it, found before any data byte is
read, and resume and export fall back to the previous checkpoint (issues 19 and 25)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from megascale.checkpoint.export import whole_tensors
from megascale.checkpoint.manifest import check_manifest, seal
from megascale.checkpoint.storage import CheckpointError, open_root
from megascale.interop import export_cli
from tests.checkpoint.conftest import assert_same_params, train

pytestmark = pytest.mark.timeout(300)
STEP5, STEP10 = "step_000000005", "step_000000010"


@pytest.fixture
def root(trained, tmp_path) -> Path:
    shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


def edit(checkpoint: Path, change, reseal: bool = True) -> None:
    """Change the manifest's content; resealed, so that the check under test is not the checksum."""
    path = checkpoint / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(seal(manifest) if reseal else manifest))


def check(path: Path) -> None:
    fs, p = open_root(str(path))
    check_manifest(fs, p)


def first_record(manifest: dict, **fields) -> None:
    manifest["tensors"][1].update(fields)


DEFECTS = {
    "no files": (lambda m: m.pop("files"), "files: Field required"),
    "offset out of range": (lambda m: first_record(m, offset=10**9), "reach byte"),
    "negative offset": (lambda m: first_record(m, offset=-8), "greater than or equal to 0"),
    "overlapping records": (lambda m: first_record(m, offset=m["tensors"][1]["offset"] - 4), "overlaps"),
    "nbytes not the shape's": (lambda m: first_record(m, nbytes=4), "bytes for shape"),
    "crafted dtype": (lambda m: first_record(m, dtype="nn"), "dtype"),
    "scalar dtype": (lambda m: next(iter(m["plain"].values()))["step"].update(kind="tensor", dtype="Tensor"), "dtype"),
    "a string for a number": (lambda m: first_record(m, offset="64"), "valid integer"),
    "step not the directory's": (lambda m: m.update(step=7), "the directory name says step 10"),
    "file outside the directory": (
        lambda m: (
            m["files"].update({"rank-00000.bin/../../../../etc/hostname": m["files"].pop("rank-00000.bin")}),
            [t.update(file="rank-00000.bin/../../../../etc/hostname") for t in m["tensors"]],
        ),
        "is not a rank data file",
    ),
    "unknown key": (lambda m: m.update(extra=1), "Extra inputs are not permitted"),
    "config without its model": (lambda m: m["config"].pop("model"), "config.model: Field required"),
    "old format version": (lambda m: m.update(version=1), "format version 1"),
    "RNG state without its tensor": (lambda m: m["ranks"]["0"]["rng"].update(cuda={}), "has no tensor record"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_each_manifest_defect_is_a_checkpoint_error(root, defect):
    change, message = DEFECTS[defect]
    edit(root / STEP10, change)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        check(root / STEP10)
    # export falls back to the previous valid checkpoint instead of crashing
    _, manifest = whole_tensors(str(root))
    assert manifest["step"] == 5


def test_one_byte_edit_fails_the_checksum(root):
    path = root / STEP10 / "manifest.json"
    text = path.read_text()
    offset = re.search(r'"offset": [1-9]', text).end() - 1  # a non-zero offset's first digit
    path.write_text(text[:offset] + str((int(text[offset]) % 9) + 1) + text[offset + 1 :])
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        check(root / STEP10)


def test_symlink_out_of_the_checkpoint_is_refused(root, tmp_path):
    """A data file that is a link elsewhere is refused even though its bytes match."""
    data = root / STEP10 / "rank-00000.bin"
    outside = tmp_path / "elsewhere.bin"
    shutil.copy(data, outside)
    data.unlink()
    os.symlink(outside, data)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        check(root / STEP10)


def test_export_of_only_crafted_checkpoints_is_a_clear_error(root, tmp_path, capsys):
    for name in (STEP5, STEP10):
        edit(root / name, lambda m: first_record(m, dtype="nn"))
    args = argparse.Namespace(
        checkpoint=str(root), out=str(tmp_path / "out"), dtype=None, tokenizer=None, max_shard_gb=5.0
    )
    assert export_cli.run(args) == 1
    assert "no valid checkpoint" in capsys.readouterr().err


@pytest.mark.slow  # resumes a training run
def test_one_byte_offset_edit_falls_back_and_resume_is_exact(root, straight_run):
    """The edit that once loaded shifted tensors (loss NaN from the next step) now makes resume
    fall back to step 5, and training continues bit-identically."""
    path = root / STEP10 / "manifest.json"
    text = path.read_text()
    at = re.search(r'"offset": [1-9]', text).end() - 1
    path.write_text(text[:at] + str((int(text[at]) % 9) + 1) + text[at + 1 :])
    run = root.parent
    losses, params, trainer = train(run, 20, "--checkpoint.every=0")
    assert "checksum mismatch" in (run / "rank00000.log").read_text()
    assert trainer.checkpoints.last_restore["step"] == 5
    assert losses == straight_run[0][5:]
    assert_same_params(params, straight_run[1])


def test_records_retyped_int32_and_resealed_are_refused_and_resume_is_exact(root, straight_run):
    """float32 records retyped int32 (same bytes, re-sealed: every schema and bounds check holds)
    loaded through a casting copy_ before (loss NaN, a NaN checkpoint committed, issue 29); the
    dtype is now part of what a checkpoint must match, so resume falls back to step 5."""

    def retype(manifest: dict) -> None:
        for rec in manifest["tensors"]:
            if rec["dtype"] == "float32" and rec["field"] == "value":
                rec["dtype"] = "int32"

    edit(root / STEP10, retype)
    check(root / STEP10)  # the manifest itself is sound
    run = root.parent
    losses, params, trainer = train(run, 20, "--checkpoint.every=0")
    assert "is int32 in the checkpoint but float32 in this model" in (run / "rank00000.log").read_text()
    assert trainer.checkpoints.last_restore["step"] == 5
    assert losses == straight_run[0][5:]
    assert_same_params(params, straight_run[1])
