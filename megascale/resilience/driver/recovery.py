"""Each recovery's phases, from the driver's event log: where the seconds between a fault and the
next step went.

    detect      last step progress -> fault blamed (the detection windows)
    stop        fault -> the failed attempt's ranks are stopped (or, on the fast path, paused)
    decide      -> the path is chosen and the new attempt's commands are out (a blocking
                   self-check, when the restart path runs one, is in here: `selfcheck_s`)
    replace     -> every rank of the new attempt has joined the rendezvous (process start or
                   standby hand-over, imports, mesh)
    restore     -> every rank has its state back (peer memory or storage)
    first_step  -> the first step of the new attempt is seen

`joined` and `restored` come from the ranks (their status files carry when they joined the mesh
and when their state was back); the rest are the driver's own events. Pure function of events.
"""

from __future__ import annotations

from typing import Any

PHASES = ("detect", "stop", "decide", "replace", "restore", "first_step")


def _span(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None


def recovery_phases(fault: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """The record of the recovery from `fault` (a "fault" event) among the job's events."""
    attempt = fault["attempt"]

    def last(kind: str, **match: Any) -> dict[str, Any] | None:
        """An attempt has one fault; a fast path that fell back stops twice: the last one counts."""
        found = [e for e in events if e["event"] == kind and all(e.get(k) == v for k, v in match.items())]
        return found[-1] if found else None

    stopped = last("stopped", attempt=attempt)
    decided = last("decide", attempt=attempt)
    checked = last("selfcheck", attempt=attempt)
    resumed = last("resumed", fault_detected=fault["detected"])
    joined = resumed.get("joined") if resumed else None
    restored = resumed.get("restored") if resumed else None
    marks = [
        fault.get("last_progress"),
        fault["detected"],
        stopped and stopped["time"],
        decided and decided["time"],
        joined,
        restored,
        resumed and resumed["resumed"],
    ]
    spans = {f"{name}_s": _span(a, b) for name, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True)}
    if joined is None and resumed:  # ranks that did not say when they joined: replace and restore as one
        spans["replace_s"] = _span(marks[3], restored)
    return {
        "path": decided.get("path") if decided else None,
        "path_reason": decided.get("reason") if decided else None,
        "selfcheck": decided.get("selfcheck") if decided else None,
        "selfcheck_s": _span(stopped and stopped["time"], checked and checked["time"]) if checked else None,
        "restore_source": resumed.get("source") if resumed else None,
        "restore_step": resumed.get("restore_step") if resumed else None,
        "resumed": resumed["resumed"] if resumed else None,
        "recovery_s": _span(fault["detected"], resumed and resumed["resumed"]),
        **spans,
    }


def start_marks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """What the new attempt's ranks say about their start: the last to join, the last to have its
    state back, where the state came from and its step."""
    starts = [r["start"] for r in ranks if r.get("start")]
    joined = [s["joined_at"] for s in starts if s.get("joined_at") is not None]
    restored = [s["restored_at"] for s in starts if s.get("restored_at") is not None]
    sources = sorted({s["source"] for s in starts if s.get("source")})
    steps = sorted({s["step"] for s in starts if s.get("step") is not None})
    return {
        "joined": max(joined) if joined else None,
        "restored": max(restored) if restored else None,
        "source": "+".join(sources) or None,
        "restore_step": steps[0] if len(steps) == 1 else steps or None,
    }
