"""The floors of the house (../shared/HOUSE.md, docs/architecture.md), checked on every run.

Every module of the apps is parsed with ``ast`` (imports inside function bodies too, none are run), and
three rules are checked:

1. No module imports an app on a floor above its own. The floors, bottom to top: ``accs_site`` and
   ``tenants``; ``events``; ``workflows``; ``jobs``; ``nodes``; ``ops``. ``accs_site/urls.py`` and
   ``accs_site/api_v1.py`` wire every app's URLs and API together and are exempt; ``jobs`` may import
   ``nodes`` models where the claim needs hosts (HOUSE.md's one exception).
2. No import circle between modules: a strongly connected component of the graph of imports that run
   (module level and inside function bodies; ``if TYPE_CHECKING:`` blocks never run and are left out),
   since HOUSE.md says no two modules import each other and an import moved into a function only hides
   the circle.
3. Every import inside a function body carries a comment saying why, on its line or the line above (one
   comment above a run of imports covers the run).

The allowlists at the bottom hold the violations the restructuring of issue 19 is removing; each
entry names the piece that removes it. A new violation fails; so does an entry that no longer matches
anything, so the lists only shrink.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Each app's floor, bottom (0) to top. ``tenants`` shares the bottom floor with ``accs_site``.
FLOORS: dict[str, int] = {
    "accs_site": 0, "tenants": 0, "events": 1, "workflows": 2, "jobs": 3, "nodes": 4, "ops": 5,
}

#: The URL wiring: it mounts every app's views and API, so it may import any floor.
URL_WIRING = frozenset({"accs_site.urls", "accs_site.api_v1"})

#: HOUSE.md's exception to the floors: ``jobs`` imports ``nodes`` models where the claim needs hosts.
HOUSE_EXCEPTIONS: dict[str, frozenset[str]] = {"jobs.claim": frozenset({"nodes.models"})}

#: Tool pragmas at the start of a comment, which do not count as a reason.
PRAGMA = re.compile(r"^(noqa(:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*)?|type:\s*ignore(\[[^\]]*\])?)")


@dataclass(frozen=True)
class Import:
    """One import statement's target, as seen from the module that holds it."""

    importer: str
    target: str
    line: int
    in_function: bool
    type_checking_only: bool
    commented: bool


# --- reading the modules -------------------------------------------------------------------------------


def app_sources(root: Path = ROOT) -> dict[str, str]:
    """Return ``{dotted module name: source}`` for every Python file of the apps under ``root``."""
    sources: dict[str, str] = {}
    for app in FLOORS:
        for path in sorted((root / app).rglob("*.py")) if (root / app).is_dir() else []:
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            sources[".".join(parts)] = path.read_text(encoding="utf-8")
    return sources


def _resolve(base: str, names: list[str], known: frozenset[str]) -> list[str]:
    """Return the known modules ``from base import names`` (or ``import base``) reaches."""
    targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
    if len(targets) < len(names) or not names:
        # A name that is not a submodule comes from the package (or module) itself, or its nearest known parent.
        parts = base.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts:
            targets.append(".".join(parts))
    return targets


def _has_reason(lines: list[str], lineno: int) -> bool:
    """Whether the import at ``lineno`` (1-based) has a comment in words on its line or the line above.

    The line above may be another import: one comment over a run of imports covers them all.
    """
    def words(text: str) -> bool:
        if "#" not in text:
            return False
        # A bare pragma (noqa, type: ignore) silences a tool; it does not say why.
        comment = PRAGMA.sub("", text.split("#", 1)[1].strip()).strip(" -:;,")
        return bool(comment)
    here = lines[lineno - 1] if 0 < lineno <= len(lines) else ""
    if words(here):
        return True
    above = lineno - 2
    while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#") and words(lines[above])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_imports(name: str, source: str, known: frozenset[str], packages: frozenset[str]) -> Iterator[Import]:
    """Yield the imports of module ``name`` that reach another module of the apps."""
    tree = ast.parse(source, filename=name)
    lines = source.splitlines()
    package = name if name in packages else name.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    for target in _resolve(alias.name, [], known):
                        yield Import(name, target, child.lineno, in_function, type_checking,
                                     _has_reason(lines, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")
                    base_parts = parts[: len(parts) - (child.level - 1)]
                    base = ".".join(base_parts + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                for target in _resolve(base, [a.name for a in child.names], known):
                    if target != name:
                        yield Import(name, target, child.lineno, in_function, type_checking,
                                     _has_reason(lines, child.lineno))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), in_function, type_checking)
            else:
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from visit(child, inner, type_checking)

    yield from visit(tree, False, False)


def all_imports(sources: Mapping[str, str]) -> list[Import]:
    """Return every import between modules of the apps in ``sources``."""
    known = frozenset(sources)
    packages = frozenset(n for n in sources if any(other.startswith(n + ".") for other in sources))
    return [imp for name in sorted(sources) for imp in module_imports(name, sources[name], known, packages)]


# --- the rules ---------------------------------------------------------------------------------------------


def floor_of(module: str) -> int:
    """Return the floor of ``module``'s app."""
    return FLOORS[module.split(".")[0]]


def up_imports(imports: list[Import]) -> set[tuple[str, str]]:
    """Return ``(importer, target)`` for each import that reaches a floor above the importer's."""
    found = set()
    for imp in imports:
        if imp.importer in URL_WIRING or imp.target in HOUSE_EXCEPTIONS.get(imp.importer, ()):
            continue
        if floor_of(imp.target) > floor_of(imp.importer):
            found.add((imp.importer, imp.target))
    return found


def circles(imports: list[Import]) -> list[tuple[str, ...]]:
    """Return each import circle (a strongly connected component of two or more modules), sorted.

    Tarjan's algorithm, iterative, over the imports that run (``TYPE_CHECKING`` blocks left out).
    """
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.type_checking_only:
            graph.setdefault(imp.importer, set()).add(imp.target)
            graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(tuple(sorted(component)))
    return sorted(found)


def uncommented_function_imports(imports: list[Import]) -> set[tuple[str, str]]:
    """Return ``(importer, target)`` for each import inside a function body without a comment saying why."""
    return {(i.importer, i.target) for i in imports if i.in_function and not i.commented}


def _arrow(pair: tuple[str, ...]) -> str:
    return " -> ".join(f"{m} (floor {floor_of(m)})" for m in pair)


def report(title: str, found: set[tuple[str, ...]], allowed: Mapping[tuple[str, ...], str], hint: str, *,
           show: Callable[[tuple[str, ...]], str] = " -> ".join) -> list[str]:
    """Return readable lines for new violations and for allowlist entries that no longer match."""
    lines = []
    new = sorted(found - set(allowed))
    stale = sorted(set(allowed) - found)
    if new:
        lines.append(f"{title} ({len(new)} new; {hint}):")
        lines += [f"  {show(v)}" for v in new]
    if stale:
        lines.append(f"{title}: {len(stale)} allowlist entries no longer occur,"
                     " remove them from tests/system/test_layers.py:")
        lines += [f"  {show(v)}" for v in stale]
    return lines


# --- the tests -----------------------------------------------------------------------------------------------


def test_the_apps_import_only_their_own_floor_or_below():
    imports = all_imports(app_sources())
    problems = report("imports up a floor", up_imports(imports), UP_IMPORTS_TODAY,
                      "move the code lower or pass a callback down; floors in HOUSE.md and docs/architecture.md",
                      show=_arrow)
    assert not problems, "\n".join(problems)


def test_no_two_modules_import_each_other():
    imports = all_imports(app_sources())
    problems = report("import circles", set(circles(imports)), CIRCLES_TODAY,
                      "each line lists the modules of one circle; break it by moving the shared code lower",
                      show=", ".join)
    assert not problems, "\n".join(problems)


def test_every_import_inside_a_function_says_why():
    imports = all_imports(app_sources())
    problems = report("imports inside a function body without a comment saying why",
                      uncommented_function_imports(imports), UNCOMMENTED_FUNCTION_IMPORTS_TODAY,
                      "import at the top, or add a comment on the line or the line above saying why not")
    assert not problems, "\n".join(problems)


def test_the_app_modules_are_found_and_parsed():
    sources = app_sources()
    imports = all_imports(sources)
    assert {"accs_site.settings", "events.timeline", "workflows.models", "jobs.claim", "nodes.agent",
            "ops.overview"} <= set(sources)
    assert any(i.importer == "jobs.claim" and i.target == "jobs.locks" for i in imports)


SYNTHETIC = {
    "accs_site": "",
    "accs_site.urls": "from ops import views  # wiring\n",
    "events": "",
    "events.timeline": "from jobs.models import Job\n",
    "events.notes": "def f():\n    from workflows import models\n",
    "workflows": "",
    "workflows.models": "from .validation import check\n",
    "workflows.validation": "from workflows import models\n",
    "jobs": "",
    "jobs.models": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jobs.claim import x\n",
    "jobs.claim": "from nodes.models import Host\nfrom jobs import models\n",
    "jobs.api": "def start():\n    # jobs.triggers imports this module\n    from jobs.triggers import fire\n",
    "jobs.triggers": "from jobs.api import start\n",
    "nodes": "",
    "nodes.models": "",
    "ops": "",
    "ops.views": "from jobs.models import Job\nfrom nodes.models import Host\n",
}


def test_the_checker_reports_an_up_import_a_circle_and_an_uncommented_lazy_import():
    imports = all_imports(SYNTHETIC)
    # events reaches up to jobs and workflows; the URL wiring and the claim's hosts are allowed.
    assert up_imports(imports) == {("events.timeline", "jobs.models"), ("events.notes", "workflows.models")}
    # A relative import closes one circle, an import hidden in a function another; TYPE_CHECKING does not.
    assert circles(imports) == [("jobs.api", "jobs.triggers"), ("workflows.models", "workflows.validation")]
    # The commented lazy import passes, the bare one is listed.
    assert uncommented_function_imports(imports) == {("events.notes", "workflows.models")}
    problems = report("imports up a floor", up_imports(imports), {}, "hint", show=_arrow)
    assert problems[0] == "imports up a floor (2 new; hint):"
    assert "  events.timeline (floor 1) -> jobs.models (floor 3)" in problems
    stale = report("import circles", set(), {("a", "b"): "gone"}, "hint", show=", ".join)
    assert stale == ["import circles: 1 allowlist entries no longer occur,"
                     " remove them from tests/system/test_layers.py:",
                     "  a, b"]


def test_a_pragma_alone_is_not_a_reason():
    lines = ["    from jobs import api  # noqa: PLC0415", "    # avoids the circle with jobs.api",
             "    from jobs import api", "    from jobs import api  # noqa: PLC0415 - jobs.api imports us",
             "    x = 1", "    from jobs import claim"]
    assert not _has_reason(lines, 1)
    assert _has_reason(lines, 3)
    assert _has_reason(lines, 4)
    # The comment above a run of imports covers each of them; a statement in between ends the run.
    assert _has_reason(["    # why", "    from a import b", "    from c import d"], 3)
    assert not _has_reason(lines, 6)


# --- today's violations (issue 19 removes them; the lead empties these lists after merging) ----------------

UP_IMPORTS_TODAY: dict[tuple[str, str], str] = {}

CIRCLES_TODAY: dict[tuple[str, ...], str] = {}

UNCOMMENTED_FUNCTION_IMPORTS_TODAY: dict[tuple[str, str], str] = {}
