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


def test_the_executors_heartbeats_carry_each_step_until_one_is_answered(tmp_path):
    """The real executor's heartbeat loop against an API server whose heartbeat route checks the
    body with the driver's own schema; the rank's status file is the real writer's. Beat 1 gets
    the file's window, beat 2 only the new step and a 503 (the driver shedding load), beat 3
    that step again with the next, beat 4 only its own."""
    import subprocess
    import sys
    import threading

    from megascale.resilience.common import protocol
    from megascale.resilience.common.api import ApiClient
    from megascale.resilience.common.credentials import ensure_secret, load_secret, server_context
    from megascale.resilience.common.rankstatus import StatusWriter
    from megascale.resilience.driver.api_server import ApiServer, Route
    from megascale.resilience.driver.identity import JOIN, Identities
    from megascale.resilience.executor.executor import Attempt, Executor
    from megascale.resilience.executor.ranks import RankProcess

    secret = load_secret(ensure_secret(tmp_path / "secret", ["127.0.0.1"]), need_key=True)
    writer = StatusWriter(0, str(tmp_path / "status"))
    for step in range(1, 21):
        writer.write(step, 0.1, compute_s=0.08)
    beats: list[tuple[list[int], list[int]]] = []
    done = threading.Event()

    def heartbeat(body: dict, who) -> tuple[int, dict]:
        rank = body["ranks"][0]
        beats.append((_steps(rank["recent"]), _steps(rank["compute"])))
        writer.write(20 + len(beats), 0.1, compute_s=0.08)  # the rank trains on between beats
        if len(beats) == 4:
            done.set()
        return (503, {"error": "busy"}) if len(beats) == 2 else (200, {"commands": [], "ack": []})

    routes = {("POST", "/v1/heartbeat"): Route(heartbeat, protocol.Heartbeat, frozenset({JOIN}))}
    server = ApiServer("127.0.0.1", 0, Identities(secret, "j").authenticate, routes, server_context(secret)).start()
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    client = ApiClient(f"https://127.0.0.1:{server.port}", secret.token, secret.cert_pem)
    executor = Executor(client, "node0", "127.0.0.1", tmp_path / "work", heartbeat_s=0.05)
    executor.attempt = Attempt(0, tmp_path / "status", [RankProcess(0, 0, rank, tmp_path / "rank0.log")])
    loop = threading.Thread(target=executor.run, daemon=True)
    try:
        loop.start()
        assert done.wait(30), beats
    finally:
        rank.kill()  # before the loop's exit stops its ranks (with a grace period)
        rank.wait()
        executor.exit_requested.set()
        loop.join(10)
        server.close()
    window = list(range(5, 21))  # the status file keeps the last 16
    assert beats[:4] == [(window, window), ([21], [21]), ([21, 22], [21, 22]), ([23], [23])], beats
