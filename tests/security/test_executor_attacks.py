"""Attacks on an executor: a driver impostor, commands outside the schema, a planted work
directory and planted links, and what a rank process can see of the job's secrets."""

from __future__ import annotations

import json
import os
import ssl
import stat
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megascale.config.private_files import UnsafePathError
from megascale.config.schema import REDIS_PASSWORD_ENV, REDIS_PASSWORD_FILE_ENV
from megascale.resilience.common.api import ApiClient
from megascale.resilience.common.credentials import ensure_secret, load_secret, server_context
from megascale.resilience.common.protocol import StartCommand
from megascale.resilience.executor.cli import default_workdir
from megascale.resilience.executor.executor import Executor

pytestmark = pytest.mark.timeout(60)
PASSWORD = "redis-password-for-the-ranks-only"


def start_command(**fields) -> dict:
    return {
        "id": "start-0123456789ab",
        "kind": "start",
        "attempt": 0,
        "ranks": [0],
        "env": {"WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
        "config": "[train]\nsteps = 1\n",
        **fields,
    }


class Impostor(ThreadingHTTPServer):
    """Whoever answers at the driver's address: it grants everything and orders a `start`."""

    def __init__(self, tls: ssl.SSLContext | None) -> None:
        self.requests: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                server.requests.append((self.path, self.headers.get("Authorization")))
                body = (
                    b'{"role": "active", "commands": [%s], "ack": []}'
                    % json.dumps(start_command(env={"LD_PRELOAD": "/tmp/evil.so"})).encode()
                )
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def secret(tmp_path):
    return load_secret(ensure_secret(tmp_path / "job-secret"), need_key=False)


@pytest.mark.parametrize("impostor_tls", [True, False], ids=["own-certificate", "plain-http"])
def test_an_impostor_driver_gets_no_token_and_runs_nothing(tmp_path, secret, impostor_tls):
    own = load_secret(ensure_secret(tmp_path / "impostor-secret"), need_key=True)
    impostor = Impostor(server_context(own) if impostor_tls else None)
    try:
        url = f"https://127.0.0.1:{impostor.server_address[1]}"
        executor = Executor(ApiClient(url, secret.token, secret.cert_pem), "node0", "127.0.0.1", tmp_path / "work")
        with pytest.raises(RuntimeError, match="is not the job's driver"):
            executor.register(timeout_s=0.6)
        runner = threading.Thread(target=executor.run, daemon=True)
        runner.start()  # heartbeats, as after a restart of the real driver
        time.sleep(1.2)
        executor.exit_requested.set()
        runner.join(10)
    finally:
        impostor.shutdown()
    assert impostor.requests == []  # not one request, so not one token, reached it
    assert executor.attempt is None and executor.done == {} and not any((tmp_path / "work").iterdir())


def test_plain_http_driver_urls_are_refused(secret):
    with pytest.raises(ValueError, match="https"):
        ApiClient("http://127.0.0.1:1", secret.token, secret.cert_pem)


@pytest.mark.parametrize(
    ("command", "defect"),
    [
        (start_command(env={"LD_PRELOAD": "/tmp/evil.so"}), "env.LD_PRELOAD"),
        (start_command(plan_env={"NCCL_NET_PLUGIN": "/tmp/evil.so"}), "plan_env.NCCL_NET_PLUGIN"),
        (start_command(args=["--train.run_dir=/etc"]), "args: Extra inputs"),
        (start_command(cwd="/"), "cwd: Extra inputs"),
        ({"id": "shell-0123456789ab", "kind": "shell", "argv": ["sh"]}, "does not match any of the expected tags"),
        ({"id": "selfcheck-0123456789ab", "kind": "selfcheck", "plan": {"pairs": [], "python": "x"}}, "plan.python"),
    ],
)
def test_commands_outside_the_schema_are_refused_and_reported(tmp_path, secret, command, defect):
    executor = Executor(
        ApiClient("https://127.0.0.1:1", secret.token, secret.cert_pem), "node0", "127.0.0.1", tmp_path / "work"
    )
    executor._dispatch(command)
    result = executor.done[command["id"]]
    assert result["ok"] is False and "refused by the executor" in result["error"] and defect in result["error"]
    assert executor.attempt is None and not any((tmp_path / "work").iterdir())


def test_a_rank_sees_no_secret_in_its_argv_or_environment(tmp_path, secret, monkeypatch):
    monkeypatch.setenv(REDIS_PASSWORD_ENV, PASSWORD)  # as an executor given it by its scheduler
    executor = Executor(
        ApiClient("https://127.0.0.1:1", secret.token, secret.cert_pem), "node0", "127.0.0.1", tmp_path / "work"
    )
    executor._dispatch(start_command(redis_password=PASSWORD))
    deadline = time.monotonic() + 20
    while executor.attempt is None or not executor.attempt.ranks:
        assert time.monotonic() < deadline, executor.done
        time.sleep(0.01)
    pid = executor.attempt.ranks[0].proc.pid
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        environ = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e)
    finally:
        executor.stop_ranks()
    # a fixed command line (a warm standby); its config and environment come through its stdin
    assert argv == [sys.executable.encode(), b"-m", b"megascale.cli", b"train", b"--standby-server"]
    assert PASSWORD.encode() not in b" ".join(argv) + b" ".join(environ.values())
    assert REDIS_PASSWORD_ENV.encode() not in environ
    private = tmp_path / "work" / "attempt0" / "rank"
    config, password_file = private / "config.toml", private / "redis_password"
    assert config.read_text() == "[train]\nsteps = 1\n" and password_file.read_text() == PASSWORD
    given = Executor.rank_env(
        StartCommand.model_validate(start_command(redis_password=PASSWORD)),
        0,
        executor.attempt.status_dir,
        {REDIS_PASSWORD_FILE_ENV: str(password_file)},
    )
    assert PASSWORD not in json.dumps(given) and given[REDIS_PASSWORD_FILE_ENV] == str(password_file)
    for path in (config, password_file, executor.attempt.ranks[0].log_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(config.parent.stat().st_mode) == 0o700


def test_a_link_planted_in_the_work_directory_is_not_written_through(tmp_path, secret):
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    attempt = tmp_path / "work" / "attempt0"
    attempt.mkdir(parents=True)
    (attempt / "rank00000.log").symlink_to(victim)
    executor = Executor(
        ApiClient("https://127.0.0.1:1", secret.token, secret.cert_pem), "node0", "127.0.0.1", tmp_path / "work"
    )
    executor._dispatch(start_command())
    deadline = time.monotonic() + 10
    while "start-0123456789ab" not in executor.done:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    result = executor.done["start-0123456789ab"]
    assert result["ok"] is False and "symbolic link" in result["error"], result
    assert executor.attempt.ranks == [] and victim.read_text() == "root's file\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's directory needs root")
def test_a_work_directory_another_user_made_first_is_refused(tmp_path, secret):
    shared_tmp = tmp_path / "tmp"  # like /tmp: world-writable with the sticky bit
    shared_tmp.mkdir(mode=0o1777)
    shared_tmp.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    planted = shared_tmp / "megascale"  # the old default: /tmp/megascale/NODE
    for workdir in (planted, planted / "node0"):  # the directory itself, or one above it, is theirs
        (workdir / "attempt0").mkdir(parents=True, exist_ok=True)
        (workdir / "attempt0" / "rank00000.log").symlink_to(victim)
        for path in (workdir, workdir / "attempt0"):
            os.chown(path, 65534, 65534)
        with pytest.raises(UnsafePathError, match="belongs to uid 65534"):
            Executor(ApiClient("https://127.0.0.1:1", secret.token, secret.cert_pem), "node0", "127.0.0.1", workdir)
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)  # world-writable without the sticky bit: anyone can swap its entries
    with pytest.raises(UnsafePathError, match="writable by every user"):
        Executor(
            ApiClient("https://127.0.0.1:1", secret.token, secret.cert_pem), "node0", "127.0.0.1", open_to_all / "node0"
        )
    assert victim.read_text() == "root's file\n"


def test_the_default_work_directory_is_private_and_unpredictable(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    first, second = default_workdir("node0"), default_workdir("node0")
    assert first != second and first.parent == second.parent
    assert stat.S_IMODE(first.stat().st_mode) == 0o700 and first.stat().st_uid == os.geteuid()
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert default_workdir("node0") == runtime / "megascale" / "node0"
    for path in (first, second):
        path.rmdir()
