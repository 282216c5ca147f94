"""The job's secret and written state: an unsafe secret (short, readable, a FIFO, a key of another
pair, in a directory others can write) stops the driver before it listens, with one line naming
it; a run directory that is a link is refused; what megascale writes is readable by its user only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from megascale import cli
from megascale.config import dump_config, load_config
from megascale.resilience.common.credentials import CERT, KEY, OPERATOR, TOKEN, SecretError, ensure_secret, load_secret
from tests.security.live import REPO

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]  # each starts a real driver


def broken(directory, part: str, content: bytes | None = None, mode: int = 0o600):
    path = directory / part
    if content is not None:
        path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.mark.parametrize(
    ("part", "content", "mode", "message"),
    [
        (TOKEN, b"", 0o600, "has 0 characters; at least 32"),
        (TOKEN, b"\n  \n", 0o600, "has 0 characters"),
        (TOKEN, b"short-token\n", 0o600, "has 11 characters"),
        (TOKEN, None, 0o644, "mode 0644: other users can read"),
        (TOKEN, None, 0o620, "mode 0620"),
        (KEY, None, 0o604, "TLS key"),
        (CERT, b"not a certificate", 0o600, "not a PEM certificate"),
    ],
)
def test_an_unsafe_secret_stops_the_driver_before_it_listens(tmp_path, part, content, mode, message):
    secret_dir = ensure_secret(tmp_path / "secret")
    broken(secret_dir, part, content, mode)
    with pytest.raises(SecretError, match=message):
        load_secret(secret_dir, need_key=True)
    if part == TOKEN and content == b"":  # the attack that switched authentication off, end to end
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "megascale.cli",
                "launch",
                "--external",
                "--nodes",
                "1",
                f"--train.run_dir={tmp_path / 'run'}",
                f"--resilience.secret_dir={secret_dir}",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert not (tmp_path / "run" / "resilience" / "driver.json").exists()  # never served


def test_a_missing_token_file_is_an_error_not_an_open_door(tmp_path):
    secret_dir = ensure_secret(tmp_path / "secret")
    (secret_dir / TOKEN).unlink()
    with pytest.raises(SecretError, match="the join token"):
        load_secret(secret_dir, need_key=False)


def test_the_secret_command_makes_private_files_kubernetes_can_take(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "megascale.cli", "secret", str(tmp_path / "s"), "--name", "megascale-driver"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "kubectl create secret generic" in out.stdout, out.stderr
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700
    for part in (TOKEN, OPERATOR, CERT, KEY):
        assert stat.S_IMODE((tmp_path / "s" / part).stat().st_mode) == 0o600
    secret = load_secret(tmp_path / "s", need_key=True)
    from cryptography import x509

    names = (
        x509.load_pem_x509_certificate(secret.cert_pem)
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value.get_values_for_type(x509.DNSName)
    )
    assert "megascale-driver" in names and "localhost" in names


def test_the_written_config_is_private(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("old")
    path.chmod(0o644)
    dump_config(load_config(None, []), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and "[model]" in path.read_text()


def _launch(tmp_path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megascale.cli", "launch", "--external", "--nodes", "1", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.parametrize("part", [TOKEN, CERT])
def test_a_fifo_in_place_of_a_secret_file_is_refused_at_once(tmp_path, part):
    secret_dir = ensure_secret(tmp_path / "secret")
    (secret_dir / part).unlink()
    os.mkfifo(secret_dir / part, 0o600)  # opened for reading, it would wait for a writer forever
    with pytest.raises(SecretError, match="not a regular file"):
        load_secret(secret_dir, need_key=False)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megascale.cli",
            "executor",
            "--driver",
            "https://127.0.0.1:1",
            "--secret-dir",
            str(secret_dir),
            "--workdir",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "is not a regular file" in out.stderr, out.stderr


def test_a_key_that_does_not_match_the_certificate_is_a_clear_error(tmp_path):
    secret_dir = ensure_secret(tmp_path / "secret")
    other = ensure_secret(tmp_path / "other")
    (secret_dir / KEY).write_bytes((other / KEY).read_bytes())
    with pytest.raises(SecretError, match="does not match"):
        load_secret(secret_dir, need_key=True)
    out = _launch(tmp_path, f"--train.run_dir={tmp_path / 'run'}", f"--resilience.secret_dir={secret_dir}")
    assert out.returncode == 2 and "does not match" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "run" / "resilience" / "driver.json").exists()


@pytest.mark.parametrize(
    ("mode", "refused"),
    [(0o777, True), (0o770, True), (0o1777, False), (0o700, False)],
    ids=["0777", "0770", "1777", "0700"],
)
def test_a_secret_directory_others_can_write_is_refused(tmp_path, mode, refused):
    secret_dir = ensure_secret(tmp_path / "secret")
    secret_dir.chmod(mode)  # 1777: how Kubernetes mounts a Secret volume (others cannot swap our files)
    if refused:
        with pytest.raises(SecretError, match=f"mode {mode:04o}: other users can replace its files"):
            load_secret(secret_dir, need_key=False)
        out = _launch(tmp_path, f"--train.run_dir={tmp_path / 'run'}", f"--resilience.secret_dir={secret_dir}")
        assert out.returncode == 2 and f"mode {mode:04o}" in out.stderr, out.stderr
    else:
        assert load_secret(secret_dir, need_key=True).operator


def test_the_operator_token_is_apart_from_the_join_token(tmp_path):
    secret_dir = ensure_secret(tmp_path / "secret")
    driver, executor = load_secret(secret_dir, need_key=True), load_secret(secret_dir, need_key=False)
    assert driver.operator and driver.operator != driver.token and executor.operator == ""
    assert driver.node_key and executor.node_key == b""
    (secret_dir / OPERATOR).write_text(driver.token)
    with pytest.raises(SecretError, match="executors would hold the operator's power"):
        load_secret(secret_dir, need_key=True)
    (secret_dir / OPERATOR).unlink()  # a secret made before the operator token existed
    with pytest.raises(SecretError, match="the operator token"):
        load_secret(secret_dir, need_key=True)
    ensure_secret(secret_dir)  # `megascale secret DIR` adds it, keeping the rest
    assert load_secret(secret_dir, need_key=True).token == driver.token


def test_a_run_dir_that_is_a_link_into_another_tree_is_refused(tmp_path):
    elsewhere = tmp_path / "someone" / "project"  # a directory the link points into
    elsewhere.mkdir(parents=True)
    elsewhere.chmod(0o755)
    (elsewhere / "notes.txt").write_text("theirs\n")
    link = tmp_path / "runs" / "x"
    link.parent.mkdir()
    link.symlink_to(elsewhere)
    out = _launch(tmp_path, f"--train.run_dir={link}")
    assert out.returncode == 2 and "is a symbolic link" in out.stderr, out.stderr
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755 and os.listdir(elsewhere) == ["notes.txt"]


def test_the_executors_part_holds_the_token_and_certificate_only(tmp_path):
    """`megascale secret DIR --executors OUT` (the Slurm script's split): OUT gets what an
    executor needs and nothing that would let it act as the operator or make node credentials;
    an OUT that already holds the key or the operator token is refused, not cleaned."""
    assert cli.main(["secret", str(tmp_path / "s"), "--executors", str(tmp_path / "x")]) == 0
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == [CERT, TOKEN]
    assert load_secret(tmp_path / "x", need_key=False).token == load_secret(tmp_path / "s", need_key=True).token
    (tmp_path / "x" / "tls.key").write_text("stale")
    assert cli.main(["secret", str(tmp_path / "s"), "--executors", str(tmp_path / "x")]) == 2
