"""The test suite's fork server (tests/forkserver.py) starts a script as a new interpreter would: the
same command line, environment, folder, streams, session and exit code, seen from inside and from
/proc; only the third-party imports are inherited, never the site's settings."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests import forkserver

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="ACCS_TEST_FORKSERVER=0 or no pidfd_open")

# What the script sees of itself, before it imports anything. Read from /proc too: what another process
# (an agent looking for a dead agent's processes) sees of it.
PROBE = r'''
import json, os, sys
def proc(name):
    with open(f"/proc/self/{name}", "rb") as fh:
        return [part.decode("utf-8", "surrogateescape") for part in fh.read().rstrip(b"\0").split(b"\0")]
stdin = sys.stdin.read()
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__, "file": __file__,
    "environ": dict(os.environ), "proc_cmdline": proc("cmdline"), "proc_environ": sorted(proc("environ")),
    "session_leader": os.getsid(0) == os.getpid(), "stdin": stdin,
    "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding],
    "stderr": [sys.stderr.line_buffering, sys.stderr.write_through, sys.stderr.isatty()],
    "site_loaded": sorted(name for name in ("accs_site", "accs_site.settings", "jobs", "nodes") if name in sys.modules),
    "settings_configured": "django.conf" in sys.modules and sys.modules["django.conf"].settings.configured,
}))
'''


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", **extra}


def _both(argv: list[str], **kwargs) -> tuple[dict, dict]:
    """Run ``argv`` forked and as a new interpreter; return what each printed."""
    forked = forkserver.run(argv, capture_output=True, text=True, timeout=60, **kwargs)
    fresh = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kwargs)
    assert forked.returncode == fresh.returncode == 0, (forked.stderr, fresh.stderr)
    return json.loads(forked.stdout), json.loads(fresh.stdout)


def test_a_forked_script_sees_and_shows_what_a_new_interpreter_does(probe, tmp_path):
    argv = [sys.executable, probe.name, "--settings", "x", "", "é ü"]
    for env in (_env(), _env(PYTHONUNBUFFERED="", ANSWER="42")):
        forked, fresh = _both(argv, cwd=tmp_path, env=env, input="from stdin\n")
        assert forked == fresh
        assert forked["proc_cmdline"] == [sys.executable, *argv[1:]] and forked["argv"] == argv[1:]
        assert forked["site_loaded"] == [] and forked["settings_configured"] is False
        assert forked["stdin"] == "from stdin\n"


def test_it_really_was_forked_and_only_scripts_are(probe, tmp_path):
    with forkserver.Popen([sys.executable, str(probe)], env=_env(), stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL) as forked:
        assert forked.wait(60) == 0
    assert forked._forked is not None
    with forkserver.Popen([sys.executable, "-c", "pass"], env=_env()) as code:
        assert code.wait(60) == 0
    assert code._forked is None, "-c needs a new interpreter"
    with forkserver.Popen([sys.executable, str(probe)], env=_env(BIG="x" * forkserver.ROOM), stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL) as big:
        assert big.wait(60) == 0
    assert big._forked is None, "an environment larger than the room /proc shows starts a new interpreter"


def test_a_new_session_and_a_terminal_are_as_asked(probe, tmp_path):
    reader, writer = pty.openpty()
    try:
        for fork in (forkserver.Popen, subprocess.Popen):
            with fork([sys.executable, str(probe)], cwd=tmp_path, env=_env(PYTHONUNBUFFERED=""),
                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=writer, start_new_session=True) as proc:
                seen = json.loads(proc.stdout.read())
            assert seen["session_leader"] is True
            assert seen["stderr"] == [True, False, True], "stderr on a terminal, buffered by line"
    finally:
        os.close(reader)
        os.close(writer)


@pytest.mark.parametrize("body, code", [
    ("import sys; sys.exit(3)", 3),
    ("raise ValueError('boom')", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
    ("pass", 0),
])
def test_exit_codes_are_the_scripts(tmp_path, body, code):
    script = tmp_path / "end.py"
    script.write_text(body)
    done = forkserver.run([sys.executable, str(script)], env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    if code == 1:
        assert "ValueError: boom" in done.stderr


def test_wait_times_out_and_signals_reach_the_process(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    proc = forkserver.Popen([sys.executable, str(script)], env=_env(), stdout=subprocess.PIPE, text=True)
    assert proc._forked is not None
    assert proc.stdout.readline() == "up\n"
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None
    proc.terminate()
    assert proc.wait(30) == -signal.SIGTERM
    proc.stdout.close()


ARG = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(st.one_of(ARG, st.sampled_from(["--", "-c", "--settings=x", "..", "-", "../probe.py"])),
                     max_size=6),
       env=st.dictionaries(st.from_regex(r"[A-Z][A-Z0-9_]{0,15}", fullmatch=True).filter(
           lambda k: not k.startswith(forkserver.AT_START) and k not in forkserver.LOCALE + ("PATH",)), ARG,
           max_size=5))
def test_any_arguments_and_environment_arrive_as_a_new_interpreter_gets_them(probe, tmp_path, args, env):
    forked, fresh = _both([sys.executable, str(probe), *args], cwd=tmp_path, env={**_env(), **env})
    assert forked == fresh
