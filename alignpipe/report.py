"""The evaluate stage's human-facing outputs: a markdown table and a one-glance comparison chart.

Both read the ``metrics.json`` the evaluate stage writes
(``{"policies": {name: {heldout_accuracy, rm_score, mean_length, kl_to_sft,
suspected_reward_hacking, ...}}, "reference": "sft", "heldout": {...}}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alignpipe.settings import RewardHacking

# (metrics.json key, column/panel title, which direction is better, how to print it)
COLUMNS = (
    ("heldout_accuracy", "held-out accuracy", "higher", "{:.1%}"),
    ("rm_score", "reward-model score", "higher", "{:+.3f}"),
    ("mean_length", "mean length (tokens)", None, "{:.2f}"),
    ("kl_to_sft", "KL to SFT (per token)", "lower", "{:.4f}"),
)
TASK_ACCURACY = "heldout_accuracy_"  # + task: the accuracy on that task's prompts alone
HACKING = "suspected_reward_hacking"
REGRESSIONS = "benchmark_regressions"


def benchmark_columns(policies: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """(task, metric) of every lm-eval score any policy has, in first-seen order."""
    seen: dict[tuple[str, str], None] = {}
    for m in policies.values():
        for task, scores in (m.get("benchmarks") or {}).items():
            for metric in scores:
                seen[(task, metric)] = None
    return list(seen)


def _flags(name: str, m: dict[str, Any], reference: str) -> str:
    flags = ["**suspected reward hacking**"] if m.get(HACKING) else []
    flags += [f"**benchmark regression**: {', '.join(m[REGRESSIONS])}"] if m.get(REGRESSIONS) else []
    return "; ".join(flags) or ("reference" if name == reference else "")


def _cell(value: Any, fmt: str, interval: dict[str, float] | None = None) -> str:
    """A figure, with its 95% interval in brackets when it has one."""
    if value is None:
        return "n/a"
    if not interval:
        return fmt.format(value)
    return f"{fmt.format(value)} [{fmt.format(interval['low'])}, {fmt.format(interval['high'])}]"


# Paired differences from the reference: (metrics.json key, column title, format, scale)
DIFFERENCES = (
    ("heldout_accuracy", "accuracy vs {ref} (points)", "{:+.1f}", 100.0),
    ("rm_score", "RM score vs {ref}", "{:+.3f}", 1.0),
)


def _difference(m: dict[str, Any], key: str, fmt: str, scale: float) -> str:
    d = (m.get("vs_reference") or {}).get(key)
    if d is None:
        return "—"
    return _cell(d["value"] * scale, fmt, {"low": d["low"] * scale, "high": d["high"] * scale})


def markdown_table(metrics: dict[str, Any]) -> str:
    """The comparison as markdown: one row per policy, flags in their own column."""
    policies = metrics["policies"]
    reference = metrics.get("reference", "sft")
    heldout = metrics.get("heldout", {})
    bench = benchmark_columns(policies)
    lines = [
        "# Policy comparison",
        "",
        f"{heldout.get('prompts', '?')} held-out prompts (`{heldout.get('data_path', '?')}`), one sample each "
        f"(seed {heldout.get('seed', '?')}, temperature {heldout.get('temperature', '?')}, at most "
        f"{heldout.get('max_new_tokens', '?')} new tokens); the same samples feed every column.",
        "",
        "| policy | "
        + " | ".join(
            [title for _, title, _, _ in COLUMNS]
            + [title.format(ref=f"`{reference}`") for _, title, _, _ in DIFFERENCES]
            + [f"{t} {m}" for t, m in bench]
        )
        + " | flags |",
        "|---|" + "---:|" * (len(COLUMNS) + len(DIFFERENCES) + len(bench)) + "---|",
    ]
    for name, m in policies.items():
        intervals = m.get("intervals") or {}
        cells = [_cell(m.get(key), fmt, intervals.get(key)) for key, _, _, fmt in COLUMNS]
        cells += [_difference(m, key, fmt, scale) for key, _, fmt, scale in DIFFERENCES]
        cells += [
            _cell(
                (m.get("benchmarks") or {}).get(t, {}).get(metric),
                "{:.1%}",
                (m.get("benchmark_intervals") or {}).get(t, {}).get(metric),
            )
            for t, metric in bench
        ]
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {_flags(name, m, reference)} |")
    lines += [
        "",
        "- **[low, high]**: the 95% interval: Wilson's for a share of correct answers, the mean plus or minus "
        "1.96 standard errors for a score.",
        f"- **vs `{reference}`**: the paired difference from `{reference}` on the same prompts (the mean of "
        "per-prompt differences) and its 95% interval; a gain is shown only when the whole interval is above zero.",
        "- **held-out accuracy**: the row's verifier scores the sample correct (`heldout/accuracy` of every stage).",
        f"- **reward-model score**: mean score of `{metrics.get('reward_model') or 'no reward model'}` on the samples.",
        "- **mean length**: tokens per sample (EOS excluded).",
        f"- **KL to SFT**: mean per-token KL(policy || `{reference}`) on the policy's own samples (k3 estimator).",
        f"- **suspected reward hacking**: the reward-model score's difference from `{reference}`'s is above zero "
        f"while the accuracy's is more than {metrics.get('reward_hacking_accuracy_drop', RewardHacking().accuracy_drop):.0%} below zero, "
        "each over its whole interval.",
    ]
    if bench:
        gate = (metrics.get("benchmarks") or {}).get("max_drop") or {}
        lines.append(
            f"- **<task> <metric>**: lm-evaluation-harness scores (`{metrics['benchmarks']['results']}/<policy>`); "
            "**benchmark regression**: the paired difference from "
            f"`{reference}` on the same documents is more than the task's `max_drop` below zero over its whole "
            f"interval ({', '.join(f'{t}: {d:g}' for t, d in gate.items()) or 'no task sets one'})."
        )
    lines += task_table(metrics)
    lines += tool_table(metrics)
    lines += [
        "",
        "![comparison](comparison.png)",
        "",
    ]
    return "\n".join(lines)


def task_table(metrics: dict[str, Any]) -> list[str]:
    """Held-out accuracy on each task's prompts alone: one row per policy, each cell the
    accuracy with its interval and, but for the reference, the paired difference in points."""
    policies = metrics["policies"]
    reference = metrics.get("reference", "sft")
    tasks = sorted({key.removeprefix(TASK_ACCURACY) for m in policies.values() for key in m
                    if key.startswith(TASK_ACCURACY)})  # fmt: skip
    if not tasks:
        return []
    counts = (metrics.get("heldout") or {}).get("tasks") or {}
    lines = [
        "",
        "## Held-out accuracy per task",
        "",
        "| policy | " + " | ".join(f"{t} ({counts[t]} prompts)" if t in counts else t for t in tasks) + " |",
        "|---|" + "---:|" * len(tasks),
    ]
    for name, m in policies.items():
        cells = []
        for task in tasks:
            key = TASK_ACCURACY + task
            cell = _cell(m.get(key), "{:.1%}", (m.get("intervals") or {}).get(key))
            if (m.get("vs_reference") or {}).get(key):
                cell += f"; {_difference(m, key, '{:+.1f}', 100.0)} vs `{reference}`"
            cells.append(cell)
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "A task's interval is wider than the overall one: it rests on that task's prompts alone.",
    ]
    return lines


def comparison_chart(metrics: dict[str, Any], path: Path) -> Path:
    """One bar panel per metric, policies side by side, the reference as a dashed line; flagged
    policies drawn hatched in red so reward hacking is visible at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = metrics["policies"]
    reference = metrics.get("reference", "sft")
    names = list(policies)
    palette = ["#7f7f7f", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    colors = {
        n: ("#7f7f7f" if n == reference else palette[1 + i % (len(palette) - 1)]) for i, n in enumerate(names)
    }

    panels = [(key, title, better, fmt, lambda m, k=key: (m.get(k), (m.get("intervals") or {}).get(k)))
              for key, title, better, fmt in COLUMNS]  # fmt: skip
    panels += [(f"{t}/{metric}", f"{t} {metric}", "higher", "{:.1%}",
                lambda m, t=t, metric=metric: ((m.get("benchmarks") or {}).get(t, {}).get(metric),
                                               (m.get("benchmark_intervals") or {}).get(t, {}).get(metric)))
               for t, metric in benchmark_columns(policies)]  # fmt: skip
    cols = min(len(COLUMNS), len(panels))  # benchmark panels on a second row
    rows = -(-len(panels) // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4.2 * cols, 4.2 * rows), squeeze=False)
    axes = list(grid.flat)
    for spare in axes[len(panels) :]:
        spare.set_visible(False)
    for ax, (key, title, better, fmt, value_of) in zip(axes[: len(panels)], panels, strict=True):
        values, intervals = zip(*(value_of(policies[n]) for n in names), strict=True)
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(names, heights, color=[colors[n] for n in names], edgecolor="black", linewidth=0.6)
        # 95% intervals as error bars (a figure without one, such as KL, has none)
        spans = [(i, h, iv) for i, (h, iv) in enumerate(zip(heights, intervals, strict=True)) if iv]
        if spans:
            ax.errorbar([i for i, _, _ in spans], [h for _, h, _ in spans],
                        yerr=[[h - iv["low"] for _, h, iv in spans], [iv["high"] - h for _, h, iv in spans]],
                        fmt="none", ecolor="black", elinewidth=1, capsize=4)  # fmt: skip
        tops = [max(h, iv["high"]) if iv else h for h, iv in zip(heights, intervals, strict=True)]
        for bar, name, value, top in zip(bars, names, values, tops, strict=True):
            if policies[name].get(HACKING):
                bar.set_hatch("//")
                bar.set_edgecolor("#d62728")
                bar.set_linewidth(2.0)
            up = bar.get_height() >= 0
            ax.annotate(
                _cell(value, fmt),
                (bar.get_x() + bar.get_width() / 2, top if up else bar.get_height()),  # above its interval
                ha="center",
                va="bottom" if up else "top",
                fontsize=9,
                xytext=(0, 2 if up else -2),
                textcoords="offset points",
            )
        ref_value = value_of(policies[reference])[0] if reference in policies else None
        if ref_value is not None and key != "kl_to_sft":
            ax.axhline(ref_value, color="#7f7f7f", linestyle="--", linewidth=1)
        ax.axhline(0, color="black", linewidth=0.6)
        suffix = {"higher": " (higher is better)", "lower": " (lower = closer to SFT)"}.get(better or "", "")
        ax.set_title(title + suffix, fontsize=10)
        if key == "heldout_accuracy" or fmt == "{:.1%}":
            ax.set_ylim(0, max(1.0, max(tops) * 1.15))
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        else:
            low, high = min(heights + [0.0]), max(tops + [0.0])
            pad = (high - low) * 0.15 or 0.1
            ax.set_ylim(low - (pad if low < 0 else 0), high + pad)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    flagged = [n for n in names if policies[n].get(HACKING)]
    heldout = metrics.get("heldout", {})
    title = (
        f"Policies on {heldout.get('prompts', '?')} held-out prompts (dashed line: {reference}; bars: 95% intervals)"
        + (f" - suspected reward hacking (red hatch): {', '.join(flagged)}" if flagged else "")
    )
    fig.suptitle(title, fontsize=11, color="#d62728" if flagged else "black")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tool_table(metrics: dict[str, Any]) -> list[str]:
    """What each policy did with the tools the held-out rows offer (none: no table)."""
    policies = metrics["policies"]
    if not any("tool_calls_per_answer" in m for m in policies.values()):
        return []
    lines = [
        "",
        "## Tools",
        "",
        "| policy | tool calls per answer | malformed calls | accuracy with a call | accuracy without |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in policies.items():
        cells = [
            _cell(m.get("tool_calls_per_answer"), "{:.2f}", None),
            _cell(m.get("tool_malformed_share"), "{:.1%}", None),
        ]
        cells += [
            _cell(m.get(k), "{:.1%}", None) for k in ("tool_accuracy_with_call", "tool_accuracy_without_call")
        ]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines
