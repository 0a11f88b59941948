"""The layers of the package as the import contract in pyproject.toml states them, drawn for
docs/architecture.md (tests/test_docs.py holds the doc to this output, and `make lint` holds the code
to the contract, so neither the picture nor the rule can drift from the code).

usage: python bench/layers.py
"""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent


def contract() -> dict:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return layers


def _line(layer: str) -> str:
    """A module, or a folder with the modules in it."""
    folder = REPO / "finetune" / layer
    if not folder.is_dir():
        return f"  {layer}.py"
    modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    return f"  {layer + '/':<13}" + "  ".join(modules)


def diagram() -> str:
    """One line per layer, highest first: a module imports only from the lines below its own (and, within
    its folder, from the modules beside it)."""
    rows = [_line(layer) for layer in contract()["layers"]]
    return "\n".join(["```", "imports point down: a module may import the layers below its own, never one above", "", "\n  │\n".join(rows), "```"])


if __name__ == "__main__":
    print(diagram())
