"""The package's layering (docs/architecture.md, "Layers"): every module imports only from its
own layer or lower ones, at module level and inside functions alike, and no module reaches into another
module's private names (a leading underscore), except where a layer's package exposes them to its own
modules (``backends``)."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "posenc_fast"

# Lowest first; a package stands for its modules.
LAYERS = [
    {"config", "presets", "_spec", "_dropout", "_timing", "_build", "baselines", "_cpu", "_C"},
    {"_validate"},
    {"reference", "positions"},
    {"backends"},
    {"_dispatch"},
    {"ops"},
    {"_prepared"},
    {"functional"},
    {"module"},
    {"integrations", "check", "cli", "benchmark", "explore", "__init__", "__main__"},
]
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _top(path: pathlib.Path) -> str:
    """The first-level name under posenc_fast that ``path`` belongs to."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imports(path: pathlib.Path):
    """(first-level module imported, names imported from it, line) for each import of the package."""
    package = path.relative_to(PACKAGE).parent.parts  # where `from .` points
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - (node.level - 1)])
            target = base + (node.module.split(".") if node.module else [])
            if target:
                yield target[0], [a.name for a in node.names] if len(target) == 1 else [], node.lineno
            else:  # `from .. import x`: x is the module
                for alias in node.names:
                    yield alias.name, [], node.lineno
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name.startswith("posenc_fast."):
                    yield name.split(".")[1], [], node.lineno


def test_every_module_has_a_layer():
    missing = {_top(p) for p in _modules()} - set(LAYER_OF)
    assert not missing, f"add these to LAYERS (and to docs/architecture.md's table of layers): {missing}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path):
    importer = _top(path)
    for imported, _, line in _imports(path):
        if imported == importer:
            continue
        assert imported in LAYER_OF, f"{path.name}:{line} imports unknown posenc_fast.{imported}"
        assert LAYER_OF[imported] <= LAYER_OF[importer], (
            f"{path.name}:{line}: {importer} (layer {LAYER_OF[importer] + 1}) imports {imported} (layer "
            f"{LAYER_OF[imported] + 1}), a higher layer")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_names_of_other_modules(path):
    importer = _top(path)
    for imported, names, line in _imports(path):
        if imported == importer:
            continue  # within a package (backends' modules share its helpers)
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        # A private *module* of the package (``from .. import _build``) is the package's own; its private
        # names are what is refused.
        assert not private, f"{path.name}:{line} imports private names {private} of posenc_fast.{imported}"
