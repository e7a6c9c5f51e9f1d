"""The package's shape, as docs/architecture.md states it: layers that import downwards, no import circles,
only the facades import the engine, drivers reached only through TierIO. Imports under `if TYPE_CHECKING:`
count like any other: a circle or an arrow up made of type-only imports is still a dependency."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__import__("tiered_ckpt").__file__).parent
# job_store: the job's tiers, index, catalog and lifecycle, which the engine and the CLI both open; it builds
# on lifecycle/ and load/ and only facades import it
FACADES = {"tiered_ckpt", "tiered_ckpt.sync", "tiered_ckpt.metrics", "tiered_ckpt.job_store"}
FACADE_PACKAGES = ("tiered_ckpt.cli", "tiered_ckpt.integrations", "tiered_ckpt.bench", "tiered_ckpt.testing",
                   "tiered_ckpt.dcp")  # dcp: the engine behind torch.distributed.checkpoint's storage API
# lowest first: a module may import its own layer and the ones below (agent/ drains saves handed over from save/;
# observe/ reads the SaveHandle and the
# LoadInfo, and only the facades import it)
LAYERS = ["base", "storage", "distributed", "lifecycle", "load", "save", "agent", "observe", "facade"]
# circles known and not yet broken, each with why: a new one fails the test
KNOWN_CIRCLES: set[tuple[str, ...]] = set()  # none: a new circle fails the test


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    if module in FACADES | {"tiered_ckpt.engine"} or module.startswith(FACADE_PACKAGES):
        return "facade"
    second = module.split(".")[1] if module.count(".") else ""
    return second if second in LAYERS else "base"


def imports(path: Path) -> set[str]:
    """Modules of the package that `path` imports, those under `if TYPE_CHECKING:` and inside functions
    included."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("tiered_ckpt"):
                    found.add(target)
                    for alias in node.names:  # `from . import x` imports the module x
                        if (PACKAGE.parent / (target + "." + alias.name).replace(".", "/")).with_suffix(".py").exists():
                            found.add(f"{target}.{alias.name}")
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("tiered_ckpt"))
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []) if isinstance(getattr(node, field, None), list) else [])

    visit(tree.body)
    return found - {me}


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {m: {i for i in imports(p) if i in MODULES} for m, p in MODULES.items()}


def test_no_import_circles():
    seen, stack, circles = set(), [], []

    def walk(m):
        if m in stack:
            circles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if n != m and not m.startswith(n + "."):  # a module importing its own package's __init__ is no circle
                walk(n)
        stack.pop()

    for m in sorted(GRAPH):
        walk(m)
    new = [c for c in circles if tuple(sorted(set(c))) not in KNOWN_CIRCLES]
    assert not new, new[:3]


def test_imports_run_down_the_layers():
    upward = sorted((m, i) for m, imports in GRAPH.items() for i in imports
                    if LAYERS.index(layer(i)) > LAYERS.index(layer(m)))
    assert upward == [], upward


def test_only_the_facades_import_the_engine():
    importers = sorted(m for m, imports in GRAPH.items() if "tiered_ckpt.engine" in imports)
    assert all(m in FACADES or m.startswith(FACADE_PACKAGES) for m in importers), importers


def test_few_modules_at_the_top_of_the_package():
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= 16, sorted(top)


def test_drivers_import_only_the_driver_contract_errors_and_their_declared_helpers():
    """Every driver: those in storage/tiers/ and any other module a built-in kind names (tier_kinds.BUILTIN)."""
    from tiered_ckpt.tier_kinds import BUILTIN

    allowed = {"tiered_ckpt.errors", "tiered_ckpt.storage.tiers.base", "tiered_ckpt.storage.tiers",
               "tiered_ckpt.storage"}
    declared = {"tiered_ckpt.storage.tiers.memory": {"tiered_ckpt.storage.tiers.local"},
                # (checksum: the kept step names file is sealed, so a torn one is listed again, not trusted)
                "tiered_ckpt.storage.tiers.local": {"tiered_ckpt.storage.files", "tiered_ckpt.checksum"},
                "tiered_ckpt.storage.tiers.redis_peer": {"tiered_ckpt.storage.redis_connect"},
                # the fault-injecting test double (kind "faulty") is `local` plus faults: it subclasses the local
                # driver as `memory` does; it lives in testing/ beside the suites, and is held to the drivers' rule
                "tiered_ckpt.testing.faults": {"tiered_ckpt.storage.tiers.local"}}
    drivers = {m for m in GRAPH if m.startswith("tiered_ckpt.storage.tiers.") and not m.endswith("base")}
    drivers |= {target.partition(":")[0] for target in BUILTIN.values()}
    assert drivers <= set(GRAPH), sorted(drivers - set(GRAPH))
    for m in sorted(drivers):
        assert GRAPH[m] <= allowed | declared.get(m, set()), (m, GRAPH[m] - allowed)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith(FACADE_PACKAGES)
                                          and m != "tiered_ckpt.storage.tier_io"))
def test_the_library_reaches_drivers_only_through_tier_io(module):
    """`TierIO.driver()` is for tests and tools; no library path may bypass the tiers' timeouts and retries."""
    assert ".driver(" not in MODULES[module].read_text(), module
