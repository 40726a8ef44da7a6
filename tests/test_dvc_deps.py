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
            # `from alignpipe.engines.local import lora` imports the submodule.
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


def entry_modules(stage: str, engine: str = "local") -> list[Path]:
    """What ``alignpipe run <stage>`` imports to run the stage on ``engine`` (stage.engine_module)."""
    if engine == "nemo_rl":
        return [PACKAGE / "engines" / "nemo_rl" / "engine.py"]
    return [PACKAGE / "engines" / "local" / "stages" / f"{stage}.py"]


# A trainer stage's deps on the NeMo-RL engine's code: params derived from runtime.engine
# (hydra_plugins/alignpipe_engine_dep.py), each the path below on the nemo_rl engine.
ENGINE_DEPS = {
    "${runtime.engine_deps.nemo_rl}": "alignpipe/engines/nemo_rl",
    "${runtime.engine_deps.launch}": "alignpipe/launch",
    "${runtime.engine_deps.tools}": "alignpipe/tools",
}


def on_nemo_rl(stage: str) -> bool:
    return "nemo_rl" in C.load_contract(REPO, stage).engines


def stage_spec(stage: str) -> dict:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    return stages[stage].get("do", stages[stage])  # foreach stages keep their deps under `do`


def listed_code_deps(stage: str) -> set[str]:
    return {
        d.rstrip("/")
        for d in stage_spec(stage).get("deps", [])
        if d.startswith("alignpipe/") or d == "alignpipe"
    }


STAGES = list(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])


@pytest.mark.parametrize("stage", STAGES)
def test_dvc_yaml_lists_exactly_the_code_each_stage_imports(stage):
    derived = as_deps(closure(entry_modules(stage)))
    listed = listed_code_deps(stage)
    missing, extra = sorted(derived - listed), sorted(listed - derived)
    assert not missing and not extra, (
        f"dvc.yaml stage '{stage}': code deps differ from what alignpipe/engines/local/stages/{stage}.py "
        f"imports (transitively).\n  missing (add to deps): {missing}\n  extra (remove): {extra}\n"
        "  fix: python -m tests.test_dvc_deps (rewrites the code deps of dvc.yaml)"
    )


@pytest.mark.parametrize("stage", STAGES)
def test_the_nemo_rl_engines_code_is_a_dep_exactly_where_it_can_run(stage):
    """A trainer stage on NeMo-RL also runs the nemo_rl engine and what it imports: the two
    derived deps cover exactly that on the nemo_rl engine, and are nothing on the local one."""
    from hydra_plugins.alignpipe_engine_dep import ON_THE_LOCAL_ENGINE

    listed = {d for d in stage_spec(stage).get("deps", []) if d in ENGINE_DEPS}
    if not on_nemo_rl(stage):
        assert not listed, f"'{stage}' never runs on NeMo-RL, yet lists {sorted(listed)}"
        return
    assert listed == set(ENGINE_DEPS), f"'{stage}' runs on NeMo-RL: list {sorted(ENGINE_DEPS)} in its deps"
    local = closure(entry_modules(stage))
    added = closure(entry_modules(stage, "nemo_rl")) - local
    covered = [d for d in ENGINE_DEPS.values()]
    outside = sorted(
        str(f.relative_to(REPO))
        for f in added
        if not any(str(f.relative_to(REPO)).startswith(d + "/") for d in covered)
    )
    assert not outside, f"the nemo_rl engine runs {outside}, which no dep of '{stage}' covers"
    assert ON_THE_LOCAL_ENGINE in {str(f.relative_to(REPO)) for f in local}


def test_engine_deps_resolve_per_engine_as_the_runtime_decides():
    """The derived params point at NeMo-RL's code exactly when alignpipe.context picks nemo_rl."""
    from alignpipe.context import LOCAL_PROFILES, runtime_settings
    from hydra_plugins.alignpipe_engine_dep import LOCAL_PROFILES as PLUGIN_LOCAL
    from hydra_plugins.alignpipe_engine_dep import ON_THE_LOCAL_ENGINE, engine_dep

    assert PLUGIN_LOCAL == LOCAL_PROFILES
    for profile in ("tiny", "small", "default", "default_megatron", "nemo_gym"):
        for engine in ("auto", "local", "nemo_rl"):
            chosen = runtime_settings({"runtime": {"engine": engine}}, profile)["engine"]
            want = "alignpipe/launch" if chosen == "nemo_rl" else ON_THE_LOCAL_ENGINE
            assert engine_dep(engine, profile, "alignpipe/launch") == want, (engine, profile)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    assert params["runtime"]["engine_deps"] == dict.fromkeys(
        ("nemo_rl", "launch", "tools"), ON_THE_LOCAL_ENGINE
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
            if on_nemo_rl(stage):
                code += list(ENGINE_DEPS)
            others = [d for d in items if not d.startswith("alignpipe/") and d not in ENGINE_DEPS]
            out += [f"{indent}- {d}" for d in code + others]
            stage = None
            continue
        out.append(line)
        i += 1
    path.write_text("\n".join(out))


if __name__ == "__main__":
    rewrite_dvc_yaml()
