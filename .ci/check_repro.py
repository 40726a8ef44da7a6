"""Compare the committed dvc.lock with the one `make repro` just wrote (.ci/check-repro.sh runs this).

Two kinds of entry, judged differently:

- **must match**: what no runner's CPU can change. Every stage's cmd and params; every dep that
  is code, config or data prep output; the outputs of stages that neither train nor read a
  model (data prep). A difference means code or params changed without a new lock, or prep
  stopped being deterministic: the check fails.
- **trained**: the outputs of every stage that produces a model (stages/<stage>/stage.toml
  `produces` a `checkpoint_hf`) and everything computed from them (their outputs as deps of
  later stages, and those stages' outputs: scores, exports, benchmarks). Floating-point
  training on a runner of unknown CPU need not be bitwise equal to the machine that committed
  the lock, so these differences are reported, not failed (``--strict`` fails them too).

The report goes to stdout and, on GitHub Actions, to the job summary ($GITHUB_STEP_SUMMARY).
Usage: python .ci/check_repro.py COMMITTED_LOCK REPRODUCED_LOCK [--strict] [--repo DIR]
Exit status: 0 nothing that must match differs; 1 something does (or, with --strict, anything).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tomllib
from pathlib import Path

import yaml

MODEL_TYPES = {"checkpoint_hf"}
DIFF_LINES = 300  # of the unified diff shown in the report


def model_stages(repo: Path, names: set[str]) -> set[str]:
    """Lock stage names (``convert@dpo`` counts as ``convert``) whose stage.toml produces a model."""
    found = set()
    for name in names:
        toml = repo / "stages" / name.split("@")[0] / "stage.toml"
        if toml.is_file():
            produces = tomllib.loads(toml.read_text()).get("produces", [])
            if any(p.get("type") in MODEL_TYPES for p in produces):
                found.add(name)
    return found


def within(path: str, roots: set[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def trained(stages: dict, seeds: set[str]) -> tuple[set[str], set[str]]:
    """(stages, output paths) that are a model or computed from one, closed over deps."""
    names, paths = set(seeds), set()
    changed = True
    while changed:
        changed = False
        for name, stage in stages.items():
            if name not in names and any(within(d["path"], paths) for d in stage.get("deps", [])):
                names.add(name)
                changed = True
            outs = {o["path"] for o in stage.get("outs", [])}
            if name in names and not outs <= paths:
                paths |= outs
                changed = True
    return names, paths


def by_path(entries: list[dict] | None) -> dict[str, dict]:
    return {e["path"]: e for e in entries or []}


def compare(committed: dict, reproduced: dict, repo: Path) -> tuple[list[str], list[str]]:
    """(must-match differences, trained differences), one line each."""
    old, new = committed.get("stages", {}), reproduced.get("stages", {})
    every = {**old, **new}
    names, paths = trained(every, model_stages(repo, set(every)))
    must, soft = [], []
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            must.append(f"{name}: stage {'added by' if name in new else 'missing after'} the reproduction")
            continue
        a, b = old[name], new[name]
        if a.get("cmd") != b.get("cmd"):
            must.append(f"{name}: cmd {a.get('cmd')!r} -> {b.get('cmd')!r}")
        if a.get("params") != b.get("params"):
            must.append(f"{name}: params differ")
        for kind in ("deps", "outs"):
            ea, eb = by_path(a.get(kind)), by_path(b.get(kind))
            for path in sorted(set(ea) | set(eb)):
                if ea.get(path) == eb.get(path):
                    continue
                is_trained = within(path, paths) if kind == "deps" else name in names
                line = f"{name}: {kind[:-1]} {path}" + (
                    "" if path in ea and path in eb else " (listed on one side only)"
                )
                (soft if is_trained else must).append(line)
    return must, soft


def report(must: list[str], soft: list[str], diff: list[str], strict: bool) -> str:
    out = ["## dvc.lock after `make repro`", ""]
    if not must and not soft:
        out.append("The reproduction wrote the committed dvc.lock, byte for byte in every entry.")
        return "\n".join(out) + "\n"
    if must:
        out += [
            f"**{len(must)} entries that must match differ** (code, params, dvc.yaml, data prep): "
            "reproduce locally (`make repro`) and commit dvc.lock.",
            "",
        ]
        out += [f"- {line}" for line in must] + [""]
    if soft:
        verdict = "failed: --strict" if strict else "reported, not failed: training on this runner's CPU"
        out += [f"**{len(soft)} trained entries differ** ({verdict}).", ""]
        out += [f"- {line}" for line in soft] + [""]
    shown = diff[:DIFF_LINES]
    more = f"\n... {len(diff) - DIFF_LINES} more lines" if len(diff) > DIFF_LINES else ""
    out += [
        "<details><summary>git-style diff of dvc.lock</summary>",
        "",
        "```diff",
        *shown,
        f"```{more}",
        "</details>",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("committed", type=Path)
    ap.add_argument("reproduced", type=Path)
    ap.add_argument("--strict", action="store_true", help="fail on trained differences too")
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    args = ap.parse_args(argv)
    a_text, b_text = args.committed.read_text(), args.reproduced.read_text()
    must, soft = compare(yaml.safe_load(a_text), yaml.safe_load(b_text), args.repo)
    diff = [
        line.rstrip("\n")
        for line in difflib.unified_diff(
            a_text.splitlines(), b_text.splitlines(), "committed/dvc.lock", "reproduced/dvc.lock", lineterm=""
        )
    ]
    text = report(must, soft, diff, args.strict)
    print(text)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a") as f:
            f.write(text)
    failed = must + (soft if args.strict else [])
    if os.environ.get("GITHUB_ACTIONS") == "true":
        for line in must:
            print(f"::error title=dvc.lock::{line}")
        for line in soft:
            print(f"::{'error' if args.strict else 'notice'} title=dvc.lock (trained)::{line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
