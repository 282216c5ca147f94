"""The commit protocol under real faults: the real writer process is paused at each point of rank
0's commit and SIGKILLed there; at every point the newest committed checkpoint is complete and is
the resume point, and training resumes bit-identically. Pruning by validity with keep=1 beside
stale and corrupt checkpoints of higher steps; fsync around the commit rename."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megascale.checkpoint import catalog
from megascale.checkpoint.shm import SHM_DIR, Segment, reap_stale, segment_name
from megascale.checkpoint.storage import open_root, step_name
from megascale.checkpoint.writer import WriteJob
from tests.checkpoint.conftest import assert_same_params, train

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # each kills and restarts writer processes
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(trained, tmp_path) -> Path:
    shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
    return tmp_path


def resave_job(checkpoint: Path, run_id: str, shm_name: str, keep: int) -> WriteJob:
    """Step N saved again by a new run, with exactly the bytes and records it has."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    header = {k: v for k, v in manifest.items() if k not in ("files", "tensors", "ranks", "plain", "checksum", "seq")}
    header["run_id"] = run_id
    step = manifest["step"]
    return WriteJob(
        step=step,
        root=str(checkpoint.parent),
        tmp_name=f"{step_name(step)}.tmp-{run_id}",
        rank=0,
        world=1,
        shm_name=shm_name,
        nbytes=manifest["files"]["rank-00000.bin"]["size"],
        index={
            "records": [{k: v for k, v in t.items() if k != "file"} for t in manifest["tensors"]],
            "plain": manifest["plain"],
            "meta": manifest["ranks"]["0"],
        },
        commit=header,
        keep=keep,
        bytes_per_s=0.0,
        commit_timeout_s=60.0,
    )


def run_writer(job: WriteJob, data: bytes, pause: str | None, marker: Path) -> subprocess.Popen:
    """The writer process with `job` queued; with `pause`, returns once it is paused there."""
    module = ["tests.checkpoint.paused_writer", pause, str(marker)] if pause else ["megascale.checkpoint.writer"]
    proc = subprocess.Popen(
        [sys.executable, "-m", *module],
        cwd=REPO,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    proc.stdin.write(json.dumps({"job": dataclasses.asdict(job)}) + "\n")
    proc.stdin.flush()
    if pause:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.02)
    return proc


@pytest.fixture
def shm(trained):
    """Step 10's bytes in a segment held as the trainer holds its buffer."""
    data = (trained / "checkpoints" / step_name(10) / "rank-00000.bin").read_bytes()
    segment = Segment(segment_name(uuid.uuid4().hex[:8], 0, 1), size=len(data), create=True)
    segment.buf[: len(data)] = data
    yield segment, data
    segment.close(unlink=True)


@pytest.mark.parametrize("point", ["written", "renamed", "latest"])
def test_resave_killed_at_each_commit_point(run, shm, point, straight_run, tmp_path, caplog):
    root = run / "checkpoints"
    segment, data = shm
    job = resave_job(root / step_name(10), "feedbeef", segment.name, keep=3)
    writer = run_writer(job, data, point, tmp_path / "paused")
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    fs, path = open_root(str(root))
    found = catalog.survey(fs, path)
    assert found.invalid == [] and found.unreadable == []
    assert [v.entry.step for v in found.valid].count(5) == 1  # nothing complete was deleted
    newest = found.newest
    if point == "written":  # not renamed yet: the old step 10 is still the newest commit
        assert newest.entry.name == step_name(10) and newest.manifest["run_id"] != "feedbeef"
        assert [t.name for t in found.temporaries] == [f"{step_name(10)}.tmp-feedbeef"]
    else:  # committed as a new generation; the one it supersedes is still whole beside it
        assert newest.entry.name == step_name(10, 1) and newest.manifest["run_id"] == "feedbeef"
        assert {v.entry.name for v in found.valid} == {step_name(5), step_name(10), step_name(10, 1)}
    with caplog.at_level(logging.WARNING, logger="megascale.checkpoint"):
        assert catalog.candidates(fs, path)[0][0] == newest.entry.path  # what resume loads first
    if point == "written":  # the half-written save is reported, not silently ignored
        assert "step_000000010.tmp-feedbeef is a save of step 10 that never committed" in caplog.text
    if point == "renamed":  # and it trains on exactly as if nothing had happened
        losses, params, trainer = train(run, 20, "--checkpoint.every=0")
        assert trainer.checkpoints.last_restore["path"] == newest.entry.path
        assert losses == straight_run[0][10:]
        assert_same_params(params, straight_run[1])


def test_next_commit_cleans_up_after_a_killed_one(run, shm, tmp_path):
    root = run / "checkpoints"
    segment, data = shm
    killed = run_writer(
        resave_job(root / step_name(10), "0badc0de", segment.name, 1), data, "written", tmp_path / "paused"
    )
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    again = run_writer(resave_job(root / step_name(10), "600dc0de", segment.name, 1), data, None, tmp_path / "x")
    result = json.loads(again.stdout.readline())
    again.stdin.close()
    assert again.wait(30) == 0
    assert result["kind"] == "ok", result
    assert sorted(result["info"]["removed"]) == sorted([step_name(5), step_name(10), f"{step_name(10)}.tmp-0badc0de"])
    assert sorted(p.name for p in root.iterdir()) == ["latest", step_name(10, 1)]
    assert (root / "latest").read_text() == step_name(10, 1)


def test_writer_whose_trainer_is_gone_commits_quietly_and_frees_the_segment(run, shm, tmp_path):
    """The trainer dies after handing over a job: the writer commits it, finds nobody to tell
    (no BrokenPipeError traceback), exits 0 and unlinks the segment nobody holds any more."""
    root = run / "checkpoints"
    segment, data = shm
    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        writer = subprocess.Popen(
            [sys.executable, "-m", "megascale.checkpoint.writer"],
            cwd=REPO,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
    writer.stdin.write(
        json.dumps({"job": dataclasses.asdict(resave_job(root / step_name(10), "0dead0", segment.name, 3))}) + "\n"
    )
    writer.stdin.close()  # what the kernel does to a killed trainer's pipes
    writer.stdout.close()
    segment.close()  # ... and to its lock
    assert writer.wait(60) == 0
    assert err.read_text() == ""
    assert (root / step_name(10, 1) / "manifest.json").exists()
    assert not (SHM_DIR / segment.name).exists()


def test_segments_of_dead_jobs_are_removed_at_start(tmp_path):
    """A whole process tree SIGKILLed leaves its segment (Python's tracker dies with it); the
    next start removes it, and leaves a live job's segment alone."""
    dead, live = segment_name("dead0b", 0, 1), segment_name("live0b", 0, 1)
    code = (
        f"from megascale.checkpoint.shm import Segment; s = Segment({dead!r}, 4096, True); "
        "print(1, flush=True); input()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.stdout.readline().strip() == b"1"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    held = Segment(live, 4096, create=True)
    try:
        old = time.time() - 3600  # past MIN_AGE_S, which covers a segment's creation-to-lock moment
        for name in (dead, live):
            os.utime(SHM_DIR / name, (old, old))
        assert (SHM_DIR / dead).exists()
        removed = reap_stale()
        assert dead in removed and live not in removed
        assert not (SHM_DIR / dead).exists() and (SHM_DIR / live).exists()
    finally:
        held.close(unlink=True)


def test_a_fifo_or_link_named_like_a_segment_does_not_block_start(tmp_path):
    """A FIFO under the segment prefix made every trainer's start-up clean-up block in open()
    forever (issue 29); it and a link out of /dev/shm are not segments: left alone, not followed."""
    fifo, link = SHM_DIR / segment_name(f"fifo{os.getpid()}", 0, 1), SHM_DIR / segment_name(f"link{os.getpid()}", 0, 1)
    target = tmp_path / "victim"
    target.write_bytes(b"x")
    os.mkfifo(fifo)
    link.symlink_to(target)
    try:
        old = time.time() - 3600
        os.utime(fifo, (old, old))
        os.utime(link, (old, old), follow_symlinks=False)
        code = "from megascale.checkpoint.shm import reap_stale; print(sorted(reap_stale()))"
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        assert done.returncode == 0, done.stderr
        assert fifo.name not in done.stdout and link.name not in done.stdout
        assert fifo.exists() and link.is_symlink() and target.read_bytes() == b"x"
    finally:
        fifo.unlink()
        link.unlink()


def test_keep_1_beside_stale_and_corrupt_newer_checkpoints(run, straight_run):
    """Step 10 of an abandoned timeline (valid), a copy named step 50 (its manifest says 10) and a
    partial step 40 sit above the run that resumes step 5 on purpose and saves step 8 with keep=1.
    The new commit is kept and is the next resume point; the invalid ones are moved aside."""
    root = run / "checkpoints"
    shutil.copytree(root / step_name(10), root / step_name(50))
    shutil.copytree(root / step_name(10), root / step_name(40))
    (root / step_name(40) / "manifest.json").unlink()
    train(run, 8, "--checkpoint.every=4", "--checkpoint.keep=1", f"--checkpoint.resume={root / step_name(5)}")
    names = sorted(p.name for p in root.iterdir())
    assert [
        n for n in names if not n.startswith(("latest", f"{step_name(40)}.invalid", f"{step_name(50)}.invalid"))
    ] == [step_name(8)], names
    assert len(names) == 4, names  # latest, step 8, two quarantined
    log = (run / "rank00000.log").read_text()
    assert "invalid checkpoint moved aside" in log and "the directory name says step 50" in log
    losses, params, trainer = train(run, 20, "--checkpoint.every=0")
    assert trainer.checkpoints.last_restore["step"] == 8
    assert losses == straight_run[0][8:]
    assert_same_params(params, straight_run[1])


def test_prune_that_cannot_tidy_reports_and_keeps_the_commit(run):
    """An invalid checkpoint that storage refuses to move (immutable) is reported and left in
    place; the commit it follows stands."""
    root = run / "checkpoints"
    shutil.copytree(root / step_name(10), root / step_name(50))  # its manifest says step 10
    if subprocess.run(["chattr", "+i", str(root / step_name(50))], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        fs, path = open_root(str(root))
        pruned = catalog.prune(fs, path, keep=3, just_committed=step_name(10), tag="cafe")
    finally:
        subprocess.run(["chattr", "-i", str(root / step_name(50))], check=True)
    assert pruned.quarantined == [] and pruned.removed == []
    assert len(pruned.unchecked) == 1 and pruned.unchecked[0].startswith(f"{step_name(50)}: not tidied")
    assert catalog.survey(fs, path).newest.entry.name == step_name(10)


def test_commit_syncs_files_and_directories_around_the_rename(tmp_path, monkeypatch):
    """Spy on the system calls of an inline save: every file and both directories reach the disk,
    the root after the rename."""
    calls: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst, **kwargs):
        calls.append(("rename", os.fspath(dst)))
        return real_rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    train(tmp_path, 1, "--checkpoint.every=1", "--checkpoint.async_save=false")
    root = str(tmp_path / "checkpoints")
    commit = calls.index(("rename", f"{root}/{step_name(1)}"))
    before = [p.removeprefix(root + "/") for kind, p in calls[:commit] if kind == "fsync"]
    tmp = next(p for p in before if "/" not in p)  # the directory step_000000001.tmp-<run id>
    assert tmp.startswith(f"{step_name(1)}.tmp-")
    assert {f"{tmp}/rank-00000.bin", f"{tmp}/manifest.json.part"} <= set(before)
    assert before.index(tmp) > before.index(f"{tmp}/manifest.json.part")
    assert ("fsync", root) in calls[commit:]
    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(os, "fsync", fsync)
    train(tmp_path / "scratch", 1, "--checkpoint.every=1", "--checkpoint.async_save=false", "--checkpoint.fsync=false")
    assert calls == []
