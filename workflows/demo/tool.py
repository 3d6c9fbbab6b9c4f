"""A small CLI that follows the ACCS command contract, for the demo services.

stdout: one JSON object (the task's results). stderr: log lines; ``::progress:: 0.5`` lines report
progress. Exit code 0 = success. ``ACCS_OUTPUT_DIR``, when set, receives output files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def progress(value: float) -> None:
    print(f"::progress:: {value:.2f}", file=sys.stderr, flush=True)


def work(steps: int, pause: float) -> None:
    for i in range(1, steps + 1):
        time.sleep(pause)
        progress(i / steps)


def write_output(name: str, content: str) -> str | None:
    out_dir = os.environ.get("ACCS_OUTPUT_DIR")
    if not out_dir:
        return None
    path = os.path.join(out_dir, name)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(content)
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="demo-tool")
    parser.add_argument("step", choices=["ingest", "audio", "render", "upload", "echo"])
    parser.add_argument("--source", default="")
    parser.add_argument("--lufs", type=float, default=-16)
    parser.add_argument("--preset", default="1080p30")
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--message", default="")
    args = parser.parse_args(argv)
    job = os.environ.get("ACCS_JOB_ID", "?")
    log(f"{args.step}: starting for job {job}")
    if args.step == "ingest":
        work(3, 0.05)
        result = {"media": f"{args.source or 'input'}#ingested", "bytes": 1_048_576}
    elif args.step == "audio":
        work(2, 0.05)
        result = {"lufs": args.lufs, "peak_db": -1.0}
    elif args.step == "render":
        work(4, 0.05)
        attempt = int(os.environ.get("ACCS_ATTEMPT", "1"))
        if random.random() < args.fail_rate and attempt < 2:
            log("render: encoder crashed (simulated)")
            return 3
        result = {"preset": args.preset, "frames": 1800,
                  "file": write_output("render.txt", f"rendered {args.preset}\n")}
    elif args.step == "upload":
        work(2, 0.03)
        result = {"url": f"https://video.invalid/{job[:8]}"}
    else:
        result = {"message": args.message}
    log(f"{args.step}: finished")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
