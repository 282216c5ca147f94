"""Heartbeats carry each step's times until one is answered, then only newer ones
(`rankstatus.DeliveredSteps`, used by the executor and the simulated nodes alike)."""

from megascale.resilience.common.rankstatus import RECENT, DeliveredSteps


def _window(last: int) -> list[list[float]]:
    """A status file's last RECENT (step, seconds) pairs."""
    return [[s, 0.1] for s in range(max(1, last - RECENT + 1), last + 1)]


def _steps(pairs: list[list[float]]) -> list[int]:
    return [s for s, _ in pairs]


def test_an_answered_heartbeat_is_not_repeated_and_an_unanswered_one_is():
    d = DeliveredSteps()
    d.begin(0)
    assert _steps(d.new(3, "recent", _window(20))) == list(range(5, 21))  # the file's whole window
    d.answered()
    d.begin(0)
    assert _steps(d.new(3, "recent", _window(21))) == [21]  # only the new step
    d.begin(0)  # that heartbeat went unanswered (no answered()): 21 goes again, with 22
    assert _steps(d.new(3, "recent", _window(22))) == [21, 22]
    d.answered()
    d.begin(0)
    assert d.new(3, "recent", _window(22)) == [] and _steps(d.new(4, "recent", _window(22)))[0] == 7  # per rank


def test_each_list_keeps_its_own_place_and_a_new_attempt_starts_afresh():
    d = DeliveredSteps()
    d.begin(0)
    d.new(0, "recent", _window(10))
    d.new(0, "compute", _window(9))  # had a list lagged the other, its next pair still goes
    d.answered()
    d.begin(0)
    assert _steps(d.new(0, "recent", _window(11))) == [11]
    assert _steps(d.new(0, "compute", _window(11))) == [10, 11]
    d.begin(1)  # restored to step 4: the new attempt's steps repeat the old one's
    assert _steps(d.new(0, "recent", _window(6))) == [1, 2, 3, 4, 5, 6]
