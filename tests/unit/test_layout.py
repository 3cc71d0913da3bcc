"""The layout's one rule, as README.md "Layout" states it: imports flow one way, from the core up to the
command line, and nothing in the product imports the lab but the `kvwatch lab` command.

Every import of every product module is read (ast, lazy imports in functions too); an import of a
package in a later layer, or of a peer in the same layer, is a failure naming the module and the line.
"""

from __future__ import annotations

import ast
import re

from paths import REPO

# Lowest first; a package may import only those in earlier layers. Peers in a layer import none of each
# other. The lab is outside the order: it uses the product, and only LAB_USERS may import it.
LAYERS = (
    ("core",),
    ("collectors",),
    ("store",),
    ("config",),
    ("serve",),
    ("prometheus",),
    ("alerts",),
    ("grafana", "doctor", "experiment", "onboarding"),
    ("dashboard",),
    ("cli",),
)
LAB = "lab"
LAB_USERS = {"cli/lab.py"}
NOT_CODE = {"examples"}  # a package of data files (kvwatch.examples)
LAYER = {package: number for number, layer in enumerate(LAYERS) for package in layer}


def imported_packages(source: str, package: str) -> list[tuple[int, str]]:
    """(line, top-level kvwatch package) of every import in `source`, a module of `package`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            names = [f"kvwatch.{package}"]  # relative: within its own package
        elif isinstance(node, ast.ImportFrom) and node.module == "kvwatch":
            names = [f"kvwatch.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        found += [(node.lineno, name.split(".")[1]) for name in names if name.startswith("kvwatch.")]
    return found


def problems(path: str, source: str) -> list[str]:
    """What is wrong with the imports of the module at repository path `path`."""
    package = path.split("/")[0]
    wrong = []
    for line, imported in imported_packages(source, package):
        where = f"{path}:{line} imports kvwatch.{imported}"
        if imported == LAB:
            if package != LAB and path not in LAB_USERS:
                wrong.append(f"{where}: only lab/ and {', '.join(sorted(LAB_USERS))} may")
        elif package == LAB or imported == package:
            continue
        elif imported not in LAYER:
            wrong.append(f"{where}: a package with no place in the layers")
        elif LAYER[imported] >= LAYER[package]:
            side = "a peer in its layer" if LAYER[imported] == LAYER[package] else "a later layer"
            wrong.append(f"{where}: {side} (order: {' -> '.join(map('|'.join, LAYERS))})")
    return wrong


def product_packages() -> set[str]:
    """The top-level packages pyproject.toml installs."""
    listed = re.findall(r'"kvwatch\.(\w+)[."]', (REPO / "pyproject.toml").read_text())
    return set(listed) - NOT_CODE


def test_every_package_has_a_place_in_the_order():
    assert product_packages() == set(LAYER) | {LAB}


def test_imports_flow_one_way_and_only_the_lab_command_imports_the_lab():
    wrong = []
    for package in sorted(product_packages()):
        for module in sorted((REPO / package).rglob("*.py")):
            path = module.relative_to(REPO).as_posix()
            wrong += problems(path, module.read_text())
    assert wrong == []


def test_a_wrong_way_import_is_named_wherever_it_hides():
    source = """
import kvwatch.core.errors
from kvwatch.store import history
from kvwatch import serve
from . import sibling

def later():
    from kvwatch.lab import state
    import kvwatch.doctor.checks
"""
    # the top layer may import every other, but not the lab
    assert problems("cli/x.py", source) == ["cli/x.py:8 imports kvwatch.lab: only lab/ and cli/lab.py may"]
    later = "a later layer (order: core -> collectors -> store -> config -> serve -> prometheus -> alerts -> "
    later += "grafana|doctor|experiment|onboarding -> dashboard -> cli)"
    assert problems("collectors/probe/x.py", source) == [
        f"collectors/probe/x.py:3 imports kvwatch.store: {later}",
        f"collectors/probe/x.py:4 imports kvwatch.serve: {later}",
        "collectors/probe/x.py:8 imports kvwatch.lab: only lab/ and cli/lab.py may",
        f"collectors/probe/x.py:9 imports kvwatch.doctor: {later}",
    ]


def test_peers_and_unknown_packages_are_named_and_the_lab_command_may_import_the_lab():
    assert [p.split(": ")[1][:20] for p in problems("grafana/x.py", "from kvwatch.doctor import checks")] == [
        "a peer in its layer "
    ]
    assert problems("doctor/x.py", "import kvwatch.nowhere") == [
        "doctor/x.py:1 imports kvwatch.nowhere: a package with no place in the layers"
    ]
    assert problems("cli/lab.py", "from kvwatch.lab import stack") == []
    assert problems("cli/serve.py", "from kvwatch.lab import stack") == [
        "cli/serve.py:1 imports kvwatch.lab: only lab/ and cli/lab.py may"
    ]
    assert problems("lab/stack.py", "from kvwatch.cli import main") == []  # the lab uses the product
