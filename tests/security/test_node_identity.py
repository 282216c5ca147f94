"""One node against the others and the job (issue #29, section 1), on a live driver over loopback.

Every executor holds the join token, so each attack is made with it and with the credential of
another registered node (`node-b`, a spare that heartbeats throughout), as a compromised node
would: a forged fault report, polling for another node's commands, re-registering another
node's id or its own from another address, forged node credentials, operator actions, a node
lying about its own progress, and a flood of new node ids. Each must be refused with the job
exactly as it was. The last tests end with evictions and a stop (log lines forged through reasons).
"""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from megascale.resilience.common.api import ApiClient, ApiError
from megascale.resilience.common.credentials import load_secret
from megascale.resilience.executor.executor import Executor
from tests.security import flood
from tests.security.live import NODE, LiveDriver, SimulatedNode, raw_request, request_bytes

pytestmark = pytest.mark.timeout(120)
OTHER = "node-b"


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    live = LiveDriver(tmp_path_factory.mktemp("identity") / "run")
    live.other = SimulatedNode(ApiClient.for_run(live.run_dir, operator=False), OTHER, "127.0.0.2")
    live.other.start()
    try:
        assert live.other.registered.wait(20)
        live.wait_for(lambda s: s["nodes"].get(OTHER, {}).get("role") == "spare" and s["nodes"][NODE]["ranks"])
        yield live
    finally:
        live.other.stop()
        live.close()


def refused(client: ApiClient, method: str, path: str, body=None) -> ApiError:
    with pytest.raises(ApiError) as err:
        client.call(method, path, body)
    return err.value


def killed_report(node_id: str) -> dict:
    """What made the victim's executor kill its healthy rank: its rank 'died of SIGKILL'."""
    rank = {"rank": 0, "local_rank": 0, "pid": 1, "alive": False, "exitcode": -9, "exited_at": time.time(), "step": 1}
    return {"node_id": node_id, "time": time.time(), "attempt": 0, "ranks": [rank], "net_shared": True}


def test_a_node_cannot_report_or_poll_for_another(driver):
    impostors = {"join token": driver.join_token, OTHER: driver.other.credential}
    for who, credential in impostors.items():
        for _ in range(2):  # two forged faults evicted the victim before
            err = refused(driver.client_as(credential), "POST", "/v1/heartbeat", killed_report(NODE))
            assert err.status == 403, (who, err)
        status, body = raw_request(
            driver.port, request_bytes("POST", "/v1/heartbeat", json.dumps(killed_report(NODE)).encode(), credential)
        )
        assert status == 403 and "commands" not in body, (who, body)  # a poll gets none of its commands
    assert "not for a join credential" in str(
        refused(driver.client_as(driver.join_token), "POST", "/v1/heartbeat", killed_report(NODE))
    )
    assert f"speaks for {OTHER}, not for {NODE}" in str(
        refused(driver.client_as(driver.other.credential), "POST", "/v1/heartbeat", killed_report(NODE))
    )
    driver.untouched()
    assert driver.status()["nodes"][NODE]["ranks"][0]["alive"] is True


def test_a_flood_of_wrong_tokens_does_not_hide_a_forged_report_in_the_log(driver):
    """The refusal log is rate-limited per kind of line (its status): a local user's wrong-token
    flood (hundreds of 401s a second from 127.0.0.3, in its own process) is cut down to ten
    lines a second, and the 403 of a node speaking for another, sent in the middle of it, is
    still logged. With one limit for every refusal it was logged only when it happened to be
    among the first ten refusals of its second."""
    wrong = request_bytes("GET", "/v1/status", token="w" * 43)
    proc = flood.start(driver.port, "127.0.0.3", wrong, 20, 4.0)
    time.sleep(2.0)
    forged = killed_report("forged-in-a-flood")
    assert refused(driver.client_as(driver.other.credential), "POST", "/v1/heartbeat", forged).status == 403
    seen = flood.result(proc)
    log = driver.log()
    # more refusals than the log's ten lines a second let through over the 4 s flood
    assert seen.get("401", 0) > 40 and "refusals in the last second, not logged one by one" in log, seen
    assert f"speaks for {OTHER}, not for forged-in-a-flood" in log, seen
    driver.untouched()


def test_a_node_id_cannot_be_registered_again_by_another_or_moved(driver):
    moved = {"node_id": NODE, "address": "10.66.0.1", "host": "simulated", "pid": os.getpid()}
    err = refused(driver.client_as(driver.join_token), "POST", "/v1/register", moved)
    assert err.status == 403 and "only it may register again" in str(err)
    err = refused(driver.client_as(driver.other.credential), "POST", "/v1/register", moved)
    assert err.status == 403 and f"speaks for {OTHER}" in str(err)
    err = refused(driver.as_node(), "POST", "/v1/register", moved)  # its own credential, another address
    assert err.status == 409 and "another address" in str(err)
    status = driver.status()
    assert status["nodes"][NODE]["address"] == "127.0.0.1" and status["master"]["addr"] == "127.0.0.1"
    # the node itself, restarted with the credential it kept, from its address: admitted
    reply = driver.as_node().call("POST", "/v1/register", {**moved, "address": "127.0.0.1"})
    assert reply["role"] == "active" and reply["credential"] == driver.node.credential
    driver.untouched()


def test_forged_node_credentials_are_refused(driver):
    own = driver.node.credential
    _, tag, _ = own.split(".")
    other_mac = driver.other.credential.rsplit(".", 1)[1]
    for forged in (
        f"node.{tag}.{other_mac}",
        own[:-1],
        own + "0",
        f"node.{tag}.",
        f"node.{tag}",
        "node..",
        "node." + "A" * 500 + "." + other_mac,
        own.replace("node.", "nodes.", 1),
    ):
        status, body = raw_request(
            driver.port, request_bytes("POST", "/v1/heartbeat", json.dumps(killed_report(NODE)).encode(), forged)
        )
        assert status == 401 and "token" in body["error"], (forged, status, body)
    driver.untouched()


def test_operator_actions_need_the_operator_credential(driver):
    for credential in (driver.join_token, driver.node.credential, driver.other.credential):
        client = driver.client_as(credential)
        for method, path, body in (
            ("POST", "/v1/stop", {"reason": "forged"}),
            ("GET", "/v1/status", None),
            ("POST", "/v1/evict", {"node_id": NODE, "reason": "forged"}),
        ):
            err = refused(client, method, path, body)
            assert err.status == 403 and f"{method} {path} is not for a" in str(err), (path, err)
    driver.untouched()
    assert driver.status()["phase"] == "running"


def test_a_node_cannot_report_impossible_progress_of_its_own(driver):
    """A node that holds its own credential (a compromised one) lying about itself."""
    driver.wait_for(lambda s: (s["step"] or 0) >= 4)
    node = driver.as_node()

    def beat(**rank) -> dict:  # a step ahead of what the node's own next beat will say
        body = driver.node.heartbeat()
        ahead = body["ranks"][0]["step"] + 2
        body["ranks"] = [{**body["ranks"][0], "step": ahead, "recent": [[ahead, 0.1]], **rank}]
        return body

    lies = {  # each made when it is sent: the node's step goes on meanwhile
        "beyond train.steps=1000000": lambda: beat(step=2**62),
        "jumped from step": lambda: beat(step=1_000_000, alive=False, exitcode=0, recent=[]),  # "all finished"
        "after step": lambda: beat(step=1, recent=[]),
        "is not a rank of node node-a": lambda: beat(rank=1),
        "reports a step time for a step after": lambda: beat(recent=[[10**5, 0.1]]),
        "attempt 3 has not started": lambda: {**beat(), "attempt": 3},
    }
    time.sleep(1.1)  # a new second of the refusal log's rate limit (10 lines a second)
    for expected, body in lies.items():
        err = refused(node, "POST", "/v1/heartbeat", body())
        assert err.status == 422 and expected in str(err), (expected, err)
    driver.untouched()
    status = driver.status()
    assert status["phase"] == "running" and status["step"] < 1000, status
    assert "422 POST /v1/heartbeat" in driver.log()


def test_an_executor_keeps_its_credential_across_a_restart(driver, tmp_path):
    secret_dir = json.loads((driver.run_dir / "resilience" / "driver.json").read_text())["secret_dir"]
    secret = load_secret(secret_dir, need_key=False)
    assert secret.operator == ""  # what an executor loads: no operator token

    def executor(workdir) -> Executor:
        return Executor(ApiClient(driver.client.url, secret.token, secret.cert_pem), "exec-node", "127.0.0.3", workdir)

    first = executor(tmp_path / "work")
    first.register(10)
    first.standbys.wanted = 0  # a spare of a training job would warm a rank process: not needed here
    kept = tmp_path / "work" / "credential"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600 and first.client.token == kept.read_text() != secret.token
    again = executor(tmp_path / "work")  # restarted: registers with the credential it kept
    again.register(10)
    again.standbys.wanted = 0
    assert again.client.token == first.client.token
    with pytest.raises(ApiError, match="only it may register again") as err:
        executor(tmp_path / "elsewhere").register(10)  # the same id with the join token only
    assert err.value.status == 403
    stale = tmp_path / "stale"  # a work directory kept from another job: its credential is refused (401)
    stale.mkdir(mode=0o700)
    (stale / "credential").write_text(f"node.ZXhlYy1ub2Rl.{'0' * 64}")
    (stale / "credential").chmod(0o600)
    with pytest.raises(ApiError, match="only it may register again"):  # so it fell back to the join token
        executor(stale).register(10)
    assert not (stale / "credential").exists()
    # exec-node never beats: evicted here, so later tests' silent nodes are not half the job's
    # (then the driver reads the silence as its own or the network's, and evicts nobody)
    driver.client.call("POST", "/v1/evict", {"node_id": "exec-node", "reason": "test done"})
    driver.wait_for(lambda s: "exec-node" in s["evicted"])


def test_reasons_cannot_forge_log_lines(driver):
    driver.other.stop()  # the spare is evicted at once: its executor would be told to exit
    forged = "2026-12-01 22:00:00,000 ERROR [driver] job complete: training complete"
    reply = driver.client.call("POST", "/v1/evict", {"node_id": OTHER, "reason": f"ECC\n{forged}\r\x1b[2K"})
    assert reply == {"ok": True}
    driver.wait_for(lambda s: OTHER in s["evicted"])
    log = driver.log()
    assert "ECC\\n2026-12-01 22:00:00,000 ERROR" in log and "\\r\\x1b[2K" in log
    assert not any(line.startswith(forged) for line in log.splitlines())
    assert "127.0.0.2" not in driver.status()["blocked"]  # a spare's claimed address is not blocked


def test_new_node_ids_are_bounded_and_cannot_block_a_spares_address(driver):
    join = driver.client_as(driver.join_token)
    squatter = {"node_id": "squatter", "address": "10.99.1.1", "host": "x", "pid": 1}
    assert join.call("POST", "/v1/register", squatter)["role"] == "spare"
    driver.wait_for(lambda s: "squatter" in s["evicted"], timeout_s=20)  # silent: evicted as a lost spare
    assert "10.99.1.1" not in driver.status()["blocked"]
    spare = {"node_id": "real-spare", "address": "10.99.1.1", "host": "y", "pid": 2}
    assert join.call("POST", "/v1/register", spare)["role"] == "spare"  # the real one is still admitted
    before = len(driver.status()["nodes"])
    admitted = 0
    for i in range(50):
        try:
            join.call("POST", "/v1/register", {"node_id": f"junk{i}", "address": f"10.98.0.{i}", "host": "z"})
            admitted += 1
        except ApiError as err:
            assert err.status == 403 and "the most this job admits" in str(err), err
            break
    status = driver.status()
    # 1 node + 0 spares + resilience.spare_pool (4) ids over the job's life, evicted ones included
    assert len(status["nodes"]) == 5 and admitted == 5 - before, (admitted, sorted(status["nodes"]))
    assert status["phase"] == "running" and status["nodes"][NODE]["role"] == "active"


def test_a_stop_reason_cannot_forge_log_lines(driver):
    forged = "2026-12-01 22:00:01,000 INFO [driver] job complete: training complete (ETTR 1.000)"
    driver.client.call("POST", "/v1/stop", {"reason": f"done\n{forged}"})
    driver.proc.wait(30)
    log = driver.log()
    assert "job cancelled: done\\n2026-12-01 22:00:01,000 INFO" in log
    assert not any(line.startswith(forged) for line in log.splitlines())
    summary = json.loads((driver.run_dir / "resilience" / "summary.json").read_text())
    assert summary["phase"] == "cancelled" and "\n" not in summary["reason"]
