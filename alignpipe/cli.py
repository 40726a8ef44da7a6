"""``alignpipe`` command line: what dvc.yaml stages call, and what people use to look before they run."""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

from alignpipe import config as C
from alignpipe.errors import AlignpipeError


def _cmd_run(args: argparse.Namespace) -> int:
    from alignpipe.launch.interrupt import sigterm_as_interrupt, stop_with_parent
    from alignpipe.stage import run_stage

    # SIGTERM (to us, or to the dvc that started us) unwinds like Ctrl-C: launchers cancel
    # their jobs, nothing is published, and scratch checkpoints stay for the next run.
    stop_with_parent()
    with sigterm_as_interrupt():
        return run_stage(
            C.repo_root(), args.stage, inner=args.inner, profile=args.profile, source=args.source
        )


def plan_files(root: Path, stage: str, profile: str | None, source: str | None = None) -> dict[str, str]:
    """What ``plan`` shows, by file name: the engine's files (the resolved config, what it would
    run) and the stage's launch plan, the one ``alignpipe run`` executes."""
    from alignpipe.context import build_context
    from alignpipe.stage import engine_module, launch_plan

    ctx = build_context(root, stage, profile, source=source)
    engine = engine_module(ctx)
    files = (
        engine.plan(ctx)
        if hasattr(engine, "plan")
        else {f"{ctx.label}.config.yaml": ctx.resolved_config_yaml()}
    )
    return {**files, **launch_plan(ctx, engine, planning=True).files()}


def _cmd_plan(args: argparse.Namespace) -> int:
    root = C.repo_root()
    if args.check:
        return _check(root, args)
    files = plan_files(root, args.stage, args.profile, args.source)
    if args.write:
        out = Path(args.write)
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (out / name).write_text(text)
            if name.endswith(".sh"):
                (out / name).chmod(0o755)
    for name, text in files.items():
        print(f"==> {name} <==")
        print(text.rstrip("\n"))
        print()
    return 0


def _check(root: Path, args: argparse.Namespace) -> int:
    """``plan --check``: the NeMo-RL pre-flight, without running anything."""
    from alignpipe.context import build_context
    from alignpipe.engines.nemo_rl import preflight

    ctx = build_context(root, args.stage, args.profile, source=args.source)
    if ctx.engine != "nemo_rl":
        raise AlignpipeError(
            f"stage '{args.stage}' runs on the {ctx.engine} engine under profile '{ctx.profile}'; "
            "--check validates NeMo-RL configs: pass a GPU profile, e.g. --profile default"
        )
    report = preflight.check(ctx)
    print(report.text(), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


def _cmd_stages(args: argparse.Namespace) -> int:
    root = C.repo_root()
    for name in C.stage_names(root):
        contract = C.load_contract(root, name)
        print(f"{name:10s} {contract.description}")
    return 0


def _cmd_params(args: argparse.Namespace) -> int:
    root = C.repo_root()
    text = C.compose_params_text(root)
    target = root / C.PARAMS_FILE
    if args.check:
        if not target.is_file() or target.read_text() != text:
            print(
                "params.yaml is out of date with conf/; run `alignpipe params` and commit it", file=sys.stderr
            )
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target}")
    return 0


def _cmd_seeds(args: argparse.Namespace) -> int:
    import json

    from alignpipe.measure import compare as K
    from alignpipe.measure import seeds as S

    root = C.repo_root()
    named = [K.resolve(root, name) for name in args.runs]  # every name known before any read
    runs = [K.read_run(root, n) for n in named]
    rows = S.pool(runs)
    print(json.dumps(S.as_json(runs, rows), indent=1) if args.json else S.markdown(runs, rows).rstrip("\n"))
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    import json

    from alignpipe.measure import compare as K

    root = C.repo_root()
    named = [K.resolve(root, name) for name in (args.a, *args.b)]  # every name known before any read
    base = K.read_run(root, named[0])
    reports = []
    for name in named[1:]:
        other = K.read_run(root, name)
        rows, notes = K.compare(base, other)
        reports.append(
            K.as_json(base, other, rows, notes) if args.json else K.markdown(base, other, rows, notes)
        )
    print(
        json.dumps(reports, indent=1) if args.json else "\n".join(reports), end="" if not args.json else "\n"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one stage (what dvc.yaml calls)")
    run.add_argument("stage")
    run.add_argument("--profile", help="config profile (default: params.yaml 'profile')")
    run.add_argument(
        "--source", help="item of a foreach stage, e.g. `convert --source dpo` (dvc.yaml: convert@dpo)"
    )
    run.add_argument(
        "--inner",
        action="store_true",
        help="run the engine here; set by launchers on the machine that does the work",
    )
    run.set_defaults(func=_cmd_run)

    plan = sub.add_parser("plan", help="print the resolved config and launch command without running")
    plan.add_argument("stage")
    plan.add_argument("--profile", help="config profile (default: params.yaml 'profile')")
    plan.add_argument("--source", help="item of a foreach stage, e.g. `convert --source dpo`")
    plan.add_argument("--write", metavar="DIR", help="also write the files into DIR")
    plan.add_argument(
        "--check",
        action="store_true",
        help="validate the NeMo-RL config and launch command with NeMo-RL's own code ($NEMO_RL_SRC)",
    )
    plan.set_defaults(func=_cmd_plan)

    params = sub.add_parser("params", help="regenerate params.yaml from conf/ (as dvc exp run does)")
    params.add_argument("--check", action="store_true", help="exit 1 if params.yaml differs from conf/")
    params.set_defaults(func=_cmd_params)

    compare = sub.add_parser(
        "compare",
        help="every policy's figures in two runs, paired per prompt with 95%% intervals",
        description="A and B are git revisions, DVC experiment names or `workspace`; with several Bs "
        "(a sweep), each is compared with A. Reads the evaluate and benchmark results through DVC.",
    )
    compare.add_argument("a", metavar="A")
    compare.add_argument("b", metavar="B", nargs="+")
    compare.add_argument("--json", action="store_true", help="print JSON instead of Markdown tables")
    compare.set_defaults(func=_cmd_compare)

    seeds = sub.add_parser(
        "seeds",
        help="each policy minus sft in several runs (seeds), and pooled with a 95%% interval over the runs",
        description="RUNs are git revisions, DVC experiment names or `workspace`, typically `dvc exp run "
        "-S seed=N` experiments: whether a gain over sft holds from one training run to another.",
    )
    seeds.add_argument("runs", metavar="RUN", nargs="+")
    seeds.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    seeds.set_defaults(func=_cmd_seeds)

    stages = sub.add_parser("stages", help="list the stages and what they do")
    stages.set_defaults(func=_cmd_stages)
    return parser


def defer_full_collections() -> None:
    """Full garbage collections wait for 1,000 younger ones (Python's default: 10). A stage imports
    torch, transformers and TRL, about a million objects that live as long as the process; with
    the default, Python walked them all ~8 times while importing, 0.4-1.1 CPU s of each stage's
    4-5 s start-up (benchmarks/RESULTS.md). Young cycles are still collected as often as before."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 1000)


def main(argv: list[str] | None = None) -> int:
    defer_full_collections()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except AlignpipeError as e:
        print(f"alignpipe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("alignpipe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
