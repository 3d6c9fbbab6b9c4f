"""Sample services and workflows: a media pipeline (ingest → audio → render → upload), and a one-step CLI."""

from __future__ import annotations

TOOL = ["python", "-m", "workflows.demo.tool"]


def definitions() -> dict:
    """Return the demo definitions in the import format of :func:`workflows.api.import_definitions`."""
    return {
        "services": [
            {
                "key": "ingest", "description": "Fetch the source media", "executor": "command",
                "executor_config": {"argv": [*TOOL, "ingest", "--source", "{source}"]},
                "params_schema": {"type": "object", "properties": {"source": {"type": "string"}},
                                  "required": ["source"]},
                "timeout_seconds": 60, "cpu_weight": 1,
            },
            {
                "key": "audio-norm", "description": "Normalise loudness", "executor": "command",
                "executor_config": {"argv": [*TOOL, "audio", "--lufs={lufs}"]},
                "params_schema": {"type": "object",
                                  "properties": {"lufs": {"type": "number", "minimum": -70, "maximum": 0}}},
                "timeout_seconds": 60, "cpu_weight": 2,
            },
            {
                "key": "renderer", "description": "Render the video", "executor": "command",
                "executor_config": {"argv": [*TOOL, "render", "--preset", "{preset}", "--fail-rate", "{fail_rate}"]},
                "params_schema": {"type": "object", "properties": {
                    "preset": {"type": "string", "enum": ["720p30", "1080p30", "4k"]},
                    "fail_rate": {"type": "number", "minimum": 0, "maximum": 1}}},
                "timeout_seconds": 120, "cpu_weight": 4, "max_attempts": 3, "backoff_base_seconds": 1,
                "backoff_cap_seconds": 5,
            },
            {
                "key": "yt-upload", "description": "Upload the result", "executor": "command",
                "executor_config": {"argv": [*TOOL, "upload"]},
                "params_schema": {"type": "object", "properties": {}},
                "timeout_seconds": 60, "cpu_weight": 1,
            },
            {
                "key": "echo", "description": "One-step CLI service: prints its message as JSON", "executor": "command",
                "executor_config": {"argv": [*TOOL, "echo", "--message", "{message}"]},
                "params_schema": {"type": "object", "properties": {"message": {"type": "string", "maxLength": 200}},
                                  "required": ["message"]},
                "timeout_seconds": 30, "cpu_weight": 1,
            },
            {
                "key": "host-check", "description": "Per-host check over an unstable network (simulated)",
                "executor": "simulate",
                "executor_config": {"seed": 7, "error_rate": 0.25, "timeout_rate": 0.0,
                                    "min_delay_ms": 20, "max_delay_ms": 120},
                "params_schema": {"type": "object"}, "timeout_seconds": 30, "exclusive_per_host": True,
                "backoff_base_seconds": 1, "backoff_cap_seconds": 3,
            },
        ],
        "workflows": [
            {
                "name": "publish", "version": 1, "description": "Seed 000's media pipeline",
                "steps": [
                    {"key": "ingest", "service": "ingest", "depends_on": [],
                     "default_params": {"source": "s3://demo/in.wav"}},
                    {"key": "audio", "service": "audio-norm", "depends_on": ["ingest"],
                     "default_params": {"lufs": -16}},
                    {"key": "render", "service": "renderer", "depends_on": ["audio"],
                     "default_params": {"preset": "1080p30", "fail_rate": 0}},
                    {"key": "upload", "service": "yt-upload", "depends_on": ["render"], "default_params": {}},
                ],
            },
            {
                "name": "fleet-check", "version": 1, "description": "Fan out a check over hosts",
                "steps": [{"key": "check", "service": "host-check", "depends_on": [], "default_params": {},
                           "fan_out": "hosts"}],
            },
        ],
    }
