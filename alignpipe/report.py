"""The evaluate stage's human-facing outputs: a markdown table and a one-glance comparison chart.

Both read the ``metrics.json`` the evaluate stage writes
(``{"policies": {name: {heldout_accuracy, rm_score, mean_length, kl_to_sft,
suspected_reward_hacking, ...}}, "reference": "sft", "heldout": {...}}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# (metrics.json key, column/panel title, which direction is better, how to print it)
COLUMNS = (
    ("heldout_accuracy", "held-out accuracy", "higher", "{:.1%}"),
    ("rm_score", "reward-model score", "higher", "{:+.3f}"),
    ("mean_length", "mean length (tokens)", None, "{:.2f}"),
    ("kl_to_sft", "KL to SFT (per token)", "lower", "{:.4f}"),
)
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


def _cell(value: Any, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


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
        + " | ".join([title for _, title, _, _ in COLUMNS] + [f"{t} {m}" for t, m in bench])
        + " | flags |",
        "|---|" + "---:|" * (len(COLUMNS) + len(bench)) + "---|",
    ]
    for name, m in policies.items():
        cells = [_cell(m.get(key), fmt) for key, _, _, fmt in COLUMNS]
        cells += [_cell((m.get("benchmarks") or {}).get(t, {}).get(metric), "{:.1%}") for t, metric in bench]
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {_flags(name, m, reference)} |")
    lines += [
        "",
        "- **held-out accuracy**: the row's verifier scores the sample correct (`heldout/accuracy` of every stage).",
        f"- **reward-model score**: mean score of `{metrics.get('reward_model') or 'no reward model'}` on the samples.",
        "- **mean length**: tokens per sample (EOS excluded).",
        f"- **KL to SFT**: mean per-token KL(policy || `{reference}`) on the policy's own samples (k3 estimator).",
        f"- **suspected reward hacking**: reward-model score above `{reference}`'s while accuracy is more than "
        f"{metrics.get('reward_hacking_accuracy_drop', 0.0):.0%} below it.",
    ]
    if bench:
        gate = (metrics.get("benchmarks") or {}).get("max_drop") or {}
        lines.append(
            f"- **<task> <metric>**: lm-evaluation-harness scores (`{metrics['benchmarks']['results']}/<policy>`); "
            "**benchmark regression**: more than the task's `max_drop` below "
            f"`{reference}` ({', '.join(f'{t}: {d:g}' for t, d in gate.items()) or 'no task sets one'})."
        )
    lines += [
        "",
        "![comparison](comparison.png)",
        "",
    ]
    return "\n".join(lines)


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

    panels = [(key, title, better, fmt, lambda m, k=key: m.get(k)) for key, title, better, fmt in COLUMNS]
    panels += [(f"{t}/{metric}", f"{t} {metric}", "higher", "{:.1%}",
                lambda m, t=t, metric=metric: (m.get("benchmarks") or {}).get(t, {}).get(metric))
               for t, metric in benchmark_columns(policies)]  # fmt: skip
    cols = min(len(COLUMNS), len(panels))  # benchmark panels on a second row
    rows = -(-len(panels) // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4.2 * cols, 4.2 * rows), squeeze=False)
    axes = list(grid.flat)
    for spare in axes[len(panels) :]:
        spare.set_visible(False)
    for ax, (key, title, better, fmt, value_of) in zip(axes[: len(panels)], panels, strict=True):
        values = [value_of(policies[n]) for n in names]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(names, heights, color=[colors[n] for n in names], edgecolor="black", linewidth=0.6)
        for bar, name, value in zip(bars, names, values, strict=True):
            if policies[name].get(HACKING):
                bar.set_hatch("//")
                bar.set_edgecolor("#d62728")
                bar.set_linewidth(2.0)
            ax.annotate(
                _cell(value, fmt),
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom" if bar.get_height() >= 0 else "top",
                fontsize=9,
                xytext=(0, 2 if bar.get_height() >= 0 else -2),
                textcoords="offset points",
            )
        ref_value = value_of(policies[reference]) if reference in policies else None
        if ref_value is not None and key != "kl_to_sft":
            ax.axhline(ref_value, color="#7f7f7f", linestyle="--", linewidth=1)
        ax.axhline(0, color="black", linewidth=0.6)
        suffix = {"higher": " (higher is better)", "lower": " (lower = closer to SFT)"}.get(better or "", "")
        ax.set_title(title + suffix, fontsize=10)
        if key == "heldout_accuracy" or fmt == "{:.1%}":
            ax.set_ylim(0, max(1.0, max(heights) * 1.15))
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        else:
            low, high = min(heights + [0.0]), max(heights + [0.0])
            pad = (high - low) * 0.15 or 0.1
            ax.set_ylim(low - (pad if low < 0 else 0), high + pad)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    flagged = [n for n in names if policies[n].get(HACKING)]
    heldout = metrics.get("heldout", {})
    title = f"Policies on {heldout.get('prompts', '?')} held-out prompts (dashed line: {reference})" + (
        f" - suspected reward hacking (red hatch): {', '.join(flagged)}" if flagged else ""
    )
    fig.suptitle(title, fontsize=11, color="#d62728" if flagged else "black")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
