"""The job's secret and written state: an unsafe secret stops the driver before it listens;
what megascale writes is readable by its user only."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

from megascale.config import dump_config, load_config
from megascale.resilience.credentials import CERT, KEY, TOKEN, SecretError, ensure_secret, load_secret
from tests.security.live import REPO

pytestmark = pytest.mark.timeout(60)


def broken(directory, part: str, content: bytes | None = None, mode: int = 0o600):
    path = directory / part
    if content is not None:
        path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.mark.parametrize(("part", "content", "mode", "message"), [
    (TOKEN, b"", 0o600, "has 0 characters; at least 32"),
    (TOKEN, b"\n  \n", 0o600, "has 0 characters"),
    (TOKEN, b"short-token\n", 0o600, "has 11 characters"),
    (TOKEN, None, 0o644, "mode 0644: other users can read"),
    (TOKEN, None, 0o620, "mode 0620"),
    (KEY, None, 0o604, "TLS key"),
    (CERT, b"not a certificate", 0o600, "not a PEM certificate"),
])
def test_an_unsafe_secret_stops_the_driver_before_it_listens(tmp_path, part, content, mode, message):
    secret_dir = ensure_secret(tmp_path / "secret")
    broken(secret_dir, part, content, mode)
    with pytest.raises(SecretError, match=message):
        load_secret(secret_dir, need_key=True)
    if part == TOKEN and content == b"":  # the attack that switched authentication off, end to end
        out = subprocess.run([sys.executable, "-m", "megascale.cli", "launch", "--external", "--nodes", "1",
                              f"--train.run_dir={tmp_path / 'run'}", f"--resilience.secret_dir={secret_dir}"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert not (tmp_path / "run" / "resilience" / "driver.json").exists()  # never served


def test_a_missing_token_file_is_an_error_not_an_open_door(tmp_path):
    secret_dir = ensure_secret(tmp_path / "secret")
    (secret_dir / TOKEN).unlink()
    with pytest.raises(SecretError, match="the join token"):
        load_secret(secret_dir, need_key=False)


def test_the_secret_command_makes_private_files_kubernetes_can_take(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megascale.cli", "secret", str(tmp_path / "s"),
                          "--name", "megascale-driver"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "kubectl create secret generic" in out.stdout, out.stderr
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700
    for part in (TOKEN, CERT, KEY):
        assert stat.S_IMODE((tmp_path / "s" / part).stat().st_mode) == 0o600
    secret = load_secret(tmp_path / "s", need_key=True)
    from cryptography import x509

    names = x509.load_pem_x509_certificate(secret.cert_pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "megascale-driver" in names and "localhost" in names


def test_the_written_config_is_private(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("old")
    path.chmod(0o644)
    dump_config(load_config(None, []), path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and "[model]" in path.read_text()
