"""The manifest: its schema, its own checksum, and every check made before a byte of data is read.

Nothing in a manifest is trusted. Rank 0 validates it against the schema below (pydantic, strict:
no type coercion, no unknown keys), recomputes its checksum (sha256 of its canonical JSON without
the `checksum` key, so that any edit, even one byte of one offset, is caught), checks it against
its directory's name, checks that every file name is a rank data file inside the checkpoint
directory and that every tensor record lies inside its file without overlapping another, and
finally that every listed file exists with its recorded size. Each defect is a `CheckpointError`,
which makes resume and export fall back to the previous checkpoint. No torch here: the stage-2
writer uses this module to prune by validity.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from typing import Annotated, Any, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from typing_extensions import TypedDict

from megascale.checkpoint.storage import MANIFEST, CheckpointError, join, parse_name, paused_gc, read_json
from megascale.layout.shard import ShardSpec

FORMAT = "megascale-checkpoint"
VERSION = 2  # 2: the manifest carries its checksum and commit sequence number
RNG = "__rng__/"  # parameter name prefix of a rank's RNG arrays
# bytes per element of every dtype a checkpoint may hold (torch names without "torch.")
DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
DATA_FILE = re.compile(r"^rank-(\d{5,})\.bin$")
_SHA256 = r"^[0-9a-f]{64}$"

Count = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]
Name = Annotated[str, Field(min_length=1, max_length=1000)]
DType = Literal[tuple(DTYPE_SIZES)]  # type: ignore[valid-type]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class FileInfo(Strict):
    size: Count
    sha256: Annotated[str, Field(pattern=_SHA256)]


class _Spec(TypedDict):
    __pydantic_config__ = ConfigDict(strict=True, extra="forbid")  # type: ignore[misc]
    global_shape: list[Count]
    tp_dim: Count | None
    tp_rank: Count
    tp_size: Positive
    flat_range: Annotated[list[Count], Field(min_length=2, max_length=2)] | None


def _consistent_spec(spec: _Spec) -> _Spec:
    if spec["tp_rank"] >= spec["tp_size"]:
        raise ValueError(f"tp_rank {spec['tp_rank']} is not below tp_size {spec['tp_size']}")
    dim, shape = spec["tp_dim"], spec["global_shape"]
    if dim is not None and (dim >= len(shape) or shape[dim] % spec["tp_size"]):
        raise ValueError(f"tp_dim {dim} cannot split {shape} {spec['tp_size']} ways")
    if spec["flat_range"] is not None and spec["flat_range"][0] > spec["flat_range"][1]:
        raise ValueError(f"flat_range {spec['flat_range']} ends before it starts")
    return spec


# A `ShardSpec.to_json()`, checked. Records are plain dicts checked by functions (no model object
# per record): a 12,288-rank manifest holds millions of them.
Spec = Annotated[_Spec, AfterValidator(_consistent_spec)]


class _Record(TypedDict):
    __pydantic_config__ = ConfigDict(strict=True, extra="forbid")  # type: ignore[misc]
    param: Name
    field: Name
    spec: Spec | None
    dtype: DType
    shape: list[Count]
    file: Name
    offset: Count
    nbytes: Count


def _consistent_record(rec: _Record) -> _Record:
    numel = math.prod(rec["shape"])
    if rec["nbytes"] != numel * DTYPE_SIZES[rec["dtype"]]:
        raise ValueError(
            f"{rec['param']} {rec['field']}: {rec['nbytes']} bytes for shape {rec['shape']} of {rec['dtype']}"
        )
    if rec["param"].startswith(RNG):
        if rec["spec"] is not None or not rec["param"][len(RNG) :].isdigit():
            raise ValueError(f"RNG record {rec['param']!r} must name a rank and have no spec")
    elif rec["spec"] is None or ShardSpec.from_json(rec["spec"]).numel != numel:
        raise ValueError(f"{rec['param']} {rec['field']}: shape {rec['shape']} does not match its spec")
    return rec


TensorRecord = Annotated[_Record, AfterValidator(_consistent_record)]


class Layout(Strict):
    pp: Positive
    dp: Positive
    tp: Positive
    vpp: Positive
    ep: Positive = 1  # expert-parallel degree within dp (manifests before it had none: 1)
    cp: Positive = 1  # context-parallel degree (manifests before it had none: 1)


class PythonRng(Strict):
    version: int
    gauss_next: float | None


class NumpyRng(Strict):
    kind: Literal["MT19937"]
    pos: Count
    has_gauss: Count
    cached_gaussian: float


class TensorRng(Strict):
    pass


class RngMeta(Strict):
    python: PythonRng | None = None
    numpy: NumpyRng | None = None
    torch: TensorRng | None = None
    cuda: TensorRng | None = None


class RankMeta(Strict):
    rng: RngMeta
    loader: dict[str, str | int]


class Scalar(Strict):
    kind: Literal["tensor", "bool", "int", "float"]
    value: bool | int | float
    dtype: DType | None = None

    @model_validator(mode="after")
    def _typed(self) -> Scalar:
        if (self.kind == "tensor") != (self.dtype is not None):
            raise ValueError("a dtype is given for tensor scalars, and only for them")
        return self


class JobConfigRecord(BaseModel):
    """The job's resolved config; only the model section is read back (export, a warning)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    model: dict[str, Any]


class Manifest(Strict):
    format: Literal[FORMAT]  # type: ignore[valid-type]
    version: Literal[VERSION]  # type: ignore[valid-type]
    step: Count
    seq: Positive  # commit order within the checkpoint root: the newest commit has the highest
    world_size: Positive
    layout: Layout
    config: JobConfigRecord
    created: float
    run_id: Name
    torch: str
    files: dict[Name, FileInfo]
    tensors: list[TensorRecord]  # `validate` checks them apart (`_RECORDS`) and passes [] here
    ranks: dict[Annotated[str, Field(pattern=r"^\d{1,9}$")], RankMeta]
    plain: dict[Name, dict[Name, Scalar]]
    checksum: Annotated[str, Field(pattern=_SHA256)]


_RECORDS = TypeAdapter(list[TensorRecord])
_CHUNK = 65536


def checksum(manifest: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of everything but the checksum itself."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    return dict(manifest, checksum=checksum(manifest))


def validate(data: Any, path: str) -> Manifest:
    """The parsed manifest if its content is sound; every check that needs no storage access."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: {MANIFEST} is not a {FORMAT} manifest")
    if data.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: format version {data.get('version')!r}, this megascale reads "
            f"version {VERSION}; load it with the megascale that wrote it"
        )
    records = data.get("tensors")
    try:
        with paused_gc():
            manifest = Manifest.model_validate({**data, "tensors": []})
            if not isinstance(records, list):
                raise CheckpointError(f"{path}: {MANIFEST} does not fit the schema (tensors: not a list)")
            for start in range(0, len(records), _CHUNK):  # checked apart: no second copy of them kept
                try:
                    _RECORDS.validate_python(records[start : start + _CHUNK])
                except ValidationError as exc:
                    raise _schema_error(path, exc, ["tensors", start]) from None
    except ValidationError as exc:
        raise _schema_error(path, exc, []) from None
    if checksum(data) != manifest.checksum:
        raise CheckpointError(f"{path}: {MANIFEST} was changed after it was written (checksum mismatch)")
    named = parse_name(os.path.basename(path.rstrip("/")))
    if named is not None and named[0] != manifest.step:
        raise CheckpointError(
            f"{path}: the manifest says step {manifest.step}, the directory name says step {named[0]}"
        )
    _check_files_and_ranks(manifest, path, records)
    check_records(records, {name: info.size for name, info in manifest.files.items()}, path)
    return manifest


def _schema_error(path: str, exc: ValidationError, prefix: list) -> CheckpointError:
    first = exc.errors()[0]
    loc = list(first["loc"])
    if prefix:  # the chunk's index, shifted to the record's place in the manifest
        loc = [prefix[0], prefix[1] + loc[0], *loc[1:]]
    where = ".".join(str(part) for part in loc) or "(top level)"
    return CheckpointError(
        f"{path}: {MANIFEST} does not fit the schema ({exc.error_count()} problem(s); first: {where}: {first['msg']})"
    )


def _check_files_and_ranks(manifest: Manifest, path: str, records: list[dict]) -> None:
    for name in manifest.files:
        match = DATA_FILE.match(name)
        if match is None:
            raise CheckpointError(f"{path}: file name {name!r} is not a rank data file (rank-NNNNN.bin)")
        if int(match.group(1)) >= manifest.world_size:
            raise CheckpointError(f"{path}: {name} names a rank beyond world_size {manifest.world_size}")
    if "0" not in manifest.ranks or any(int(r) >= manifest.world_size for r in manifest.ranks):
        raise CheckpointError(f"{path}: per-rank metadata must cover rank 0 and ranks below world_size")
    rng_records = {(rec["param"][len(RNG) :], rec["field"]) for rec in records if rec["param"].startswith(RNG)}
    for rank, meta in manifest.ranks.items():
        for name in meta.rng.model_dump(exclude_none=True):
            if (str(int(rank)), name) not in rng_records:
                raise CheckpointError(f"{path}: rank {rank}'s {name} RNG state has no tensor record")


def check_records(records: list[dict], sizes: dict[str, int], path: str) -> None:
    """Every record inside its file, none overlapping another (a manifest's, or a peer copy's)."""
    by_file: dict[str, list[tuple[int, int, dict]]] = {}
    for rec in records:
        if rec["file"] not in sizes:
            raise CheckpointError(f"{path}: {rec['param']} {rec['field']} is in {rec['file']!r}, which is not listed")
        by_file.setdefault(rec["file"], []).append((rec["offset"], rec["nbytes"], rec))
    for name, file_records in by_file.items():
        end = 0
        for offset, nbytes, rec in sorted(file_records, key=lambda r: r[0]):
            if offset < end:
                raise CheckpointError(
                    f"{path}: {rec['param']} {rec['field']} at offset {offset} of {name} "
                    f"overlaps the record before it (ends at {end})"
                )
            end = offset + nbytes
        if end > sizes[name]:
            raise CheckpointError(f"{path}: records of {name} reach byte {end}, the file has {sizes[name]}")


def confined(fs: fsspec.AbstractFileSystem, directory: str, name: str) -> str:
    """The path of `name` inside `directory`; a name or link leading elsewhere is a defect."""
    if DATA_FILE.match(name) is None and name != MANIFEST:
        raise CheckpointError(f"{directory}: {name!r} is not a checkpoint file name")
    path = join(directory, name)
    if isinstance(fs, LocalFileSystem):
        real_dir = os.path.realpath(directory)
        if os.path.dirname(os.path.realpath(path)) != real_dir:
            raise CheckpointError(f"{path} resolves to {os.path.realpath(path)}, outside the checkpoint")
    return path


def check_manifest(fs: fsspec.AbstractFileSystem, path: str) -> tuple[dict, int]:
    """Read a checkpoint's manifest, validate it, and check (metadata only) that every listed file
    exists with its recorded size. Returns (manifest as a dict, manifest bytes); the data files'
    checksums are verified when they are read."""
    manifest_path = confined(fs, path, MANIFEST)
    if not fs.exists(manifest_path):
        raise CheckpointError(f"{path} is partial: it has no {MANIFEST}")
    with paused_gc():
        try:
            data, nbytes = read_json(fs, manifest_path)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON ({exc})") from exc
        manifest = validate(data, path)
    for name, info in manifest.files.items():
        file_path = confined(fs, path, name)
        if not fs.exists(file_path):
            raise CheckpointError(f"{path} is partial: {name} is missing")
        size = fs.size(file_path)
        if size != info.size:
            raise CheckpointError(f"{path}: {name} has {size} bytes, the manifest says {info.size}")
    data["manifest_bytes"] = nbytes
    return data, nbytes


def checkpoint_bytes(manifest: dict) -> int:
    """Bytes stored for a checkpoint: its data files and its manifest."""
    return sum(info["size"] for info in manifest["files"].values()) + manifest["manifest_bytes"]
