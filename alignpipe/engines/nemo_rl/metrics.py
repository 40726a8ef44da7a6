"""Import NeMo-RL's TensorBoard scalars into the stage's DVCLive directory.

NeMo-RL logs ``<prefix>/<name>`` scalars (nemo-rl.md §9) to
``<logger.log_dir>/exp_NNN/tensorboard/``. They are published under the pipeline's metric
names, from the one vocabulary both engines use (``alignpipe.measure.metrics``), so the two
engines' ``results/<stage>/`` diff and plot together. Tags the vocabulary does not list
(timing/*, ray/*, performance/*, histograms) are not imported. rlvr's validation accuracy gets
its 95% interval here, as the local engine logs it (``with_validation_interval``). ``heldout/*`` is computed after
training with ``measure.heldout`` and added to the summary. NeMo-RL's DPO rewards are
log-ratios before beta; they are multiplied by ``dpo.reference_policy_kl_penalty`` to match TRL's.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from alignpipe.config import get_path
from alignpipe.measure.intervals import wilson
from alignpipe.measure.metrics import NEMO_RL_DERIVED, nemo_rl_scales, nemo_rl_tags


def event_dirs(log_dir: Path) -> list[Path]:
    """Directories holding TensorBoard event files, in run order (exp_001 before exp_002)."""
    found = {p.parent for p in Path(log_dir).rglob("events.out.tfevents.*") if p.is_file()}
    return sorted(found)


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar under ``log_dir``: tag -> {step: value}. A resumed run (a later
    ``exp_NNN``) overrides the steps it repeated."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, dict[int, float]] = defaultdict(dict)
    for directory in event_dirs(log_dir):
        acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for event in acc.Scalars(tag):
                series[tag][int(event.step)] = float(event.value)
    return dict(series)


def map_scalars(
    stage: str, scalars: dict[str, dict[int, float]], cfg: dict[str, Any] | None = None
) -> dict[str, dict[int, float]]:
    """NeMo-RL tags -> pipeline names, on the local engine's scale (e.g. DPO rewards times beta)."""
    table, scales = nemo_rl_tags(stage), nemo_rl_scales(stage)
    out = {}
    for tag, values in scalars.items():
        if tag in table:
            name = table[tag]
            factor = float(get_path(cfg or {}, scales[name], 1.0)) if name in scales else 1.0
            out[name] = {step: value * factor for step, value in values.items()}
    return out


def with_validation_interval(
    stage: str, metrics: dict[str, dict[int, float]], answers: int | None
) -> dict[str, dict[int, float]]:
    """``metrics`` plus, for rlvr, ``val/verifier_accuracy_low``/``_high`` at every validation:
    the 95% Wilson interval over the ``answers`` each validation scored. The accuracy is a mean
    of 0/1 rewards, so accuracy x answers is the count of right answers (rounded, as the local
    engine rounds its own)."""
    accuracy = metrics.get("val/verifier_accuracy")
    if stage not in NEMO_RL_DERIVED or not accuracy or not answers:
        return metrics
    bounds = {step: wilson(round(value * answers), answers) for step, value in accuracy.items()}
    low, high = NEMO_RL_DERIVED[stage]
    return {
        **metrics,
        low: {step: b[0] for step, b in bounds.items()},
        high: {step: b[1] for step, b in bounds.items()},
    }


def write_dvclive(
    out_dir: Path, metrics: dict[str, dict[int, float]], extra_summary: dict[str, Any] | None = None
) -> dict:
    """Replay ``metrics`` (name -> {step: value}) into a DVCLive directory; return the summary."""
    from dvclive import Live

    live = Live(str(out_dir), dvcyaml=None, save_dvc_exp=False, report=None)
    try:
        steps = sorted({s for values in metrics.values() for s in values})
        for step in steps:
            live.step = step
            for name in sorted(metrics):
                if step in metrics[name]:
                    live.log_metric(name, metrics[name][step])
            live.make_summary()
        for group, values in (extra_summary or {}).items():
            live.summary.setdefault(group, {}).update(values)
        live.make_summary()
        return dict(live.summary)
    finally:
        live.end()


def import_metrics(
    stage: str,
    log_dir: Path,
    out_dir: Path,
    extra_summary: dict[str, Any] | None = None,
    cfg: dict[str, Any] | None = None,
    validation_answers: int | None = None,
) -> dict:
    """NeMo-RL TensorBoard logs -> ``out_dir`` (DVCLive) under the pipeline's names;
    ``validation_answers``: how many answers each validation scored (``publish.validation_answers``)."""
    metrics = map_scalars(stage, read_scalars(log_dir), cfg)
    return write_dvclive(out_dir, with_validation_interval(stage, metrics, validation_answers), extra_summary)
