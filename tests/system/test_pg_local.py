"""scripts/pg_local.sh from a checkout only its owner may enter (a clone in root's home)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the cluster changes OS user only when run as root")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cluster_starts_from_a_private_folder_on_the_port_acc_pg_port_names(tmp_path, monkeypatch):
    private = tmp_path / "home"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)
    checkout = private / "clone"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "pg_local.sh", checkout / "scripts" / "pg_local.sh")
    script = str(checkout / "scripts" / "pg_local.sh")
    port = _free_port()
    env = {**os.environ, "ACC_PG_PORT": str(port)}
    env.pop("ACC_PG_DIR", None)
    started = subprocess.run([script, "start"], env=env, capture_output=True, text=True, timeout=120)
    elsewhere = Path((checkout / ".local" / "pg" / "datadir").read_text().strip()) if started.returncode == 0 else None
    try:
        assert started.returncode == 0, started.stderr
        assert "cannot enter" in started.stderr and elsewhere and elsewhere.is_relative_to("/var/tmp")
        url = subprocess.run([script, "url"], env=env, capture_output=True, text=True, check=True).stdout.strip()
        assert url == f"postgres://postgres@127.0.0.1:{port}/accs"
        with psycopg.connect(url) as conn:
            assert conn.execute("SHOW port").fetchone()[0] == str(port)
        from accs_site.localdb import local_pg_url

        # As in the clone's own shell: not a parallel test worker's cluster folder, and no port named.
        monkeypatch.delenv("ACC_PG_DIR", raising=False)
        monkeypatch.delenv("ACC_PG_PORT", raising=False)
        assert local_pg_url(checkout) == url, "Django connects where the script says"
    finally:
        subprocess.run([script, "stop"], env=env, capture_output=True, timeout=60)
        if elsewhere is not None:
            shutil.rmtree(elsewhere, ignore_errors=True)


def _cluster(tmp_path: Path, name: str) -> tuple[list[str], dict[str, str], Path]:
    """The script, an environment naming a cluster folder of its own (no fixed port) and that folder."""
    base = tmp_path / name
    env = {**os.environ, "ACC_PG_DIR": str(base), "ACC_PG_PORT_CLAIMS": str(tmp_path / "claims")}
    env.pop("ACC_PG_PORT", None)
    return [str(ROOT / "scripts" / "pg_local.sh")], env, base


def _run(cluster: tuple[list[str], dict[str, str], Path], verb: str) -> subprocess.CompletedProcess:
    script, env, _ = cluster
    return subprocess.run([*script, verb], env=env, capture_output=True, text=True, timeout=120)


def _port(cluster: tuple[list[str], dict[str, str], Path]) -> int:
    return int((cluster[2] / "port").read_text())


def test_a_stopped_cluster_keeps_its_port_and_a_restart_on_a_taken_port_fails_naming_it(tmp_path):
    first, second = _cluster(tmp_path, "first"), _cluster(tmp_path, "second")
    try:
        assert _run(first, "start").returncode == 0
        port = _port(first)
        assert _run(first, "stop").returncode == 0
        # The port is free now, but claimed: another cluster's first start passes it by.
        assert _run(second, "start").returncode == 0
        assert _port(second) != port
        with socket.socket() as squatter:  # another server took the port while the cluster was down
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            refused = _run(first, "start")
            assert refused.returncode != 0
            assert f"port {port}" in refused.stderr and "taken by another server" in refused.stderr, refused.stderr
        assert _run(first, "start").returncode == 0, "the port is free again: the cluster starts on it"
        assert _port(first) == port
        url = _run(first, "url").stdout.strip()
        with psycopg.connect(url) as conn:
            assert conn.execute("SHOW port").fetchone()[0] == str(port)
    finally:
        for cluster in (first, second):
            _run(cluster, "stop")
            datadir = cluster[2] / "datadir"
            if datadir.exists():
                shutil.rmtree(datadir.read_text().strip(), ignore_errors=True)
