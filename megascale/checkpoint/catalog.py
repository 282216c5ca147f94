"""What a checkpoint root holds, in commit order: which checkpoint to resume, what to prune.

"Newest" means committed last, not highest step: each manifest carries `seq`, one more than the
highest `seq` in the root when it was committed. So after resuming an older checkpoint on
purpose (`resume=PATH`), the abandoned timeline's higher steps neither hide the new commits from
resume nor push them out of `keep`. Validity is judged by `manifest.check_manifest` (schema,
checksum, name, bounds, files and sizes). No torch here: the stage-2 writer prunes with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import fsspec

from megascale.checkpoint.manifest import check_manifest
from megascale.checkpoint.storage import (
    MANIFEST,
    QUARANTINE,
    CheckpointError,
    Entry,
    committed,
    join,
    remove,
    rename,
    step_name,
    sync_dir,
    temporaries,
)

log = logging.getLogger("megascale.checkpoint")


@dataclass(frozen=True)
class Valid:
    entry: Entry
    manifest: dict

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.manifest["seq"], self.entry.step, self.entry.generation)


@dataclass
class Survey:
    valid: list[Valid] = field(default_factory=list)  # newest commit first
    invalid: list[tuple[Entry, str]] = field(default_factory=list)  # committed name, a defect
    unreadable: list[tuple[Entry, str]] = field(default_factory=list)  # storage error: left alone
    temporaries: list[Entry] = field(default_factory=list)

    @property
    def newest(self) -> Valid | None:
        return self.valid[0] if self.valid else None


def survey(fs: fsspec.AbstractFileSystem, root: str) -> Survey:
    """Every directory under root, judged; reads manifests and file sizes, no data."""
    out = Survey(temporaries=temporaries(fs, root))
    for entry in committed(fs, root):
        try:
            out.valid.append(Valid(entry, check_manifest(fs, entry.path)[0]))
        except CheckpointError as exc:
            out.invalid.append((entry, str(exc)))
        except OSError as exc:  # cannot tell: never judged invalid, never pruned
            out.unreadable.append((entry, f"{type(exc).__name__}: {exc}"))
    out.valid.sort(key=lambda v: v.order, reverse=True)
    return out


def candidates(fs: fsspec.AbstractFileSystem, path: str) -> list[tuple[str, dict]]:
    """Checkpoints to load from `path` (one checkpoint, or a root), as (path, manifest), newest
    commit first; every checkpoint skipped and every uncommitted save is logged with its reason."""
    if fs.exists(join(path, MANIFEST)):
        try:
            return [(path, check_manifest(fs, path)[0])]
        except (CheckpointError, OSError) as exc:
            log.warning("skipping checkpoint %s: %s", path, exc)
            return []
    found = survey(fs, path)
    for entry, why in found.invalid + found.unreadable:
        log.warning("skipping checkpoint %s: %s", entry.path, why)
    for entry in found.temporaries:
        log.warning(
            "%s is a save of step %d that never committed (killed or failed): ignored, removed by the next commit",
            entry.path,
            entry.step,
        )
    return [(valid.entry.path, valid.manifest) for valid in found.valid]


def next_commit(current: Survey, step: int) -> tuple[str, int]:
    """(directory name, seq) for committing `step`: a generation no directory has yet."""
    seq = 1 + max((v.manifest["seq"] for v in current.valid), default=0)
    entries = [v.entry for v in current.valid] + [e for e, _ in current.invalid + current.unreadable]
    taken = [e.generation for e in entries if e.step == step]
    return step_name(step, max(taken) + 1 if taken else 0), seq


def _tidy(out: Pruned, done: list[str], what: str, action) -> None:
    """One removal or move; a storage error leaves that entry in place, reported, and never
    turns the commit that has already happened into a failure."""
    try:
        action()
    except OSError as exc:
        out.unchecked.append(f"{what.split(' ', 1)[0]}: not tidied ({type(exc).__name__}: {exc})")
    else:
        done.append(what)


@dataclass
class Pruned:
    removed: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)  # "name: defect"
    unchecked: list[str] = field(default_factory=list)  # "name: storage error", left in place


def prune(
    fs: fsspec.AbstractFileSystem, root: str, keep: int, just_committed: str, tag: str, durable: bool = True
) -> Pruned:
    """Keep the newest `keep` valid checkpoints (by commit order; an older commit of a step that
    was committed again later does not count and goes), move invalid ones aside, delete the
    temporaries of dead saves: other runs' (`tag` is this run's id), and this run's up to the
    step just committed. Refuses to touch anything unless `just_committed` is valid and
    the newest: nothing is removed on the word of a commit that did not hold."""
    current = survey(fs, root)
    if current.newest is None or current.newest.entry.name != just_committed:
        problem = dict((e.name, why) for e, why in current.invalid).get(just_committed, "not the newest")
        raise CheckpointError(f"the commit of {just_committed} did not verify ({problem}); nothing pruned")
    out = Pruned()
    step = current.newest.entry.step
    kept_steps: set[int] = set()
    for valid in current.valid:
        if valid.entry.step not in kept_steps and len(kept_steps) < keep:
            kept_steps.add(valid.entry.step)
        else:
            _tidy(out, out.removed, valid.entry.name, lambda e=valid.entry: remove(fs, e.path))
    for entry, why in current.invalid:
        aside = entry.name + QUARANTINE + tag
        _tidy(
            out,
            out.quarantined,
            f"{entry.name} -> {aside}: {why}",
            lambda e=entry, a=aside: rename(fs, e.path, join(root, a)),
        )
    for entry in current.temporaries:  # other ranks may already be writing this run's next save
        if entry.name.rsplit("-", 1)[1] != tag or entry.step <= step:
            _tidy(out, out.removed, entry.name, lambda e=entry: remove(fs, e.path))
    out.unchecked += [f"{entry.name}: {why}" for entry, why in current.unreadable]
    if out.removed or out.quarantined:
        sync_dir(fs, root, durable)
    return out
