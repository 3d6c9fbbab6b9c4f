"""Whatever a task writes costs the agent bounded memory: a stderr line without a newline, a
progress-looking line, stdout past the results limit, a warm child's output (real processes writing
hundreds of megabytes; the reading process's peak memory is measured in a process of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from nodes.executors.processes import CUT_MARK, MAX_LINE_BYTES, bounded_lines, line_text
from tests.nodes.output_harness import MEGABYTES

ROOT = Path(__file__).resolve().parents[2]
# What the reader may grow by while a task writes MEGABYTES: a few read chunks and lines, far below what
# holding the output would cost (the line read whole grew the reader by more than twice MEGABYTES).
BOUND_KIB = 32 * 1024


def harness(case: str) -> dict[str, Any]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "accs_site.settings", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.nodes.output_harness", case], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", ["stderr", "warm"])
def test_a_huge_stderr_line_without_a_newline_is_cut_and_the_reader_stays_small(case):
    report = harness(case)
    assert report["grew_kib"] < BOUND_KIB, f"the reader grew by {report['grew_kib']} KiB for {MEGABYTES} MB"
    assert (report["status"], report["results"]) == ("succeeded", {"ok": 1}), report["error"]
    cut, after = report["logs"]
    assert cut.startswith("::progress:: 0.99") and cut.endswith(CUT_MARK.format(limit=MAX_LINE_BYTES))
    assert report["longest_log"] <= 8000
    # The lines after the long one arrive as written; the cut one is no progress report.
    assert after == "after the long line"
    assert report["progress"] == [0.5]


def test_stdout_past_the_results_limit_fails_the_attempt_and_the_reader_stays_small():
    report = harness("stdout")
    assert report["grew_kib"] < BOUND_KIB, f"the reader grew by {report['grew_kib']} KiB for {MEGABYTES} MB"
    assert report["status"] == "failed"
    assert report["error"].startswith("bad output: stdout is larger than 1000000 bytes")


def expected_lines(data: bytes, limit: int) -> list[tuple[bytes, bool]]:
    lines = data.split(b"\n")
    last = lines.pop()
    if last:
        lines.append(last)
    return [(line[:limit], len(line) > limit) for line in lines]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.binary(max_size=40) | st.sampled_from([b"\n", b"\n\n", b"abc\n", b"x" * 30]),
                       max_size=30),
       limit=st.integers(min_value=1, max_value=25))
def test_bounded_lines_keeps_each_lines_start_and_marks_the_cut_ones(pieces, limit):
    lines = list(bounded_lines(iter(pieces), limit=limit))
    assert lines == expected_lines(b"".join(pieces), limit)
    assert all(len(line) <= limit for line, _ in lines)


@given(raw=st.binary(max_size=MAX_LINE_BYTES), cut=st.booleans())
def test_a_line_as_text_fits_a_log_line_and_says_when_it_was_cut(raw, cut):
    text = line_text(raw, cut=cut)
    assert len(text) <= 8000
    if cut:
        assert text.endswith(CUT_MARK.format(limit=MAX_LINE_BYTES))
    else:
        assert text == raw.decode(errors="replace")[:8000]
