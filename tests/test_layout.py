"""The package's wings import only downwards (issue 17): a newcomer finds one docs/design.md
section's code in one folder, and no wing reaches into a wing that builds on it.

Order, bottom to top: ``compat`` (the one fence per library whose private names crossbar
touches: it imports no crossbar module at all), the core modules (``crossbar/*.py``), ``upstream`` (talking to
hosts), ``hosts`` (health table, poller, model lists, balance, affinity), ``state``
(runtime, in-flight counts, queues, counts shared by workers), ``ops`` (records, metrics,
logs, systemd, the ops app), ``proxy`` (the request path), ``process`` (service,
supervisor, workers, reload).
"""

from __future__ import annotations

import ast
import pathlib

from twisted.trial.unittest import SynchronousTestCase

import crossbar

WINGS = ["upstream", "hosts", "state", "ops", "proxy", "process"]
FLOOR = "compat"  # below the core modules
ROOT = pathlib.Path(crossbar.__file__).parent


def _wing(module: str) -> int:
    """The level of a dotted ``crossbar...`` module name: 0 for a core module."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == FLOOR:
        return -1
    if len(parts) > 1 and parts[1] in WINGS:
        return 1 + WINGS.index(parts[1])
    return 0


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("crossbar"):
            names.append(node.module)
            if node.module in ("crossbar",) + tuple(f"crossbar.{w}" for w in WINGS + [FLOOR]):
                names.extend(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names if a.name.startswith("crossbar"))
    return names


class LayoutTests(SynchronousTestCase):
    def test_every_module_is_in_a_known_place(self) -> None:
        for path in ROOT.rglob("*.py"):
            rel = path.relative_to(ROOT)
            if len(rel.parts) > 1:
                self.assertIn(rel.parts[0], WINGS + [FLOOR], f"{rel}: a folder that is not a wing")

    def test_no_wing_imports_a_wing_above_it(self) -> None:
        upward = []
        for path in ROOT.rglob("*.py"):
            rel = path.relative_to(ROOT)
            own = "crossbar." + ".".join(rel.with_suffix("").parts)
            for name in _imports(path):
                if _wing(name) > _wing(own):
                    upward.append(f"{rel} imports {name}")
        self.assertEqual(upward, [], "imports that run upwards")

    def test_no_import_circle(self) -> None:
        """No module reaches back, even behind ``TYPE_CHECKING`` or inside a function
        (issue 30: ``exchange <-> leg <-> resource`` and ``service -> supervisor -> worker
        -> service`` were opened): every import, wherever it stands, counts."""
        graph: dict[str, set[str]] = {}
        for path in ROOT.rglob("*.py"):
            own = ".".join(("crossbar",) + path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            graph[own] = {name for name in _imports(path) if name != own}
        circles = []
        done: set[str] = set()

        def walk(module: str, trail: list[str]) -> None:
            for name in sorted(graph.get(module, ())):
                if name in trail:
                    circles.append(" -> ".join(trail[trail.index(name):] + [name]))
                elif name in graph and name not in done:
                    walk(name, trail + [name])
            done.add(module)

        for module in sorted(graph):
            walk(module, [module])
        self.assertEqual(circles, [])

    def test_the_fences_import_no_crossbar_module(self) -> None:
        """``crossbar/compat`` is the bottom floor: the wings import it, it imports none
        of them (nor the core modules); one fence may use another (txredisapi's
        connections are Twisted services)."""
        found = [f"{path.relative_to(ROOT)} imports {name}" for path in (ROOT / FLOOR).rglob("*.py")
                 for name in _imports(path) if not name.startswith(f"crossbar.{FLOOR}")]
        self.assertEqual(found, [])

    def test_no_class_over_300_lines(self) -> None:
        """A class holds one idea: none in ``crossbar/`` runs over 300 lines (from its
        ``class`` line to its last, docstring included); a longer one is cut along a
        seam, the way ``H1Connection`` (its answers' heads: ``AnswerHead``) and
        ``Supervisor`` (its workers' log and files) were."""
        long = []
        for path in sorted(ROOT.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 300:
                        long.append(f"{path.relative_to(ROOT)}: {node.name} ({lines} lines)")
        self.assertEqual(long, [])

    def test_every_package_is_installed(self) -> None:
        """A regular ``pip install .`` (CI's, bench's and production's) ships every
        package: ``pyproject.toml`` lists them by hand, and a missing one made twistd
        fail with ``No module named 'crossbar.proxy.peek'`` (found in issue 17's work)."""
        import tomllib

        checkout = pathlib.Path(__file__).resolve().parents[1]  # not the installed copy
        with open(checkout / "pyproject.toml", "rb") as f:
            listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
        source = checkout / "crossbar"
        found = {".".join(("crossbar",) + p.parent.relative_to(source).parts) for p in source.rglob("__init__.py")}
        self.assertEqual(found - listed, set(), "packages pyproject.toml does not install")
