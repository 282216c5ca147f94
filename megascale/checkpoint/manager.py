"""`CheckpointManager`: the trainer's one entry point for saving and resuming.

It is given the state once, as explicit objects (`stateful.CheckpointState`: model, optimizer,
loader, train state, RNG), and reads and writes those only.

save = agree (one small collective on the checkpoint group: same step? a save in flight? a
writer died?) -> stage 1 (copy into the host buffer; the training stall) -> hand the job to the
stage-2 writer process and return. resume = find the newest checkpoint whose manifest checks,
restore it (every byte read once; checksums verified on the way), fall back to the previous
one if any file is corrupt.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import posixpath
import secrets
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import Field

from megascale.checkpoint import catalog
from megascale.checkpoint.comm import Comm, json_of
from megascale.checkpoint.manifest import FORMAT, VERSION, validate
from megascale.checkpoint.replica import Holding, PeerReplicator, ReplicaStore, build_manifest, choose
from megascale.checkpoint.restore import InMemory, Loaded, load
from megascale.checkpoint.shm import reap_stale, segment_name
from megascale.checkpoint.snapshot import HostBuffer, layout
from megascale.checkpoint.stage2 import Result, Stage2
from megascale.checkpoint.state import (
    install_optimizer_state,
    load_targets,
    record_of,
    rng_from_arrays,
    rng_pieces,
    shared_pieces,
)
from megascale.checkpoint.stateful import CheckpointState
from megascale.checkpoint.storage import CheckpointError, open_root, step_name
from megascale.checkpoint.writer import WriteJob
from megascale.config import JobConfig, to_dict
from megascale.config.operations import checkpoint_root
from megascale.data.shards import DataError
from megascale.parallel.store import StoreAddress

log = logging.getLogger("megascale.checkpoint")
RunId = Annotated[str, Field(pattern=r"^[0-9a-f]{8}$")]
Committed = tuple[int, str] | None  # (step, path) of a confirmed commit


class CheckpointManager:
    def __init__(
        self, cfg: JobConfig, mesh, run_dir: Path, state: CheckpointState, replicas: ReplicaStore | None = None
    ):
        """`replicas`: where this rank process keeps peer copies across recoveries (given under an
        executor, which can recover from them); copies are made every `checkpoint.peer_every` steps
        when the job spans more than one node."""
        self.job_cfg, self.cfg, self.mesh, self.state = cfg, cfg.checkpoint, mesh, state
        self.rank, self.world = mesh.rank, mesh.world_size
        self.root = checkpoint_root(self.cfg, run_dir)
        self.comm = Comm(mesh.grid, self.rank, mesh.checkpoint_groups)
        self.run_id = self.comm.broadcast_json(secrets.token_hex(4), RunId, "run id")
        stale = reap_stale()
        if stale:
            log.info("removed %d checkpoint buffer(s) of dead jobs from /dev/shm: %s", len(stale), ", ".join(stale))
        self.committed: tuple[int, str] | None = None  # (step, path) of the newest confirmed commit
        self.last_stall_s = 0.0  # newest save: time in save() + the optimizer's wait for stage 1
        self.last_result: Result | None = None  # newest stage-2 outcome
        self.last_restore: dict[str, Any] | None = None
        self._buffer: HostBuffer | None = None
        self._buffers_made = 0
        self._writes: tuple | None = None  # (piece keys, which of them this rank writes)
        self._inflight: int | None = None
        self._capture: threading.Thread | None = None  # stage 1 in progress
        self._hooked: torch.optim.Optimizer | None = None
        self.stage2 = Stage2(self.cfg.async_save, self.rank)
        self.replicas = replicas
        self.replicator = self._replicator(replicas)

    def _replicator(self, replicas: ReplicaStore | None) -> PeerReplicator | None:
        local_world = self.mesh.launch.local_world_size or self.world
        if replicas is None or self.cfg.peer_every <= 0 or local_world >= self.world:
            return None  # nobody to recover from the copies, or no other node to keep them
        nodes = self.world // local_world
        stride = self.cfg.peer_stride % nodes or 1  # a stride of the whole ring would keep copies at home
        comm = Comm(self.mesh.grid, self.rank, self.mesh.replica_groups)
        attempt = StoreAddress.from_env(need_master=False).attempt
        return PeerReplicator(replicas, comm, stride * local_world, self.cfg.peer_every, attempt, self._grid_layout())

    def _grid_layout(self) -> dict[str, int]:
        grid = self.mesh.grid
        p = self.job_cfg.parallel
        return {"pp": grid.pp, "dp": grid.dp, "cp": grid.cp, "tp": grid.tp, "vpp": p.vpp, "ep": grid.ep}

    # ------------------------------------------------------------------------------ saving
    @property
    def writer_pid(self) -> int | None:
        """The stage-2 writer process (fault tests kill it)."""
        return self.stage2.pid

    def maybe_save(self) -> None:
        if self.cfg.every > 0 and self.state.step % self.cfg.every == 0:
            self.save()
        else:
            self._poll()  # report a finished write when it finishes, not at the next save
        if self.replicator is not None:
            self.replicator.after_step(self.state)

    def save(self, blocking: bool = False) -> None:
        self._poll()
        start = time.perf_counter()
        step = self.state.step
        pieces, plain = shared_pieces(self.state)
        keys = [p.key for p in pieces]
        if not self._agree(step, keys, blocking):
            return
        rng, rng_meta = rng_pieces(self.rank, self.state.rng.state_dict())
        mine = [piece for piece, write in zip(pieces, self._writes[1], strict=True) if write]
        written = mine + rng
        offsets, nbytes = layout([p.tensor for p in written])
        if self._buffer is None or self._buffer.nbytes != nbytes:
            if self._buffer is not None:
                self._buffer.close()
            self._buffers_made += 1
            self._buffer = HostBuffer(
                nbytes,
                pin=any(p.tensor.is_cuda for p in written),
                name=segment_name(self.run_id, self.rank, self._buffers_made),
            )
        params = {p.param for p in mine}
        index = {
            "records": [record_of(p, off) for p, off in zip(written, offsets, strict=True)],
            "plain": {name: value for name, value in plain.items() if name in params},
            "meta": {"rng": rng_meta, "loader": self.state.loader.state_dict()},
        }
        job = WriteJob(
            step=step,
            root=self.root,
            tmp_name=f"{step_name(step)}.tmp-{self.run_id}",
            rank=self.rank,
            world=self.world,
            shm_name=self._buffer.name,
            nbytes=nbytes,
            index=index,
            commit=self._header(step) if self.rank == 0 else None,
            keep=self.cfg.keep,
            bytes_per_s=self.cfg.write_mb_per_s * 1e6,
            commit_timeout_s=self.cfg.commit_timeout_s,
            durable=self.cfg.fsync,
        )
        self._inflight = step
        tensors = [p.tensor for p in written]
        if self.cfg.async_save:
            self._hook(self.state.optimizer)
            self._capture = threading.Thread(
                target=self._capture_and_send,
                args=(tensors, offsets, job),
                daemon=True,
                name=f"megascale-checkpoint-stage1-{self.rank}",
            )
            self._capture.start()
        else:
            self._buffer.capture(tensors, offsets)
            self._finish(self.stage2.run_inline(job, self._buffer.segment.buf))
        self.last_stall_s = time.perf_counter() - start
        if blocking:
            self._wait()

    def save_final(self) -> FinalSave:
        """Make sure the step reached is committed, waiting for any save in flight first (a
        collective: every rank calls it). What rank 0's writer confirmed is what every rank
        reports, so the exit code and the message say what is really on storage."""
        step, inflight = self.state.step, self._inflight
        if inflight is not None and inflight != step:  # say why the stop takes a while
            log.info("the final save of step %d waits for the save of step %d to finish", step, inflight)
        elif inflight is not None:
            log.info("stopping: the save of step %d is being written; waiting for it", step)
        self._wait()
        self.committed = self.comm.broadcast_json(self.committed, Committed, "newest commit")
        error = None
        if self.committed is None or self.committed[0] != step:
            self.save(blocking=True)
            error = self.last_result[2] if self.last_result and self.last_result[0] == "error" else None
            self.committed, error = self.comm.broadcast_json(
                (self.committed, error), tuple[Committed, str | None], "final save"
            )
        saved = self.committed is not None and self.committed[0] == step
        return FinalSave(step, saved, self.committed, None if saved else error or "see the log")

    def _capture_and_send(self, tensors: list[torch.Tensor], offsets: list[int], job: WriteJob) -> None:
        """Stage 1 beside the next step's data, forward and backward, which read but never
        write these tensors; the optimizer's pre-step hook waits for it. Then stage 2."""
        try:
            self._buffer.capture(tensors, offsets)
        except Exception as exc:
            self.stage2.report(("error", job.step, f"stage 1 failed: {type(exc).__name__}: {exc}"))
            return
        self.stage2.submit(job)

    def _hook(self, optimizer: torch.optim.Optimizer) -> None:
        """Before any optimizer step changes a tensor, the snapshot must be complete."""
        if self._hooked is not optimizer:
            optimizer.register_step_pre_hook(lambda *_: self._join_capture())
            self._hooked = optimizer

    def _join_capture(self) -> None:
        if self._capture is not None:
            start = time.perf_counter()
            self._capture.join()
            self._capture = None
            self.last_stall_s += time.perf_counter() - start

    def _agree(self, step: int, keys: list, blocking: bool) -> bool:
        """One collective: all ranks save the same step, wait or skip together, and learn
        which replicated pieces they write (the lowest rank holding a piece writes it)."""
        exit_code = self.stage2.exit_code()
        dead = exit_code is not None
        if dead:
            log.error(
                "the checkpoint writer process died (exit code %s)%s; restarting it",
                exit_code,
                f" while writing step {self._inflight}" if self._inflight is not None else "",
            )
            self._inflight = None
            self.stage2.start()
        new_layout = self._writes is None or self._writes[0] != keys
        inflight = -1 if self._inflight is None else self._inflight
        top, low, busy, any_dead, any_new = self.comm.all_reduce([step, -step, inflight, dead, new_layout])
        if top != -low:
            log.error("checkpoint skipped: ranks are at different steps (%d to %d)", -low, top)
            return False
        if any_dead and self.rank == 0 and self._inflight is not None:
            self.stage2.abort(self._inflight)
        if any_new:
            holders = self.comm.lowest_holder([json.dumps(key) for key in keys])
            self._writes = (keys, [holder == self.rank for holder in holders])
        if busy >= 0:
            if self.cfg.when_busy == "skip" and not blocking:
                log.warning(
                    "checkpoint at step %d skipped: the save of step %d is still being "
                    "written (checkpoint.when_busy=skip)",
                    step,
                    busy,
                )
                return False
            log.info(
                "checkpoint at step %d waits for the save of step %d to finish (checkpoint.when_busy=wait)", step, busy
            )
            self._wait()
        return True

    def _header(self, step: int) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "world_size": self.world,
            "layout": self._grid_layout(),
            "config": to_dict(self.job_cfg),
            "created": time.time(),
            "run_id": self.run_id,
            "torch": torch.__version__,
        }

    def _poll(self) -> None:
        """Report finished stage-2 writes without waiting."""
        for result in self.stage2.ready():
            self._finish(result)

    def _wait(self) -> None:
        """Block until this rank's in-flight save has finished (or its writer died)."""
        self._join_capture()
        while self._inflight is not None and self.cfg.async_save:
            result = self.stage2.next(timeout=0.5, inflight=self._inflight)
            if result is not None:
                self._finish(result)

    def _finish(self, message: Result) -> None:
        kind, step, info = message
        self.last_result = message
        if step == self._inflight:
            self._inflight = None
        if kind == "ok":
            if "path" in info:  # rank 0: the commit is confirmed (renamed, synced, verified)
                self.committed = (step, info["path"])
                log.info(
                    "checkpoint step %d committed: %s (%.1f MB, stage 2 %.2f s)%s",
                    step,
                    info["path"],
                    info["total_bytes"] / 1e6,
                    info["write_s"],
                    f"; removed {', '.join(info['removed'])}" if info["removed"] else "",
                )
                for line in info["quarantined"]:
                    log.warning("invalid checkpoint moved aside (never loaded; inspect or delete it): %s", line)
                for line in info["unchecked"]:
                    log.warning("checkpoint left in place after a storage error: %s", line)
        else:
            log.error(
                "checkpoint at step %d FAILED on rank %d: %s -- training continues; older checkpoints are intact",
                step,
                self.rank,
                info,
            )

    # ------------------------------------------------------------------------------ resuming
    def resume(self) -> bool:
        """Load per `checkpoint.resume`: "auto" = the newest valid checkpoint under the
        checkpoint dir (none = start fresh), "none", or a path (a checkpoint or a root)."""
        mode = self.cfg.resume
        if mode == "none":
            log.info("checkpoint.resume=none: starting from scratch")
            return False
        fs, root = open_root(self.root if mode == "auto" else mode)
        candidates = catalog.candidates(fs, root) if self.rank == 0 else []
        newest = candidates[0][1]["step"] if candidates else None
        newest = self.comm.broadcast_json(newest, int | None, "newest step")
        if self.replicas is not None and mode == "auto" and self._resume_from_memory(newest):
            return True
        path = self._load_newest(fs, candidates)
        if path is None:
            if mode != "auto":
                raise CheckpointError(f"checkpoint.resume={mode!r}: no valid checkpoint there (see the warnings above)")
            log.info("no valid checkpoint under %s: starting from scratch", root)
            return False
        if posixpath.dirname(path) == open_root(self.root)[1]:
            self.committed = (self.state.step, path)  # already here: the same state is not saved again
        return True

    def rollback(self) -> int | None:
        """Restore the newest valid checkpoint of this run in place (a loss spike): wait for the
        save in flight, load it into the live state; its step, or None when there is none."""
        self._wait()
        fs, root = open_root(self.root)
        loaded = self._load_newest(fs, catalog.candidates(fs, root) if self.rank == 0 else [])
        return None if loaded is None else self.state.step

    def _load_newest(self, fs, candidates: list) -> str | None:
        """Load the first of rank 0's `candidates` that loads on every rank; its path, or None."""
        while True:
            entry = candidates.pop(0) if candidates else None
            path = self.comm.broadcast_json(entry[0] if entry else None, str | None, "checkpoint path")
            if path is None:
                return None
            try:
                self._load(fs, path, entry[1] if entry else None)
            except CheckpointError as exc:
                log.warning("checkpoint %s cannot be used: %s -- trying the previous one", path, exc)
                continue
            if self.replicas is not None:
                self.replicas.discard_after(self.state.step)
            return path

    def last_good(self) -> str:
        """The newest checkpoint this rank knows committed, said for an error message."""
        known = self.committed and f"step {self.committed[0]} in {self.committed[1]}"
        return known or ("none committed by this run" if self.rank == 0 else "named in rank 0's log")

    def _resume_from_memory(self, storage_step: int | None) -> bool:
        """Restore from the newest generation of peer copies that covers every rank, when it is at
        least as new as storage's newest checkpoint; a generation that fails a check is skipped.
        Rank 0 chooses (from every rank's holdings) and builds the manifest (from the headers of
        the copies each file's reader holds); every rank then learns who reads which file."""
        skip: set = set()
        while True:
            held = self.comm.gather_bytes(json.dumps(self.replicas.holdings()).encode())
            choice = None
            if self.rank == 0:
                holdings = [
                    [h.model_dump() for h in json_of(list[Holding], held[r], f"holdings of rank {r}")]
                    for r in range(self.world)
                ]
                choice = choose(holdings, self.world, self._grid_layout(), skip)
            choice = self.comm.broadcast_json(choice, tuple[tuple[int, int], dict[str, int]] | None, "copy choice")
            if choice is None:
                log.info("no complete generation of peer copies in memory: restoring from storage")
                self.replicas.forget(skip)
                return False
            generation, readers = choice
            if storage_step is not None and storage_step > generation[0]:
                log.info(
                    "storage's step %d is newer than the peer copies' step %d: restoring from storage",
                    storage_step,
                    generation[0],
                )
                self.replicas.forget(skip)
                return False
            mine = {name: c for name, c in self.replicas.files(generation).items() if readers.get(name) == self.rank}
            got = self.comm.gather_bytes(json.dumps([c.header for c in mine.values()]).encode())
            where = f"peer memory (step {generation[0]} of attempt {generation[1]})"
            manifest, error = None, None
            if self.rank == 0:
                try:
                    headers = [
                        h
                        for r in range(self.world)
                        for h in json_of(list[dict[str, Any]], got[r], f"copy headers of rank {r}")
                    ]
                    manifest = build_manifest(
                        headers, generation, self.world, self._grid_layout(), to_dict(self.job_cfg), self.run_id
                    )
                    validate(manifest, where)
                    manifest["manifest_bytes"] = 0
                except CheckpointError as exc:
                    error = str(exc)
            try:
                error = self.comm.broadcast_json(error, str | None, "copy manifest status")
                if error is not None:
                    raise CheckpointError(error)
                self._load(None, where, manifest, InMemory({n: c.data for n, c in mine.items()}, readers))
            except CheckpointError as exc:
                log.warning("%s cannot be used: %s -- trying older copies, then storage", where, exc)
                skip.add(generation)
                continue
            self.replicas.forget(skip)
            self.replicas.discard_after(generation[0])
            return True

    def _load(self, fs, path: str, manifest: dict | None, memory: InMemory | None = None) -> None:
        """Collective; `manifest` (validated) is needed on rank 0 only."""
        start = time.perf_counter()
        loaded = load(fs, path, manifest, self.comm, lambda fields: load_targets(self.state, fields), memory)
        try:
            self.comm.agree(self._install(loaded))
        except CheckpointError as exc:  # every rank falls back together
            raise CheckpointError(f"{path}: {exc}") from None
        shape, restored = loaded.outline, loaded.restored
        if not (restored.rng and loaded.part.own_meta):
            log.warning(
                "rank %d has no RNG state in %s (saved by %d ranks): it keeps its seeded RNG",
                self.rank,
                path,
                shape.world_size,
            )
        read = self.comm.all_reduce([restored.bytes_read], "sum")[0] + shape.manifest_bytes
        self.last_restore = {
            "path": path,
            "step": self.state.step,
            "bytes_read": read,
            "checkpoint_bytes": shape.stored_bytes,
            "seconds": time.perf_counter() - start,
            "source": "storage" if memory is None else "memory",
        }
        saved = shape.layout
        log.info(
            "resumed from %s at step %d (saved as pp=%d dp=%d ep=%d cp=%d tp=%d, %d ranks; "
            "read %d of %d stored bytes, %.2f s)",
            path,
            self.state.step,
            saved.pp,
            saved.dp,
            saved.ep,
            saved.cp,
            saved.tp,
            shape.world_size,
            read,
            shape.stored_bytes,
            self.last_restore["seconds"],
        )
        if shape.model != to_dict(self.job_cfg)["model"]:
            log.warning("the checkpoint's model config differs from this job's (shapes match)")

    def _install(self, loaded: Loaded) -> list[str]:
        """Put the loaded state in place; a value a state object rejects is reported, not raised,
        so that all ranks agree on the outcome (a data-config mismatch still stops the job)."""
        meta = loaded.part.meta
        plain = {
            name: {key: s.model_dump(exclude_none=True) for key, s in scalars.items()}
            for name, scalars in loaded.outline.plain.items()
        }
        try:
            install_optimizer_state(self.state, loaded.targets, plain)
            self.state.train.load_state_dict({"step": loaded.outline.step})
            self.state.loader.load_state_dict(dict(meta.loader))
            if loaded.restored.rng and loaded.part.own_meta:
                rng = {name: info for name, info in meta.rng.model_dump().items() if info is not None}
                self.state.rng.load_state_dict(rng_from_arrays(loaded.restored.rng, rng))
        except DataError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
            return [f"rank {self.rank} cannot use its state: {type(exc).__name__}: {exc}"]
        return []

    def abandon(self) -> None:
        """A peer failed: let the writer finish what it writes (a commit whose every part gets
        written still lands, as when a rank dies) and end, free the host buffer; wait for
        nothing that needs another rank."""
        self._join_capture()  # a memory copy, no communication
        self.stage2.detach()
        if self._buffer is not None:
            self._buffer.close()  # the writer keeps its own mapping until it is done
            self._buffer = None

    def close(self) -> None:
        """Wait for the in-flight save and peer copy, stop the writer and free the host buffer."""
        if self.replicator is not None:
            self.replicator.wait()
        self._wait()
        self.stage2.close()
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


@dataclasses.dataclass(frozen=True)
class FinalSave:
    step: int  # the step reached
    saved: bool  # it is committed
    newest: tuple[int, str] | None  # (step, path) of the newest commit this job confirmed
    error: str | None  # why the step is not saved

    def describe(self) -> str:
        if self.saved:
            return f"step {self.step} is saved in {self.newest[1]}"
        older = (
            f"the newest checkpoint this run committed is step {self.newest[0]} ({self.newest[1]}): "
            f"steps {self.newest[0] + 1}-{self.step} would be trained again"
            if self.newest
            else "this run committed no checkpoint"
        )
        return f"step {self.step} was NOT saved ({self.error}); {older}"
