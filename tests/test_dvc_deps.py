"""dvc.yaml lists exactly the code each stage runs: the files its engine entry modules import,
transitively within alignpipe/ (module-level and function-level imports alike), found by a
static walk of the import statements. A directory stands for its files when the stage imports
every one of them. Too few deps and editing code a stage runs does not re-run it (the lock
lies); too many and unrelated edits re-run it.

The runner (cli.py, stage.py) is left out: it picks the engine and hands over, and never
shapes what a stage writes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from alignpipe import config as C

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "alignpipe"
NAMED = re.compile(r"alignpipe(\.\w+)+")


def module_file(module: str) -> Path | None:
    """``alignpipe.x.y`` -> its file (module or package ``__init__``), None outside alignpipe/."""
    if module != "alignpipe" and not module.startswith("alignpipe."):
        return None
    base = REPO.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def runs_code(init: Path) -> bool:
    """A package ``__init__`` whose body is only a docstring (or the version) runs nothing."""
    body = ast.parse(init.read_text()).body
    return any(
        not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        and not (
            isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["__version__"]
        )
        for node in body
    )


def imported_modules(path: Path) -> set[str]:
    """Every alignpipe module ``path`` imports, wherever the import statement sits, and every one
    it runs by name (``python -m alignpipe....``, NeMo-RL's registry of ``module.Class`` names)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts)
    if path.name == "__init__.py":
        package = package.rsplit(".", 1)[0] + "." + "__init__"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = package.rsplit(".", node.level)[0]
                base = f"{parent}.{node.module}" if node.module else parent
            else:
                base = node.module or ""
            found.add(base)
            # `from alignpipe.engines.local import training` imports the submodule.
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and NAMED.fullmatch(node.value):
            parts = node.value.split(".")
            found.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    return {m for m in found if module_file(m) is not None}


def closure(entries: list[Path]) -> set[Path]:
    """Files run by importing ``entries``: their imports, transitively, and parent packages."""
    seen: set[Path] = set()
    todo = list(entries)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        parts = module.split(".")
        # Importing a.b.c runs a/__init__ and a/b/__init__ first.
        parents = [module_file(".".join(parts[:i])) for i in range(2, len(parts))]
        todo += [p for p in parents if p is not None and p not in seen]
        todo += [f for m in imported_modules(path) if (f := module_file(m)) and f not in seen]
    return {p for p in seen if p.name != "__init__.py" or runs_code(p)}


def as_deps(files: set[Path]) -> set[str]:
    """Files -> dvc.yaml deps: a directory when every code file in it is imported."""
    deps = {str(f.relative_to(REPO)) for f in files}
    for directory in sorted(
        {d for f in files for d in f.parents if PACKAGE in d.parents}, key=lambda d: -len(d.parts)
    ):
        members = {
            str(f.relative_to(REPO))
            for f in directory.rglob("*.py")
            if "__pycache__" not in f.parts and (f.name != "__init__.py" or runs_code(f))
        }
        covered = {d for d in deps if d in members or d.startswith(f"{directory.relative_to(REPO)}/")}
        if members and members <= covered:
            deps = (deps - covered) | {str(directory.relative_to(REPO))}
    return deps


def entry_modules(stage: str) -> list[Path]:
    """What ``alignpipe run <stage>`` imports to run the stage (stage.engine_module)."""
    contract = C.load_contract(REPO, stage)
    entries = [PACKAGE / "engines" / "local" / f"{stage}.py"]
    if "nemo_rl" in contract.engines:
        entries.append(PACKAGE / "engines" / "nemo_rl" / "__init__.py")
    return entries


def listed_code_deps(stage: str) -> set[str]:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    spec = stages[stage].get("do", stages[stage])  # foreach stages keep their deps under `do`
    return {d.rstrip("/") for d in spec.get("deps", []) if d.startswith("alignpipe/") or d == "alignpipe"}


STAGES = list(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])


@pytest.mark.parametrize("stage", STAGES)
def test_dvc_yaml_lists_exactly_the_code_each_stage_imports(stage):
    derived = as_deps(closure(entry_modules(stage)))
    listed = listed_code_deps(stage)
    missing, extra = sorted(derived - listed), sorted(listed - derived)
    assert not missing and not extra, (
        f"dvc.yaml stage '{stage}': code deps differ from what alignpipe/engines/local/{stage}.py "
        f"imports (transitively).\n  missing (add to deps): {missing}\n  extra (remove): {extra}\n"
        "  fix: python -m tests.test_dvc_deps (rewrites the code deps of dvc.yaml)"
    )


def test_walk_sees_function_level_imports():
    """The walk follows imports inside functions: evaluate reaches convert (lazy or not) and
    the NeMo-RL converter, which convert imports only inside a function."""
    files = {str(f.relative_to(REPO)) for f in closure(entry_modules("convert"))}
    assert "alignpipe/engines/nemo_rl/convert.py" in files


def rewrite_dvc_yaml() -> None:
    """Rewrite dvc.yaml's code deps (``alignpipe/...`` lines) from the walk; other deps stay."""
    path = REPO / "dvc.yaml"
    lines, out, stage = path.read_text().split("\n"), [], None
    i = 0
    while i < len(lines):
        line = lines[i]
        if (m := re.match(r"^  (\w+):$", line)) and m.group(1) in STAGES:
            stage = m.group(1)
        if stage and re.match(r"^ +deps:$", line):
            out.append(line)
            i += 1
            items, indent = [], ""
            while i < len(lines) and re.match(r"^ +- ", lines[i]):
                indent = lines[i][: lines[i].index("-")]
                items.append(lines[i].strip()[2:])
                i += 1
            code = sorted(as_deps(closure(entry_modules(stage))))
            out += [f"{indent}- {d}" for d in code + [d for d in items if not d.startswith("alignpipe/")]]
            stage = None
            continue
        out.append(line)
        i += 1
    path.write_text("\n".join(out))


if __name__ == "__main__":
    rewrite_dvc_yaml()
