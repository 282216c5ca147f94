"""The training loop: read it top to bottom.

One `Trainer` per rank. It builds the mesh, the model (the same seed on every rank, then
parallelised from outside), the optimizer, the data loaders, the timers and the checkpoint
manager, then runs steps: data -> forward/backward -> grad sync -> clip -> optimizer -> log.
Python's automatic GC is off during training and run on every rank at the same steps, since
irregular collection on one rank stalls every rank that waits for it in a collective.
"""

from __future__ import annotations

import gc
import logging
import random
import signal
import socket
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from megascale.checkpoint.manager import CheckpointManager, FinalSave
from megascale.checkpoint.replica import ReplicaStore
from megascale.checkpoint.stateful import CheckpointState, RNGState, TrainState
from megascale.config import ConfigError, JobConfig, dump_config, to_dict
from megascale.config.help import non_defaults
from megascale.data import TokenBatch, build_loaders
from megascale.diagnostics.mfu import mfu, peak_flops
from megascale.diagnostics.timers import Timers, set_timers
from megascale.diagnostics.watchdog import Watchdog, enable_flight_recorder
from megascale.interop.pretrained import init_source
from megascale.model import GPT, IGNORE_INDEX
from megascale.model.flops import flops_per_token, parameter_count
from megascale.optim import build_optimizer, clip_to_norm_, global_grad_norm, lr_at
from megascale.parallel.context import split_batch, uses_ring
from megascale.parallel.engine import build_runner
from megascale.parallel.mesh import init_mesh
from megascale.parallel.timed_comm import reduce_sum, timed_all_reduce
from megascale.plan.memory import check_memory_limit, job_memory_estimate
from megascale.train.metrics import MetricsWriter, StepClock, memory_record, progress_line, setup_logging
from megascale.train.numerics import DataSkips, NonFiniteGuard, SpikeDetector, TrainingHalted, nonfinite_origin
from megascale.train.stop import StopOnSignal

log = logging.getLogger("megascale")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: JobConfig, replicas: ReplicaStore | None = None):
        """`replicas`: the peer copies this process keeps across recoveries (a rank under an
        executor); they are made and restored from only when given."""
        self.cfg = cfg
        check_memory_limit(cfg, cfg.train.device)  # before a process group or a tensor exists
        if cfg.diagnostics.flight_recorder:  # must be set before the process groups exist
            enable_flight_recorder()
        self.mesh = init_mesh(cfg.parallel, device=cfg.train.device)
        self.device = self.mesh.device  # the mesh's one choice (mesh.launch: LOCAL_RANK, read once)
        if cfg.train.attention == "flex" and self.device.type != "cuda":
            raise ConfigError(
                "train.attention='flex' trains only on CUDA (FlexAttention has no CPU backward); "
                "use 'auto' (the sliding-chunks kernel for SWA off CUDA) or 'sliding'"
            )
        # when this rank joined and had its state back: the driver's recovery phases read it
        self.start_record: dict = {"joined_at": time.time(), "restored_at": None, "source": None, "step": None}
        self.rank = self.mesh.rank
        self.run_dir = Path(cfg.train.run_dir)
        setup_logging(self.run_dir, self.rank)
        if self.mesh.world_size > 1:  # init_mesh logged it before logging was set up
            log.info("mesh %s", self.mesh.startup.summary())
        if self.rank == 0:
            dump_config(cfg, self.run_dir / "config.toml")
            log.info("config differs from the built-in defaults in: %s", " ".join(non_defaults(cfg)) or "nothing")

        seed_everything(cfg.train.seed)
        with torch.device("meta"):  # values come after the layout, for this rank's part only
            model = GPT(cfg.model)
        if cfg.train.param_dtype == "bf16":  # parameters and gradients; fp32 masters in the ZeRO shards
            model.to(torch.bfloat16)
        # values: a pretrained checkpoint's (weights only), or the seeded initialisation
        values = init_source(cfg.checkpoint.init_from, cfg.model) if cfg.checkpoint.init_from else None
        self.runner = build_runner(model, cfg, self.mesh, values)
        self.sum_over = partial(timed_all_reduce, mesh=self.mesh)  # the step's waits timed as comm
        self.optimizer = build_optimizer(self.runner.optimizer_tensors(), cfg.optim, self.sum_over)
        self.train_loader, self.eval_loader = build_loaders(cfg, self.mesh)
        self.timers = Timers(
            self.rank,
            self.mesh.grid.named_coords(self.rank),
            socket.gethostname(),
            self.run_dir,
            enabled=cfg.diagnostics.timers,
            device=self.device,
        )
        set_timers(self.timers)
        self.watchdog = Watchdog(self.timers, self.run_dir, cfg.diagnostics.hang_timeout_s, grid=self.mesh.grid)
        if cfg.diagnostics.timers:  # it reads the open timer spans to say where a hang is
            self.watchdog.start()
        self.train_state = TrainState()
        self.init_numerics()
        self.checkpoints = CheckpointManager(
            cfg,
            self.mesh,
            self.run_dir,
            CheckpointState(
                model=self.runner,
                optimizer=self.optimizer,
                loader=self.train_loader,
                train=self.train_state,
                rng=RNGState(self.device),
            ),
            replicas,
        )
        wandb = (
            None
            if not cfg.train.wandb
            else {
                "project": cfg.train.wandb_project,
                "mode": cfg.train.wandb_mode,
                "name": self.run_dir.name,
                "config": to_dict(cfg),
            }
        )
        self.metrics = MetricsWriter(self.run_dir, self.rank == 0, cfg.train.tensorboard, wandb)
        self.clock = StepClock()
        self.stop_signal = 0  # set by fit() when a signal stopped it
        self.final_save: FinalSave | None = None  # set by fit(): is the step reached committed?
        # called as hook(step, step_time) after each step (an executor's progress file, test faults)
        self.step_hooks: list[Callable[[int, float], None]] = []
        self.flops_per_token = flops_per_token(cfg.model).training
        self.peak = peak_flops(self.device, cfg.train.dtype)
        log.info(
            "model %.1fM parameters, layout pp=%d dp=%d tp=%d vpp=%d, %s per step; peak %s",
            parameter_count(cfg.model) / 1e6,
            cfg.parallel.pp,
            cfg.parallel.dp,
            cfg.parallel.tp,
            cfg.parallel.vpp,
            cfg.shares.describe(),
            f"{self.peak.value / 1e9:.1f} GFLOP/s ({self.peak.source})" if self.peak.value else self.peak.source,
        )

    def init_numerics(self) -> None:
        """The guards of `train_step` (subclasses that build a trainer in part call it too)."""
        self.nonfinite = NonFiniteGuard(self.cfg.train.max_skipped_steps)
        self.spikes = SpikeDetector(self.cfg.train.spike_window, self.cfg.train.spike_threshold)
        self.data_skips = DataSkips()
        self.rollbacks: dict[int, int] = {}  # checkpoint step -> rollbacks to it

    @property
    def replicas(self) -> ReplicaStore | None:
        """The peer copies this process keeps, once a copy still in flight has landed (fault tests
        corrupt them: a copy arriving after the flip would escape it)."""
        if self.checkpoints.replicator is not None:
            self.checkpoints.replicator.wait()
        return self.checkpoints.replicas

    @property
    def writer_pid(self) -> int | None:
        """The stage-2 checkpoint writer process (fault tests kill it)."""
        return self.checkpoints.writer_pid

    @property
    def step(self) -> int:
        """Steps done; kept in `train_state`, which checkpoints save and restore."""
        return self.train_state.step

    @step.setter
    def step(self, value: int) -> None:
        self.train_state.step = value

    # ---------------------------------------------------------------- one step
    def global_token_count(self, batch: TokenBatch | None) -> int:
        """Loss-bearing tokens in the global batch; the loss is their mean on every layout.

        Collectives get tensors on the mesh's device: NCCL groups reject CPU tensors."""
        local = torch.zeros((), dtype=torch.int64)
        if batch is not None:
            local += (batch.labels != IGNORE_INDEX).sum()
            if self.mesh.dp_group is not None or self.mesh.cp_group is not None:
                local = reduce_sum(local.to(self.mesh.device), self.mesh.dp_group, self.mesh.cp_group, mesh=self.mesh)
        return max(int(local), 1)

    def cp_part(self, batch: TokenBatch | None) -> TokenBatch | None:
        """This cp rank's part of every sequence (the loader gives cp ranks the same batch)."""
        if batch is None or self.mesh.cp_size == 1:
            return batch
        ring = uses_ring(self.cfg.model.window, self.cfg.model.seq_len)
        return split_batch(batch, self.mesh.cp_rank, self.mesh.cp_size, ring)

    def train_step(self, batch: TokenBatch | None) -> dict[str, float]:
        """Forward, backward, then the optimizer step unless the gradient norm is not finite or
        the loss spiked (`skipped` in the record; `rollback_to` when the state was restored)."""
        batch = self.cp_part(batch)
        tokens = self.global_token_count(batch)
        self.runner.train()
        loss_sum = self.runner.forward_backward(batch, tokens)
        self.runner.finish_grads()
        params = [t for _, t in self.runner.optimizer_tensors()]
        with self.timers.span("optimizer", kind="optimizer"):
            # every group: alike on all ranks; the waits timed as comm, not as this rank's work
            norm = global_grad_norm(params, [self.mesh.pp_group], self.sum_over)
            loss = self.reduce_loss(loss_sum) / tokens
            lr = lr_at(self.step, self.cfg.optim, self.cfg.train.steps)
            record = {"loss": loss, "lr": lr, "grad_norm": float(norm), **self.runner.moe_stats}
            record.update(self._bad_step(record))
            if "skipped" not in record:
                clip_to_norm_(params, self.cfg.optim.grad_clip, norm)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.step()
            self.runner.zero_grad()
        if "skipped" not in record:
            self.runner.after_optimizer_step()
        return record

    def _bad_step(self, record: dict) -> dict:
        """{} for a good step; else why it is skipped (and, after a rollback, where to)."""
        step = self.step + 1
        if not np.isfinite(record["grad_norm"]):
            origin = nonfinite_origin(
                self.runner.optimizer_tensors(),
                self.mesh.grid.named_coords(self.mesh.rank),
                self.mesh.rank,
                self.mesh.world_size,
            )
            last_good = self.checkpoints.last_good() if getattr(self, "checkpoints", None) else "none (no checkpoints)"
            self.nonfinite.skipped(step, record["grad_norm"], origin, last_good)
            return {
                "skipped": 1,
                "skip_reason": "nonfinite",
                "skipped_total": self.nonfinite.total,
                "nonfinite_ranks": [o["rank"] for o in origin],
            }
        self.nonfinite.ok()
        spike = self.spikes.check(record["loss"])
        if spike is None:
            self.spikes.add(step, record["loss"])
            return {}
        action = self.cfg.train.spike_action
        log.warning("step %d: loss spike: %s (train.spike_action=%s)", step, spike.describe(), action)
        if action == "log":
            self.spikes.add(step, record["loss"])
            return {"spike": 1}
        if action == "rollback":
            return {"spike": 1, **self._rollback(step)}
        return {"spike": 1, "skipped": 1, "skip_reason": "spike"}

    def _rollback(self, step: int) -> dict:
        """Restore the newest checkpoint in place and never train on the spike's batch and the
        `train.spike_skip_batches - 1` before it (those since the checkpoint, at most)."""
        spiked = self.train_loader.position - 1  # the batch this step trained on
        restored = self.checkpoints.rollback()
        if restored is None:
            log.warning("step %d: no checkpoint to roll back to: the step is skipped instead", step)
            return {"skipped": 1, "skip_reason": "spike"}
        self.rollbacks[restored] = self.rollbacks.get(restored, 0) + 1
        if self.rollbacks[restored] > self.cfg.train.max_rollbacks:
            raise TrainingHalted(
                f"loss spike at step {step}: already rolled back to step {restored} "
                f"{self.cfg.train.max_rollbacks} times (train.max_rollbacks); the spikes are not the data's: "
                f"lower optim.lr or resume from an older checkpoint (last good: {self.checkpoints.last_good()})"
            )
        first = max(spiked - self.cfg.train.spike_skip_batches + 1, self.train_loader.position)
        self.data_skips.add(first, spiked)
        self.spikes.forget_after(restored)
        log.warning("rolled back to step %d; batches %d-%d of the data order will be skipped", restored, first, spiked)
        return {"skipped": 1, "skip_reason": "spike", "rollback_to": restored, "skipped_batches": [first, spiked]}

    def reduce_loss(self, loss_sum: torch.Tensor) -> float:
        """Sum of token losses over the global batch, known on every rank: summed over dp and cp
        on the stage holding the loss (the last; the first under ZB-V), then over pp (other
        stages add zero). tp ranks hold the same value."""
        holds = self.runner.holds_loss
        value = loss_sum.clone() if holds else torch.zeros_like(loss_sum)
        if holds:
            reduce_sum(value, self.mesh.dp_group, self.mesh.cp_group, mesh=self.mesh)
        return float(reduce_sum(value, self.mesh.pp_group, mesh=self.mesh))

    def evaluate(self) -> float:
        self.runner.train(False)
        total, tokens = 0.0, 0
        for batch in map(self.cp_part, self.eval_loader.batches()):
            tokens += self.global_token_count(batch)
            total += self.reduce_loss(self.runner.eval_loss_sum(batch))
        return total / max(tokens, 1)

    # ---------------------------------------------------------------- the loop
    def fit(self) -> list[float]:
        """Train to `train.steps`, or until SIGTERM/Ctrl-C (then `stop_signal` is set); save
        the last step and wait for its commit (`final_save`); return the losses of the steps
        this call ran."""
        cfg = self.cfg.train
        resumed = self.checkpoints.resume()
        source = self.checkpoints.last_restore["source"] if resumed else "none"
        self.start_record.update(restored_at=time.time(), source=source, step=self.step)
        if self.step >= cfg.steps:  # resumed at the end: say so, or a watcher waits for a step forever
            for hook in self.step_hooks:
                hook(self.step, 0.0)
        losses: list[float] = []
        gc.collect()
        gc.disable()
        try:
            with StopOnSignal(self.cfg.checkpoint.save_on_signal) as stop:
                first = self.step
                while self.step < cfg.steps:
                    record = self.run_step()
                    if "rollback_to" in record:  # those steps are trained again
                        del losses[max(record["rollback_to"] - first, 0) :]
                    elif "skipped" not in record:
                        losses.append(record["loss"])
                    self.stop_signal = stop.agreed(self.mesh.device)
                    if self.stop_signal:
                        log.warning(
                            "stopping at step %d on %s: saving it", self.step, signal.Signals(self.stop_signal).name
                        )
                        break
                self.final_save = self.checkpoints.save_final()
            if self.final_save.saved:
                log.info("%s; the same command resumes from it", self.final_save.describe())
            else:
                log.error("%s", self.final_save.describe())
        finally:
            gc.enable()
        return losses

    def run_step(self) -> dict[str, float]:
        """One whole training step as `fit` runs it (data, step, eval, GC, checkpoint, metrics);
        returns the step's record (loss, step_time, tokens_per_s, mfu, time_* per timer kind)."""
        cfg = self.cfg.train
        start = time.perf_counter()
        with self.timers.span("data", kind="data"):
            while self.data_skips.skips(self.train_loader.position):
                log.info("batch %d of the data order skipped (a rollback chose so)", self.train_loader.position)
                self.train_loader.next_batch()
            batch = self.train_loader.next_batch()
        attempt = self.step + 1
        record = self.train_step(batch)
        if "skipped" in record:  # the batch is used up, the step is not: its number comes again
            self.metrics.write(attempt, record)
            return record
        self.step += 1
        if cfg.eval_every and self.step % cfg.eval_every == 0:
            record["eval_loss"] = self.evaluate()
        if cfg.gc_every and self.step % cfg.gc_every == 0:
            gc.collect()
            self.peak.refresh()
        self.checkpoints.maybe_save()
        step_time = time.perf_counter() - start
        tokens_per_s = cfg.global_batch * self.cfg.model.seq_len / step_time
        world = self.mesh.world_size
        record.update(
            step_time=step_time,
            tokens_per_s=tokens_per_s,
            data_wait=self.train_loader.wait_seconds,
            mfu=self._mfu(tokens_per_s / world),
            eta_s=self.clock.eta_s(step_time, cfg.steps - self.step),
            **memory_record(self.device),
        )
        record.update({f"time_{k}": v for k, v in self.timers.end_step(self.step).items()})
        if self.step == 1:
            self._log_memory_against_plan(record)
        self.metrics.write(self.step, record)
        for hook in self.step_hooks:
            hook(self.step, step_time)
        if self.step % cfg.log_every == 0 or self.step == cfg.steps:
            log.info(progress_line(self.step, cfg.steps, record))
        return record

    def _mfu(self, tokens_per_s_per_rank: float) -> float | None:
        achieved = tokens_per_s_per_rank * self.flops_per_token
        probe = self.peak.value
        if self.peak.observe(achieved):
            log.warning(
                "the CPU peak probe read %.1f GFLOP/s but a step reached %.1f (the probe ran while the "
                "cores were busy): that is the peak from now on",
                (probe or 0) / 1e9,
                achieved / 1e9,
            )
        return mfu(tokens_per_s_per_rank, self.flops_per_token, self.peak.value)

    def _log_memory_against_plan(self, record: dict) -> None:
        """After the first step, the measured memory beside what the planner predicts for this
        rank's model state, activations and buffers (what `megascale plan` would say)."""
        plan = job_memory_estimate(self.cfg, self.mesh.device.type)
        if "mem_cuda_max_allocated_gib" in record:
            measured = (
                f"max allocated {record['mem_cuda_max_allocated_gib']:.2f} GiB, reserved "
                f"{record['mem_cuda_max_reserved_gib']:.2f} GiB"
            )
        else:  # the host process: Python, PyTorch and its libraries come on top of the model
            measured = f"peak RSS {record['mem_rss_peak_gib']:.2f} GiB (the whole process)"
        parts = ", ".join(
            f"{k} {v / 2**20:.1f}" for k, v in plan.as_dict().items() if k not in ("total", "capacity", "reserved")
        )
        log.info("memory after step 1: %s; planner estimate %.1f MiB (%s MiB)", measured, plan.total / 2**20, parts)
        limit = self.cfg.train.memory_limit_gib
        if limit and record.get("mem_cuda_max_allocated_gib", 0.0) > limit:
            log.warning(
                "step 1 allocated %.2f GiB at most, over train.memory_limit_gib=%g that the estimate met: "
                "kernels' workspace and fragmentation come on top of it; give the limit that margin",
                record["mem_cuda_max_allocated_gib"],
                limit,
            )

    def abandon(self) -> None:
        """After a peer failed: free what this trainer holds without waiting for any collective
        or commit (the process lives on and builds the next attempt's trainer)."""
        self.watchdog.stop()
        self.checkpoints.abandon()
        self.train_loader.close()
        self.metrics.close()
        self.timers.close()
        set_timers(Timers(rank=self.rank, coords={}, host="", out_dir=None, enabled=False))
        self.mesh.abort()

    def close(self) -> None:
        self.watchdog.stop()
        self.runner.close()
        self.checkpoints.close()
        self.train_loader.close()
        self.metrics.close()
        self.timers.close()
        set_timers(Timers(rank=self.rank, coords={}, host="", out_dir=None, enabled=False))
        self.mesh.destroy()
