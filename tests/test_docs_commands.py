"""The docs are executable: every command they tell people to type is checked against the code.

Commands come from the Markdown docs (fenced blocks, and inline code that starts with a
command), and each is checked by the real component that would read it:

- ``dvc exp run ...``: DVC's own argument parser, then every ``-S`` through DVC's Hydra
  composition of ``conf/`` (``compose_and_dump``, sweeps split as ``dvc exp run --queue`` splits
  them), then every stage's context built from the composed params (a knob the stage's profile
  lacks is refused there), then the Slurm allocation check of ``plan --check``;
- a bare ``-S key=value`` fragment: the same, under at least one profile (it names none);
- ``alignpipe ...``: the CLI's argparse parser, real stage/profile/item names, and ``plan``
  rendered for real;
- ``make ...``: targets and variables of the Makefile;
- ``sed -i 'EXPR' FILE``: run on a copy of FILE, it must change it (the text it replaces is there);
- every repository path a command names, and every backticked repo path or ``alignpipe.*``
  module reference in the docs, config comments and code's comments and docstrings, exists.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import io
import re
import shlex
import subprocess
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from alignpipe import config as C
from tests.conftest import REPO

DOC_GLOBS = (
    "README.md",
    "DEVELOPING.md",
    "docs/*.md",
    "stages/*/README.md",
    "alignpipe/**/README.md",
    "prompts/README.md",
    "tests/golden/README.md",
    "benchmarks/*.md",
)
# Files whose comments cite code and paths (checked by the reference tests, not for commands).
CONFIG_GLOBS = (
    "pyproject.toml",
    "conf/**/*.yaml",
    "stages/*/config/*.yaml",
    "stages/*/stage.toml",
    "dvc.yaml",
    "Makefile",
)
# Top-level entries of the repository a path may start with; DVC outputs (data/, models/, ...) are not here.
REPO_ROOTS = (
    "alignpipe",
    "benchmarks",
    "conf",
    "docs",
    "hydra_plugins",
    "prompts",
    "stages",
    "tests",
    ".ci",
    ".github",
)
# Inline code that shows the syntax, not a command to run.
SYNTAX_EXAMPLES = {"-S key=value", "-S +key=value"}


def doc_files(globs: tuple[str, ...] = DOC_GLOBS) -> list[Path]:
    return sorted({p for g in globs for p in REPO.glob(g) if ".venv" not in p.parts})


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


COMMAND_START = re.compile(
    r"^(?:\w+=\S+\s+)*(?:\.venv/bin/)?(?:dvc exp run|alignpipe|make|sed|python -m)(?:\s|$)"
)
FENCE = re.compile(r"^\s*```")


def extract_commands(path: Path, root: Path = REPO) -> list[Command]:
    """Shell commands in fenced blocks (``console`` blocks: only ``$ `` lines) and inline code."""
    rel = str(path.relative_to(root))
    lines = path.read_text().splitlines()
    found: list[Command] = []
    in_block, lang, pending, start = False, "", "", 0
    prose: list[tuple[int, str]] = []
    for n, line in enumerate(lines, 1):
        if FENCE.match(line):
            in_block, lang = not in_block, line.strip()[3:].strip()
            continue
        if not in_block:
            prose.append((n, line))
            continue
        text = line.strip()
        if lang == "console" and not pending:
            if not text.startswith("$ "):
                continue
            text = text[2:]
        if not pending:
            start = n
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        text, pending = pending + text, ""
        for part in split_chain(text):
            if COMMAND_START.match(part):
                found.append(Command(rel, start, part))
    # Inline code may wrap across lines: rejoin each paragraph before reading its spans.
    joined = "\n".join(f"\x00{n}\x00{line}" for n, line in prose)
    for m in re.finditer(r"`([^`]+)`", joined):
        line_no = int(re.findall(r"\x00(\d+)\x00", joined[: m.start()])[-1])
        text = " ".join(re.sub(r"\x00\d+\x00", " ", m.group(1)).split())
        if text in SYNTAX_EXAMPLES:
            continue
        for part in split_chain(text):
            if " " in part and (COMMAND_START.match(part) or part.startswith("-S ")):  # not a bare `sed`
                found.append(Command(rel, line_no, part))
    return found


def split_chain(text: str) -> list[str]:
    """``a && b; c | d`` -> its simple commands (the docs quote no operators inside arguments)."""
    return [p.strip() for p in re.split(r"\s(?:&&|\|\||;|\|)\s", text) if p.strip()]


def argv_of(text: str) -> list[str]:
    """The command's words: comments, env assignments, optional ``[...]`` brackets and ``...`` dropped
    (a ``key=[...]`` value keeps its brackets: a Hydra list)."""
    words = [w if "=" in w else w.strip("[]") for w in shlex.split(text, comments=True)]
    words = [w for w in words if w]
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        words.pop(0)
    if words and words[0].startswith(".venv/bin/"):
        words[0] = words[0][len(".venv/bin/") :]
    return [w for w in words if w != "..."]


def is_placeholder(word: str) -> bool:
    """``<stage>``, ``STAGE``, ``DIR``, ``P``: a name the reader fills in."""
    return bool(re.fullmatch(r"<[^>]+>|[A-Z][A-Z_]*", word))


ALL_COMMANDS = [c for doc in doc_files() for c in extract_commands(doc)]


# --------------------------------------------------------------------------- the checks


def stage_names() -> list[str]:
    return C.stage_names(REPO)


@functools.cache
def foreach_items(stage: str) -> tuple[str, ...]:
    """A foreach stage's items (a dict's keys: benchmark), empty for other stages."""
    body = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].get(stage) or {}
    return tuple(body.get("foreach") or ())


@functools.cache
def dvc_stage_names() -> tuple[str, ...]:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    names = []
    for name, body in stages.items():
        names += [f"{name}@{item}" for item in body["foreach"]] if "foreach" in body else [name]
    return tuple(names)


def profiles() -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / "profile").glob("*.yaml"))


def trainer_stages() -> list[str]:
    """Stages that run on NeMo-RL under a GPU profile (what ``<stage>`` means in a ``-S`` key)."""
    return [s for s in stage_names() if "nemo_rl" in C.load_contract(REPO, s).engines]


def path_errors(words: list[str]) -> list[str]:
    """Repository paths named by a command (as a word or a ``key=value`` value) that do not exist."""
    errors = []
    for word in words:
        value = word.split("=", 1)[1] if re.match(r"^[\w.+-]+=", word) else word
        if not any(value.startswith(root + "/") for root in REPO_ROOTS) or "<" in value:
            continue  # not a repository path, or one with a placeholder in it
        if not list(REPO.glob(value.rstrip("/"))):
            errors.append(f"path {value} does not exist in the repository")
    return errors


@functools.cache
def compose(overrides: tuple[str, ...]) -> dict:
    return yaml.safe_load(C.compose_params_text(REPO, list(overrides)))


def composition_errors(overrides: tuple[str, ...], targets: tuple[str, ...] = ()) -> list[str]:
    """``-S`` overrides through DVC's Hydra composition, then every stage built from the result,
    and the Slurm allocation checked for the stages that would run (the targets, else all)."""
    from alignpipe.context import build_context
    from alignpipe.engines.nemo_rl.preflight import slurm_allocation_errors

    try:
        params = compose(overrides)
    except Exception as e:  # Hydra's composition errors have no common public base class
        return [f"DVC's Hydra composition refuses {list(overrides)}: {' '.join(str(e).split())}"]
    errors = []
    for stage in stage_names():
        source = (foreach_items(stage) or (None,))[0]
        try:
            ctx = build_context(REPO, stage, params=params, source=source)
        except Exception as e:
            errors.append(f"stage {stage} refuses the composed params.yaml: {' '.join(str(e).split())}")
            continue
        if ctx.engine == "nemo_rl" and (not targets or stage in targets):
            errors += [f"plan --check would refuse it: {e}" for e in slurm_allocation_errors(ctx, ctx.config)]
    return errors


def check_dvc_exp_run(argv: list[str]) -> list[str]:
    from dvc.cli import DvcParserError, parse_args
    from dvc.utils.cli_parse import to_path_overrides
    from dvc.utils.hydra import get_hydra_sweeps, to_hydra_overrides

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = parse_args(["exp", "run", *argv[3:]])
    except (SystemExit, DvcParserError):
        return [f"dvc exp run does not accept {shlex.join(argv[3:])}"]
    errors = [f"no stage {t} in dvc.yaml" for t in args.targets if t not in dvc_stage_names()]
    errors += path_errors(argv)
    path_overrides = to_path_overrides(args.set_param or [])
    errors += [
        f"-S names {f}, not params.yaml (conf/ composes params.yaml)"
        for f in path_overrides
        if f != "params.yaml"
    ]
    for overrides in fill_placeholders(path_overrides.get("params.yaml", [])):
        sweep = any(o.is_sweep_override() for o in to_hydra_overrides(overrides))
        if sweep and not args.queue:
            return [*errors, "a sweep (a,b) needs --queue (DVC refuses it otherwise)"]
        sweeps = get_hydra_sweeps({"params.yaml": overrides}) if sweep else [{"params.yaml": overrides}]
        for one in sweeps:
            errors += composition_errors(
                tuple(one["params.yaml"]), tuple(t.split("@")[0] for t in args.targets)
            )
    return errors


def fill_placeholders(overrides: list[str]) -> list[list[str]]:
    """``profile=<profile>``: every profile; ``<stage>.key=v``: every trainer stage."""
    if any("<profile>" in o for o in overrides):
        return [
            o for p in profiles() for o in fill_placeholders([x.replace("<profile>", p) for x in overrides])
        ]
    if any("<stage>" in o for o in overrides):
        return [[x.replace("<stage>", s) for x in overrides] for s in trainer_stages()]
    return [overrides]


def check_fragment(argv: list[str]) -> list[str]:
    """``-S k=v ...`` with no command around it: it names no profile, so it must compose under one."""
    sets = [argv[i + 1] for i, w in enumerate(argv) if w == "-S"]
    if not sets or len(sets) * 2 != len(argv):
        return ["a fragment must be `-S key=value` pairs only"]
    tried = {}
    for profile in profiles():
        problems = []
        for overrides in fill_placeholders(sets):
            problems += composition_errors((f"profile={profile}", *overrides))
        if not problems:
            return path_errors(sets)
        tried[profile] = problems[0]
    return [f"composes under no profile: {tried}"]


def check_alignpipe(argv: list[str]) -> list[str]:
    from alignpipe.cli import build_parser, plan_files

    parser = build_parser()
    if len(argv) == 2 and argv[1] in subcommands(parser):
        return []  # the command named in prose (`alignpipe run`), not a line to type
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            args: argparse.Namespace = parser.parse_args(argv[1:])
    except SystemExit:
        return [f"the alignpipe CLI does not accept it: {err.getvalue().strip().splitlines()[-1]}"]
    errors = path_errors(argv)
    stage = getattr(args, "stage", None)
    if stage is not None and not is_placeholder(stage) and stage not in stage_names():
        errors.append(f"no stage {stage!r} (stages: {', '.join(stage_names())})")
    profile = getattr(args, "profile", None)
    if profile is not None and not is_placeholder(profile) and profile not in profiles():
        errors.append(f"no profile {profile!r} in conf/profile/")
    source = getattr(args, "source", None)
    items = foreach_items(stage) if stage else ()
    if source is not None and not is_placeholder(source) and source not in items:
        errors.append(f"no {stage} item {source!r} (dvc.yaml foreach: {', '.join(items)})")
    real = stage and not any(map(is_placeholder, (stage, profile or "x", source or "x")))
    if not errors and args.command == "plan" and not args.check and real:
        try:
            plan_files(REPO, stage, profile, source)
        except Exception as e:
            errors.append(f"alignpipe plan fails: {e}")
    return errors


def subcommands(parser: argparse.ArgumentParser) -> set[str]:
    return {name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}


@functools.cache
def makefile_names() -> tuple[set[str], set[str]]:
    text = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_-][A-Za-z0-9_.-]*)\s*:(?!=)", text, flags=re.M))
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:+]?=", text, flags=re.M))
    return targets, variables


def check_make(argv: list[str]) -> list[str]:
    targets, variables = makefile_names()
    errors = []
    for word in argv[1:]:
        if "=" in word:
            name = word.split("=", 1)[0]
            if name not in variables:
                errors.append(f"the Makefile has no variable {name}")
        elif word not in targets:
            errors.append(f"the Makefile has no target {word} (targets: {', '.join(sorted(targets))})")
    return errors


def check_sed(argv: list[str], tmp_path: Path) -> list[str]:
    """``sed -i EXPR FILE``: run for real on a copy, which it must change."""
    if len(argv) != 4 or argv[1] != "-i":
        return ["only `sed -i 'EXPR' FILE` is checked; write the example that way"]
    expr, target = argv[2], REPO / argv[3]
    if not target.is_file():
        return [f"sed edits {argv[3]}, which does not exist"]
    copy = tmp_path / target.name
    copy.write_text(target.read_text())
    subprocess.run(["sed", "-i", expr, str(copy)], check=True)
    if copy.read_text() == target.read_text():
        return [f"the sed expression changes nothing in {argv[3]}: the text it replaces is not there"]
    return []


def check_python_module(argv: list[str]) -> list[str]:
    module = argv[2] if len(argv) > 2 else ""
    path = Path(*module.split("."))
    if module.split(".")[0] in REPO_ROOTS and not (REPO / path.with_suffix(".py")).is_file():
        return [f"no module {module} ({path.with_suffix('.py')})"]
    return []


def check_command(cmd: Command, tmp_path: Path) -> list[str]:
    argv = argv_of(cmd.text)
    if argv[:3] == ["dvc", "exp", "run"]:
        return check_dvc_exp_run(argv)
    if argv[0] == "-S":
        return check_fragment(argv)
    if argv[0] == "alignpipe":
        return check_alignpipe(argv)
    if argv[0] == "make":
        return check_make(argv)
    if argv[0] == "sed":
        return check_sed(argv, tmp_path)
    if argv[:2] == ["python", "-m"]:
        return check_python_module(argv)
    return [f"no check for {argv[0]}"]


@pytest.mark.parametrize("cmd", ALL_COMMANDS, ids=[f"{c.doc}:{c.line}" for c in ALL_COMMANDS])
def test_documented_command_is_valid(cmd: Command, tmp_path: Path) -> None:
    errors = check_command(cmd, tmp_path)
    assert not errors, f"{cmd.where}\n  " + "\n  ".join(errors)


def test_commands_are_found_in_every_kind_of_doc() -> None:
    """The extraction itself: a change to the Markdown layout must not silently check nothing."""
    kinds = {argv_of(c.text)[0] for c in ALL_COMMANDS}
    assert {"dvc", "alignpipe", "make", "sed", "-S"} <= kinds
    docs = {c.doc for c in ALL_COMMANDS}
    assert {"README.md", "docs/GPU.md", "docs/SCALE_OUT.md", "docs/EXPERIMENTS.md"} <= docs
    continued = [
        c for c in ALL_COMMANDS if c.doc == "docs/SCALE_OUT.md" and "slurm.container_image=" in c.text
    ]
    assert continued and all(c.text.startswith("dvc exp run -S profile=default") for c in continued)


# --------------------------------------------------------------------------- bad commands are caught


@pytest.mark.parametrize(
    "text, says",
    [
        ("dvc exp run -S rlvr.grpo.num_generations_per_prompt=16", None),
        ("dvc exp run -S rlvr.grpo.num_generations_per_promt=16", "Could not override"),
        ("dvc exp run -S +rlvr.grpo.no_such_key=1", "stage rlvr refuses"),
        ("dvc exp run -S 'rlhf.loss_fn.reference_policy_kl_penalty=0.1,0.3'", "needs --queue"),
        ("dvc exp run --no-such-flag", "dvc exp run does not accept --no-such-flag"),
        ("dvc exp run -S profile=default nosuchstage", "no stage nosuchstage"),
        ("dvc exp run -S profile=default -S runtime.launcher=slurm -S slurm.nodes=2", "slurm.nodes is 2"),
        ("-S <stage>.cluster.num_nodes=2", None),
        ("-S <stage>.cluster.num_nodez=2", "composes under no profile"),
        ("alignpipe plan rlvr --no-such-flag", "does not accept it"),
        ("alignpipe nosuch", "does not accept it"),
        ("dvc exp run -S profile=<profile>", None),
        ("alignpipe plan rlvr --profile nosuch", "no profile 'nosuch'"),
        ("alignpipe plan convert --source nosuch", "no convert item 'nosuch'"),
        ("alignpipe run nosuch", "no stage 'nosuch'"),
        ("make venv TORCH_WHEELS=/srv/wheels", None),
        ("make nosuch", "no target nosuch"),
        ("make venv NO_SUCH_VAR=1", "no variable NO_SUCH_VAR"),
        ("sed -i 's/reference_policy_kl_penalty: 0.123456/x/' conf/profile/tiny.yaml", "changes nothing"),
        ("python -m tests.no_such_module", "no module tests.no_such_module"),
        ("dvc exp run -S model.name=stages/no_such_dir", "path stages/no_such_dir does not exist"),
    ],
)
def test_a_bad_command_is_named(text: str, says: str | None, tmp_path: Path) -> None:
    errors = check_command(Command("doc.md", 1, text), tmp_path)
    if says is None:
        assert errors == []
    else:
        assert any(says in e for e in errors), errors


def test_commands_are_read_from_blocks_continuations_and_inline_code(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "Run `alignpipe plan\n  sft` or `dvc exp run -S a=1`.\n\n"
        "```console\n$ dvc exp run \\\n  -S b=2   # a comment\noutput line alignpipe\n$ make test && alignpipe params\n```\n"
    )
    cmds = [(c.line, c.text) for c in extract_commands(doc, tmp_path)]
    assert cmds == [
        (5, "dvc exp run -S b=2   # a comment"),
        (8, "make test"),
        (8, "alignpipe params"),
        (1, "alignpipe plan sft"),
        (2, "dvc exp run -S a=1"),
    ]
    assert argv_of(cmds[0][1]) == ["dvc", "exp", "run", "-S", "b=2"]


# --------------------------------------------------------------------------- references in prose


PATH_REF = re.compile(r"(?<![\w/.~$-])((?:" + "|".join(map(re.escape, REPO_ROOTS)) + r")/[\w./*{},<>@-]*)")
MODULE_REF = re.compile(r"(?<![\w./-])(alignpipe(?:\.\w+)+)")


def expand_braces(text: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", text)
    if not m:
        return [text]
    return [
        y for alt in m.group(1).split(",") for y in expand_braces(text[: m.start()] + alt + text[m.end() :])
    ]


def reference_errors(text: str, rel: str, markdown: bool) -> list[str]:
    """Repository paths and ``alignpipe.*`` references in ``text`` (Markdown: in code only) that
    do not exist; ``<name>`` matches anything, ``{a,b}`` both."""
    spans = [text]
    if markdown:
        spans = re.findall(r"`([^`]+)`", text) + re.findall(r"```.*?\n(.*?)```", text, flags=re.S)
    errors = []
    for span in spans:
        for ref in PATH_REF.findall(span):
            ref = ref.split("#")[0].rstrip(".,:")
            while ref.endswith("}") and ref.count("}") > ref.count("{"):
                ref = ref[:-1]  # the end of an interpolation it sits in: ${resolver:...,path}
            for one in expand_braces(ref):
                pattern = re.sub(r"<[^>]+>", "*", one).rstrip("/")
                if pattern and not list(REPO.glob(pattern)):
                    errors.append(f"{rel}: {ref} does not exist")
        for ref in MODULE_REF.findall(span):
            if ref.split(".")[1] in alignpipe_config_keys():
                continue  # a key of the profiles' `alignpipe:` section (alignpipe.heldout.limit)
            if not module_ref_exists(ref.rstrip(".")):
                errors.append(f"{rel}: {ref} is not a module or a name in one")
    return errors


@functools.cache
def alignpipe_config_keys() -> frozenset[str]:
    """The sections of the profiles' ``alignpipe:`` settings (tests/test_settings.py checks the keys)."""
    from dataclasses import fields

    from alignpipe.settings import AlignpipeSettings

    return frozenset(f.name for f in fields(AlignpipeSettings))


def module_ref_exists(ref: str) -> bool:
    """``alignpipe.a.b`` is a module (file or package), or ``alignpipe.a.name`` a name defined in one."""
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[i:]
            if not rest:
                return True
            defined = rf"^\s*(?:def|class|async def)\s+{rest[0]}\b|^{rest[0]}\s*[:=]"
            if re.search(defined, module.read_text(), re.M):
                return len(rest) <= 2  # a function, or a method of a class
            # Re-exported (``from x import *``): ask the module itself.
            return len(rest) == 1 and hasattr(importlib.import_module(".".join(parts[:i])), rest[0])
    return False


@pytest.mark.parametrize(
    "path", doc_files() + doc_files(CONFIG_GLOBS), ids=lambda p: str(p.relative_to(REPO))
)
def test_paths_and_modules_the_docs_cite_exist(path: Path) -> None:
    errors = reference_errors(path.read_text(), str(path.relative_to(REPO)), path.suffix == ".md")
    assert not errors, "\n".join(errors)


# Code whose comments and docstrings cite docs and modules (tests/ name missing paths on purpose).
CODE_GLOBS = (
    "alignpipe/**/*.py",
    "stages/**/*.py",
    "hydra_plugins/**/*.py",
    "benchmarks/*.py",
    "benchmarks/*.sh",
)


def comment_text(path: Path) -> str:
    """The comments and docstrings of a Python file, the comment lines of a shell script: prose,
    where a path is a citation (code's own strings are paths it builds, f-strings among them)."""
    text = path.read_text()
    if path.suffix != ".py":
        return "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    parts = [
        t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            parts.append(ast.get_docstring(node) or "")
    return "\n".join(parts)


@pytest.mark.parametrize("path", doc_files(CODE_GLOBS), ids=lambda p: str(p.relative_to(REPO)))
def test_paths_and_modules_code_comments_cite_exist(path: Path) -> None:
    errors = reference_errors(comment_text(path), str(path.relative_to(REPO)), markdown=False)
    assert not errors, "\n".join(errors)


def test_code_comments_and_docstrings_are_read_but_not_code(tmp_path: Path) -> None:
    code = tmp_path / "x.py"
    code.write_text('"""See docs/NOPE.md."""\nPATH = f"stages/{name}/x.yaml"  # and docs/ALSO_NOPE.md\n')
    assert sorted(reference_errors(comment_text(code), "x.py", markdown=False)) == [
        "x.py: docs/ALSO_NOPE.md does not exist",
        "x.py: docs/NOPE.md does not exist",
    ]


def test_a_missing_reference_is_named() -> None:
    doc = (
        "`alignpipe.measure.heldout.heldout_accuracy`, `alignpipe.rewards.score_completion` (re-exported),\n"
        "`alignpipe.heldout.limit` (a config key), `stages/<stage>/config/{tiny,small}.yaml`, and\n"
        "`alignpipe.engines.local.common.heldout_accuracy`, `docs/NOPE.md#a`, `stages/{sft,nope}/README.md`;\n"
        "outside code docs/ALSO_NOPE.md is prose."
    )
    assert sorted(reference_errors(doc, "x.md", markdown=True)) == [
        "x.md: alignpipe.engines.local.common.heldout_accuracy is not a module or a name in one",
        "x.md: docs/NOPE.md does not exist",
        "x.md: stages/{sft,nope}/README.md does not exist",
    ]
    assert reference_errors("# see docs/ALSO_NOPE.md", "x.yaml", markdown=False) == [
        "x.yaml: docs/ALSO_NOPE.md does not exist"
    ]
