"""The package's layers as a tool holds them: import-linter's contracts (pyproject.toml, run by `make
lint`: layers, a torch-free config, independent modules) pass on the code and refuse an import that breaks
one; no module imports itself back through others (lazy imports inside functions included: grimp reads
every import statement)."""

from __future__ import annotations

import shutil
import subprocess
import sys

from conftest import REPO

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())", "--no-cache"]


def _lint(root) -> subprocess.CompletedProcess:
    return subprocess.run(LINT, cwd=root, capture_output=True, text=True, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_the_contracts_hold_and_refuse_an_import_up_a_layer_torch_in_config_or_a_tie_between_independents(tmp_path):
    kept = _lint(REPO)
    assert kept.returncode == 0 and "5 kept, 0 broken" in kept.stdout, kept.stdout[-2000:] + kept.stderr[-2000:]
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "finetune", copy / "finetune", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    # A function-level import of the recipe from the model layer (the kind a cycle hides behind), and
    # torch reached from the config layer through a module of its own.
    attention, strategy = copy / "finetune" / "model" / "attention.py", copy / "finetune" / "config" / "strategy.py"
    attention.write_text(attention.read_text() + "\n\ndef _shortcut():\n    from finetune.train import run\n\n    return run\n")
    (copy / "finetune" / "config" / "tensors.py").write_text("import torch\n")
    strategy.write_text(strategy.read_text() + "\n\ndef _tensors():\n    from finetune.config import tensors\n\n    return tensors\n")
    guard = copy / "finetune" / "run" / "guard.py"  # and the guard reaching for the metrics it must stay apart from
    guard.write_text(guard.read_text() + "\n\ndef _metrics():\n    from finetune.run import metrics\n\n    return metrics\n")
    broken = _lint(copy)
    assert broken.returncode == 1 and "0 kept, 5 broken" in broken.stdout, broken.stdout[-2000:]  # the shortcut ties the independents too
    assert "finetune.run.guard -> finetune.run.metrics" in broken.stdout, broken.stdout[-3000:]
    assert "finetune.model.attention -> finetune.train" in broken.stdout, broken.stdout[-3000:]
    assert "finetune.config.tensors -> torch" in broken.stdout, broken.stdout[-3000:]


def test_no_module_imports_itself_back():
    import grimp

    graph = grimp.build_graph("finetune")
    cycles = [(a, b) for a in sorted(graph.modules) for b in sorted(graph.find_modules_directly_imported_by(a))
              if graph.chain_exists(importer=b, imported=a)]
    assert not cycles, [graph.find_shortest_chain(importer=b, imported=a) for a, b in cycles]


def test_every_folder_of_the_package_is_in_git_with_its_init():
    """A folder's __init__.py that git ignores (a pattern meant for a run's outputs/) leaves a fresh clone
    with a namespace package the contract cannot read."""
    import subprocess

    tracked = set(subprocess.run(["git", "ls-files", "finetune"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split())
    folders = {p.parent for p in (REPO / "finetune").rglob("*.py") if "__pycache__" not in p.parts}
    assert all(str((f / "__init__.py").relative_to(REPO)) in tracked for f in folders), sorted(
        str(f.relative_to(REPO)) for f in folders if str((f / "__init__.py").relative_to(REPO)) not in tracked)
