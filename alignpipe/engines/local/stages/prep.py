"""Stage ``prep``: sources -> validated, deduplicated, content-split ``data/prepared``."""

from __future__ import annotations

import os

from alignpipe import console
from alignpipe.artifacts import staged_dir
from alignpipe.context import StageContext
from alignpipe.data.prepare import prepare
from alignpipe.engines.local.publish import write_record


def run(ctx: StageContext) -> None:
    with staged_dir(ctx.output("prepared")) as out:
        os.chmod(out, 0o755)  # mkdtemp makes it 0700; data/prepared is shared with every stage
        manifest = prepare(ctx.config, ctx.root, out)
        write_record(
            out,
            ctx,
            type="training_jsonl",
            format="jsonl",
            metrics={
                "rows": manifest["total_rows"],
                "duplicates_removed": manifest["duplicates_removed"]["total"],
                "rows_rejected": manifest["rows_rejected"]["total"],
            },
            extra={"counts": manifest["counts"]},
        )
    summary = ", ".join(
        f"{fam} {c['train']}/{c['validation']}/{c['test']}" for fam, c in manifest["counts"].items()
    )
    ties = manifest["ties_dropped"]["total"]
    dropped = f"; {ties} preference tie(s) dropped (HelpSteer3 overall_preference 0)" if ties else ""
    console.outcome(
        "prep",
        {"train/validation/test rows": summary + dropped},
        ctx.output("prepared").relative_to(ctx.root),
        ctx.started,
    )
