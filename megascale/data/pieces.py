"""A long text document tokenised in bounded pieces, with the tokens of the whole.

The planner cuts the file at nominal boundaries every `piece` bytes (tasks.py); the worker of
each piece moves its boundaries to safe cuts, found the same way by the neighbour on either side,
so the pieces tile the document. A cut is a line start (after a newline, before a non-space) or
a word start (before a single space), where encoding the text on either side separately gives
the tokens of encoding the two together -- checked with the tokenizer itself on a window of
WINDOW bytes each side, so it holds for whatever pre-tokenizer and normaliser the file has. The
search looks at most SEARCH bytes past a nominal boundary; a boundary with no safe cut there is
dropped, and the piece before it runs on to the next boundary that has one (a document without
line breaks or spaces is encoded whole, as a single piece).
"""

from __future__ import annotations

import re

WINDOW = 1024  # bytes each side of a candidate cut that must encode the same apart as together
SEARCH = 64 << 10  # bytes after a nominal boundary searched for a safe cut
MAX_CHECKS = 64  # candidates tried per boundary
CANDIDATE = re.compile(rb"(?<=\n)[^\s]|(?<=[^\s]) (?=[^\s])")


def _whole_chars(data: bytes) -> bytes:
    """`data` without a partial UTF-8 character at either end."""
    start = 0
    while start < len(data) and start < 4 and data[start] & 0xC0 == 0x80:
        start += 1
    end = len(data)
    for back in range(1, min(4, len(data)) + 1):  # a lead byte whose sequence runs past the end
        byte = data[-back]
        if byte & 0xC0 != 0x80:
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            if need > back:
                end = len(data) - back
            break
    return data[start:end]


class Cutter:
    """Safe cuts in one file for one tokenizer (`encode`: list of str -> list of token lists)."""

    def __init__(self, path: str, size: int, encode, takes_text: bool):
        self.path, self.size, self.encode, self.takes_text = path, size, encode, takes_text

    def cut(self, boundary: int, piece: int) -> int | None:
        """The safe cut for the nominal boundary at byte `boundary`, or None; it lies before the
        next boundary, so the cuts of a file come in order."""
        if not self.takes_text:
            return boundary  # byte-level: every byte is its own token
        lo, search = max(0, boundary - WINDOW), min(SEARCH, piece)
        with open(self.path, "rb") as f:
            f.seek(lo)
            data = f.read(boundary - lo + search + WINDOW)
        for checks, match in enumerate(CANDIDATE.finditer(data, boundary - lo, boundary - lo + search)):
            if checks == MAX_CHECKS:
                break
            at = match.start()
            if self._safe(data[max(0, at - WINDOW) : at], data[at : at + WINDOW]):
                return lo + at
        return None

    def _safe(self, left: bytes, right: bytes) -> bool:
        try:
            a, b = _whole_chars(left).decode(), _whole_chars(right).decode()
        except UnicodeDecodeError:
            return False
        together, apart_a, apart_b = self.encode([a + b, a, b])
        return list(together) == list(apart_a) + list(apart_b)

    def bounds(self, start: int, piece: int) -> tuple[int, int] | None:
        """(begin, end) bytes of the piece whose nominal range starts at `start`; None when its
        start boundary has no safe cut (its bytes belong to the piece before)."""
        begin = 0 if start == 0 else self.cut(start, piece)
        if begin is None:
            return None
        boundary = start + piece
        while boundary < self.size:
            end = self.cut(boundary, piece)
            if end is not None:
                return begin, end
            boundary += piece
        return begin, self.size
