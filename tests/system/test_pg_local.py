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


def test_cluster_starts_from_a_private_folder_on_the_port_acc_pg_port_names(tmp_path):
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

        assert local_pg_url(checkout) == url, "Django connects where the script says"
    finally:
        subprocess.run([script, "stop"], env=env, capture_output=True, timeout=60)
        if elsewhere is not None:
            shutil.rmtree(elsewhere, ignore_errors=True)
