"""Checkpoint benchmark (issue 7): training stall per checkpoint, and bytes read in recovery.

1. Stall: the time the training loop is blocked by a two-stage save (`save()` itself, plus the
   next optimizer step's wait for the stage-1 copy, which runs beside data/forward/backward;
   stage 2 in the writer process) against a synchronous save of the same state, alternating
   in one run on the same trainer. Also the extra time of the training
   steps that run while stage 2 writes (both compete for this machine's cores), and the cost
   of durability: the synchronous save with fsync of every file and directory around the
   commit (the default) against the same save with `checkpoint.fsync=false`.
2. Recovery reads: for dp = 1, 2, 4, a job of that size saves, a fresh one resumes; bytes read
   from storage / bytes stored (1.0 = every byte once; reading on every rank would be dp).

    python bench/checkpoint.py [--rounds 5] [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from megascale.config import load_config
from megascale.testing.launch import run_local
from megascale.train.trainer import Trainer

SMALL = [
    "--model.layers=2",
    "--model.hidden=64",
    "--model.heads=4",
    "--model.seq_len=64",
    "--train.global_batch=8",
    "--train.micro_batch=2",
]
COMMON = [
    "--train.device=cpu",
    "--train.tensorboard=false",
    "--train.eval_every=0",
    "--train.log_every=1000",
    "--optim.name=adamw",
]


def stall(args, work: Path) -> dict:
    model = [
        f"--model.layers={args.layers}",
        f"--model.hidden={args.hidden}",
        "--model.heads=8",
        "--model.seq_len=128",
        "--train.global_batch=2",
        "--train.micro_batch=2",
    ]
    cfg = load_config(
        None, model + COMMON + [f"--train.run_dir={work / 'stall'}", "--checkpoint.every=0", "--checkpoint.resume=none"]
    )
    trainer = Trainer(cfg)
    sync_cfg = load_config(
        None,
        model
        + COMMON
        + [f"--train.run_dir={work / 'stall'}", f"--checkpoint.dir={work / 'sync'}", "--checkpoint.async_save=false"],
    )
    from megascale.checkpoint import CheckpointManager

    sync = CheckpointManager(sync_cfg, trainer.mesh, work / "stall", trainer.checkpoints.state)
    unsynced_cfg = load_config(
        None,
        model
        + COMMON
        + [
            f"--train.run_dir={work / 'stall'}",
            f"--checkpoint.dir={work / 'unsynced'}",
            "--checkpoint.async_save=false",
            "--checkpoint.fsync=false",
        ],
    )
    unsynced = CheckpointManager(unsynced_cfg, trainer.mesh, work / "stall", trainer.checkpoints.state)
    two_stage = trainer.checkpoints
    for _ in range(2):  # warm up: optimizer state exists, buffers allocated, writer started
        trainer.run_step()
    two_stage.save(blocking=True)
    sync.save()
    unsynced.save()
    rows = []
    for _ in range(args.rounds):
        quiet = [_timed(trainer.run_step) for _ in range(args.steps)]
        two_stage.save()
        during = [_timed(trainer.run_step) for _ in range(args.steps)]
        async_s = two_stage.last_stall_s  # save() + the optimizer's wait for stage 1
        start = time.perf_counter()
        two_stage._wait()
        tail = time.perf_counter() - start
        sync_s = _timed(sync.save)
        unsynced_s = _timed(unsynced.save)
        rows.append(
            {
                "async_stall_s": async_s,
                "sync_save_s": sync_s,
                "sync_save_no_fsync_s": unsynced_s,
                "stage2_tail_s": tail,
                "step_quiet_s": statistics.median(quiet),
                "step_during_stage2_s": statistics.median(during),
            }
        )
    size = sum(p.stat().st_size for p in (work / "sync").rglob("*") if p.is_file()) / max(
        1, len(list((work / "sync").glob("step_*")))
    )
    sync.close()
    unsynced.close()
    trainer.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {
        "checkpoint_mb": size / 1e6,
        "rounds": rows,
        "median": med,
        "stall_over_sync": med["async_stall_s"] / med["sync_save_s"],
        "fsync_over_no_fsync": med["sync_save_s"] / med["sync_save_no_fsync_s"],
    }


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _job(run_dir: str, dp: int, steps: int, resume: str) -> dict:
    cfg = load_config(
        None,
        SMALL
        + COMMON
        + [
            f"--train.run_dir={run_dir}",
            f"--parallel.dp={dp}",
            f"--train.steps={steps}",
            "--checkpoint.every=0",
            f"--checkpoint.resume={resume}",
            "--parallel.backend=gloo",
        ],
    )
    trainer = Trainer(cfg)
    try:
        trainer.fit()
        return {"restore": trainer.checkpoints.last_restore}
    finally:
        trainer.close()


def recovery(work: Path) -> dict:
    out = {}
    for dp in (1, 2, 4):
        run_dir = str(work / f"dp{dp}")
        if dp == 1:
            os.environ.pop("RANK", None)
            _job(run_dir, 1, 2, "none")
            restore = _job(run_dir, 1, 3, "auto")["restore"]
        else:
            run_local(_job, dp, args=(run_dir, dp, 2, "none"), timeout_s=600)
            restore = run_local(_job, dp, args=(run_dir, dp, 3, "auto"), timeout_s=600)[0]["restore"]
        out[f"dp{dp}"] = {
            "bytes_read": restore["bytes_read"],
            "checkpoint_bytes": restore["checkpoint_bytes"],
            "ratio": restore["bytes_read"] / restore["checkpoint_bytes"],
            "if_every_rank_read": dp,
            "restore_s": restore["seconds"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dir", default=None, help="where to write (a disk, not tmpfs, for fsync's cost)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        result = {"stall": stall(args, work), "recovery": recovery(work)}
    s = result["stall"]
    print(
        f"checkpoint {s['checkpoint_mb']:.0f} MB: stall {s['median']['async_stall_s'] * 1e3:.1f} ms "
        f"vs synchronous save {s['median']['sync_save_s'] * 1e3:.0f} ms -> "
        f"{100 * s['stall_over_sync']:.1f}% (target <= 5%); step {s['median']['step_quiet_s'] * 1e3:.0f} ms "
        f"quiet, {s['median']['step_during_stage2_s'] * 1e3:.0f} ms while stage 2 writes"
    )
    print(
        f"durability: synchronous save {s['median']['sync_save_s'] * 1e3:.0f} ms with fsync, "
        f"{s['median']['sync_save_no_fsync_s'] * 1e3:.0f} ms without -> {s['fsync_over_no_fsync']:.2f}x "
        f"(the stage-2 time; training does not wait for it)"
    )
    for dp, r in result["recovery"].items():
        print(
            f"recovery {dp}: read {r['bytes_read']} of {r['checkpoint_bytes']} bytes -> "
            f"{r['ratio']:.3f} (target 1.0; {r['if_every_rank_read']}.0 if every rank read)"
        )
    out = Path(__file__).parent / "results" / "checkpoint.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
