"""A picture of a workflow's DAG, with its tasks' states when a job has them: server-rendered SVG, no JavaScript.

The workflow page draws the definition alone; the job page (:func:`ops.dag.job_dag_svg`) adds its
tasks' states.

Steps are laid out in columns by depth (longest path from a root), edges run left to right. A
step that fans out over hosts is one box with a count per status and a stacked bar; a single task
shows its status and attempt. Colours follow :data:`STATUS_COLOURS` (the legend under the picture).
A step's failure policy shows as a tag in its box's corner (:data:`POLICY_TAGS`, also in the
legend): ``continue`` (its failure does not fail the job) and ``always`` (it runs whatever its
dependencies' outcome).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from html import escape
from typing import Any

# fill, stroke, text for each task status; "pending" = the job has no tasks yet.
STATUS_COLOURS: dict[str, tuple[str, str]] = {
    "pending": ("#ffffff", "#94a3b8"),
    "waiting": ("#e2e8f0", "#64748b"),
    "queued": ("#bfdbfe", "#2563eb"),
    "starting": ("#fef3c7", "#d97706"),
    "running": ("#fde68a", "#b45309"),
    "done": ("#bbf7d0", "#15803d"),
    "error": ("#fecaca", "#b91c1c"),
    "skipped": ("#f1f5f9", "#94a3b8"),
    "canceled": ("#cbd5e1", "#475569"),
    "blocked": ("#e9d5ff", "#7e22ce"),
}
# Which status names a fanned-out step as a whole: the one an operator must look at first.
STATUS_PRIORITY = ("error", "running", "starting", "queued", "blocked", "waiting", "canceled", "skipped", "done",
                   "pending")

# The tag of each failure policy that differs from the default, and what the legend says of it.
POLICY_TAGS: dict[str, tuple[str, str]] = {
    "continue": ("↷ continue", "on failure: skip its dependents, the rest goes on"),
    "always": ("⟳ always", "runs whatever its dependencies' outcome"),
}
POLICY_COLOUR = "#0e7490"

BOX_W, BOX_H, COL_GAP, ROW_GAP, PAD = 200, 70, 64, 22, 16


@dataclass
class StepState:
    """One step of the picture: its dependencies and the states of its task(s)."""

    key: str
    service: str = ""
    depends_on: list[str] = field(default_factory=list)
    fan_out: bool = False
    #: What the step fans out over: "hosts", or "items" (a list a parent returned).
    fan_out_over: str = "hosts"
    counts: Counter = field(default_factory=Counter)
    attempt: int = 0
    max_attempts: int = 0
    tasks: int = 0
    on_failure: str = "fail_job"
    always: bool = False

    @property
    def status(self) -> str:
        for status in STATUS_PRIORITY:
            if self.counts.get(status):
                return status
        return "pending"

    @property
    def policy_tags(self) -> list[str]:
        """Return the keys of :data:`POLICY_TAGS` that apply to this step."""
        return [tag for tag, on in (("continue", self.on_failure == "continue"), ("always", self.always)) if on]


def steps_from(definition: Iterable[dict[str, Any]], task_rows: Iterable[dict[str, Any]]) -> list[StepState]:
    """Merge workflow steps with task aggregates (``step_key, status, n, attempt, max_attempts``).

    Steps come from the workflow definition when there is one (so a job that has no tasks yet still
    shows its shape), else from the tasks themselves.
    """
    steps: dict[str, StepState] = {}
    for step in definition or []:
        if isinstance(step, dict) and isinstance(step.get("key"), str):
            steps[step["key"]] = StepState(key=step["key"], service=str(step.get("service", "")),
                                           depends_on=[d for d in step.get("depends_on") or [] if isinstance(d, str)],
                                           fan_out=step.get("fan_out") is not None,
                                           fan_out_over="items" if isinstance(step.get("fan_out"), dict) else "hosts",
                                           on_failure=str(step.get("on_failure") or "fail_job"),
                                           always=step.get("always") is True)
    for row in task_rows:
        state = steps.setdefault(row["step_key"], StepState(key=row["step_key"], service=row.get("service", "")))
        if not state.depends_on and row.get("depends_on"):
            state.depends_on = list(row["depends_on"])
        if not state.service:
            state.service = row.get("service", "")
        state.counts[row["status"]] += row["n"]
        state.tasks += row["n"]
        state.attempt = max(state.attempt, row.get("attempt") or 0)
        state.max_attempts = max(state.max_attempts, row.get("max_attempts") or 0)
        if row.get("hosted"):
            state.fan_out = True
    return list(steps.values())


def _layout(steps: list[StepState]) -> dict[str, tuple[int, int]]:
    """Return (column, row) per step: column = longest path from a root, rows in definition order."""
    by_key = {s.key: s for s in steps}
    depth: dict[str, int] = {}

    def visit(key: str, trail: frozenset[str]) -> int:
        if key in depth:
            return depth[key]
        deps = [d for d in by_key[key].depends_on if d in by_key and d not in trail]
        depth[key] = 0 if not deps else 1 + max(visit(d, trail | {key}) for d in deps)
        return depth[key]

    for step in steps:
        visit(step.key, frozenset())
    rows: Counter = Counter()
    out = {}
    for step in steps:
        col = depth[step.key]
        out[step.key] = (col, rows[col])
        rows[col] += 1
    return out


def _truncate(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _status_line(step: StepState) -> str:
    if not step.tasks:
        return "not started"
    if step.tasks == 1 and not step.fan_out:
        line = step.status
        if step.attempt:
            line += f" · attempt {step.attempt}/{step.max_attempts}"
        return line
    parts = [f"{n} {status}" for status in STATUS_PRIORITY if (n := step.counts.get(status))]
    return " · ".join(parts)


def render_svg(steps: list[StepState], *, title: str = "", link_prefix: str = "#step-") -> str:
    """Return an inline SVG document of the DAG (safe to embed: every text is escaped)."""
    if not steps:
        return ('<svg xmlns="http://www.w3.org/2000/svg" width="240" height="40" role="img">'
                '<text x="8" y="24">no steps</text></svg>')
    pos = _layout(steps)
    cols = max(c for c, _ in pos.values()) + 1
    rows = max(r for _, r in pos.values()) + 1
    legend_h = 30
    width = PAD * 2 + cols * BOX_W + (cols - 1) * COL_GAP
    height = PAD * 2 + rows * BOX_H + (rows - 1) * ROW_GAP + legend_h
    width = max(width, 760)  # room for the legend

    def xy(key: str) -> tuple[int, int]:
        c, r = pos[key]
        return PAD + c * (BOX_W + COL_GAP), PAD + r * (BOX_H + ROW_GAP)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="accs-dag" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title or "job DAG")}" '
        'font-family="-apple-system, Segoe UI, Helvetica, Arial, sans-serif">',
        f"<title>{escape(title or 'job DAG')}</title>",
        '<defs><marker id="accs-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#64748b"/></marker></defs>',
    ]
    by_key = {s.key: s for s in steps}
    for step in steps:
        x2, y2 = xy(step.key)
        for dep in step.depends_on:
            if dep not in by_key:
                continue
            x1, y1 = xy(dep)
            sx, sy, ex, ey = x1 + BOX_W, y1 + BOX_H / 2, x2 - 2, y2 + BOX_H / 2
            mid = (sx + ex) / 2
            colour = "#15803d" if by_key[dep].status == "done" else "#94a3b8"
            out.append(f'<path class="edge" d="M {sx} {sy} C {mid} {sy}, {mid} {ey}, {ex} {ey}" fill="none" '
                       f'stroke="{colour}" stroke-width="1.6" marker-end="url(#accs-arrow)"/>')
    for step in steps:
        x, y = xy(step.key)
        status = step.status
        fill, stroke = STATUS_COLOURS.get(status, STATUS_COLOURS["pending"])
        dashed = ' stroke-dasharray="5 3"' if status in ("pending", "skipped") else ""
        tags = step.policy_tags
        tip = f"{step.key} ({step.service}): {_status_line(step)}" + "".join(
            f"; {POLICY_TAGS[t][0]}: {POLICY_TAGS[t][1]}" for t in tags)
        policy_classes = "".join(f" policy-{t}" for t in tags)
        out.append(f'<a href="{escape(link_prefix + step.key)}">'
                   f'<g class="step status-{escape(status)}{policy_classes}" '
                   f'data-step="{escape(step.key)}" data-status="{escape(status)}" '
                   f'data-on-failure="{escape(step.on_failure)}" data-always="{str(step.always).lower()}">')
        out.append(f"<title>{escape(tip)}</title>")
        out.append(f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="8" fill="{fill}" stroke="{stroke}" '
                   f'stroke-width="{2.5 if status == "error" else 1.5}"{dashed}/>')
        out.append(f'<text x="{x + 10}" y="{y + 20}" font-size="13" font-weight="600" fill="#0f172a">'
                   f"{escape(_truncate(step.key, 24 - 6 * len(tags)))}</text>")
        for i, tag in enumerate(tags):
            out.append(f'<text class="policy-tag" x="{x + BOX_W - 8}" y="{y + 16 + 12 * i}" font-size="10" '
                       f'text-anchor="end" fill="{POLICY_COLOUR}" font-weight="600">'
                       f"{escape(POLICY_TAGS[tag][0])}</text>")
        sub = step.service + (f" × {step.tasks} {step.fan_out_over}" if step.fan_out and step.tasks else "")
        out.append(f'<text x="{x + 10}" y="{y + 37}" font-size="11" fill="#475569">{escape(_truncate(sub, 30))}</text>')
        out.append(f'<text x="{x + 10}" y="{y + 54}" font-size="11" fill="{stroke}" font-weight="600">'
                   f"{escape(_truncate(_status_line(step), 32))}</text>")
        if step.fan_out and step.tasks:
            # Stacked bar: one segment per status, proportional to its task count.
            bx, bw, offset = x + 10, BOX_W - 20, 0.0
            for st in STATUS_PRIORITY:
                n = step.counts.get(st, 0)
                if not n:
                    continue
                w = bw * n / step.tasks
                seg_fill = STATUS_COLOURS[st][1]
                out.append(f'<rect x="{bx + offset:.1f}" y="{y + 60}" width="{w:.1f}" height="5" fill="{seg_fill}">'
                           f"<title>{n} {escape(st)}</title></rect>")
                offset += w
        out.append("</g></a>")
    # Legend
    lx, ly = PAD, height - legend_h + 8
    for status in ("waiting", "queued", "running", "done", "error", "skipped", "canceled", "blocked"):
        fill, stroke = STATUS_COLOURS[status]
        out.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" rx="2" fill="{fill}" stroke="{stroke}"/>'
                   f'<text x="{lx + 16}" y="{ly + 10}" font-size="11" fill="#334155">{status}</text>')
        lx += 26 + 7 * len(status)
    for label, meaning in POLICY_TAGS.values():
        out.append(f'<text class="policy-legend" x="{lx}" y="{ly + 10}" font-size="11" fill="{POLICY_COLOUR}" '
                   f'font-weight="600"><title>{escape(meaning)}</title>{escape(label)}</text>')
        lx += 16 + 7 * len(label)
    out.append("</svg>")
    return "".join(out)
