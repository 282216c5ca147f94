"""What `prep` read, wrote and skipped, and the check that these add up on every run.

Documents in = documents written + empty + encoded to nothing + skipped (by reason); tokens
written = tokens the tokenizer produced (with any BOS) + one end-of-document token per document; stored bytes
read = the inputs' sizes. Rejected records stop the run with their place (file and line, or
global row), or with `--on-error=skip` are counted and listed in `rejected.jsonl`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import IO

from megascale.data.records import Reject, TaskResult
from megascale.data.shards import DataError, ShardWriter
from megascale.data.tasks import Task

REJECTED = "rejected.jsonl"


class LostData(RuntimeError):
    """The counts do not add up: prep would have lost data without a word (a bug)."""


class Ledger:
    def __init__(self, out_dir: Path, on_error: str, expected_bytes: int):
        self.out_dir, self.on_error, self.expected_bytes = out_dir, on_error, expected_bytes
        self.counts: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self._file_index, self._units_before = -1, 0
        self._rejected: IO[str] | None = None

    def add(self, task: Task, result: TaskResult) -> None:
        """Count one task's result (tasks come in input order); a rejected record stops the run
        unless bad records are skipped."""
        if task.index != self._file_index:
            self._file_index, self._units_before = task.index, 0
        for reject in result.rejects:
            self._reject(task, reject)
        c = self.counts
        c["bytes_read"] += result.size
        c["documents_in"] += result.documents_in
        c["documents"] += len(result.lengths)
        c["tokens_in"] += result.tokens_in
        c["empty_documents"] += result.empty
        c["no_token_documents"] += result.no_tokens
        c["blank_lines"] += result.blank_lines
        c["replaced_invalid"] += result.replaced
        c["eod_inside_documents"] += result.eod_inside
        self._units_before += result.units

    def _reject(self, task: Task, reject: Reject) -> None:
        where = self.place(task, reject.unit)
        if self.on_error != "skip":
            raise DataError(
                f"{_place_text(where)}: {reject.detail} (pass --on-error=skip to skip and count such records)"
            )
        self.skipped[reject.reason] += 1
        if self._rejected is None:
            self._rejected = open(self.out_dir / REJECTED, "w")  # noqa: SIM115 - closed in close()
        self._rejected.write(json.dumps({**where, "reason": reject.reason, "detail": reject.detail}) + "\n")

    def place(self, task: Task, unit: int) -> dict:
        """Where a record is: file and line (1-based), file and row (0-based), or the file."""
        kind, position = task.file.kind, self._units_before + unit
        if kind in ("jsonl", "lines"):
            return {"file": task.file.name, "line": position + 1}
        if kind in ("parquet", "arrow"):
            return {"file": task.file.name, "row": position}
        return {"file": task.file.name}

    def close(self) -> None:
        if self._rejected is not None:
            self._rejected.close()

    def check(self, writer: ShardWriter) -> None:
        """The invariant; raises LostData naming the figures that disagree."""
        c, skipped = self.counts, sum(self.skipped.values())
        accounted = c["documents"] + c["empty_documents"] + c["no_token_documents"] + skipped
        problems = []
        if c["documents_in"] != accounted:
            problems.append(
                f"{c['documents_in']} documents read but {c['documents']} written + "
                f"{c['empty_documents']} empty + {c['no_token_documents']} without tokens + "
                f"{skipped} skipped = {accounted}"
            )
        written_docs = writer.documents_written
        if written_docs != c["documents"] or writer.tokens_written != c["tokens_in"] + c["documents"]:
            problems.append(
                f"{c['tokens_in']} tokens encoded in {c['documents']} documents but "
                f"{writer.tokens_written} tokens in {written_docs} documents written "
                f"(each document adds one end-of-document token)"
            )
        if c["bytes_read"] != self.expected_bytes:
            problems.append(f"{c['bytes_read']} input bytes read of {self.expected_bytes}")
        if problems:
            raise LostData("prep's counts do not add up (a bug in prep; nothing was written): " + "; ".join(problems))

    def summary(self) -> dict:
        """The counts for the manifest."""
        return {**{k: self.counts[k] for k in sorted(self.counts)}, "skipped": dict(sorted(self.skipped.items()))}


def _place_text(where: dict) -> str:
    if "line" in where:
        return f"{where['file']}:{where['line']}"
    if "row" in where:
        return f"{where['file']}: row {where['row']}"
    return where["file"]
