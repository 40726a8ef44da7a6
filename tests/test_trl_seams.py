"""The local trainers plug into TRL at a few documented private methods (engines/local/trl_seams.py):
the installed TRL must still have them, a changed one must be named, and no trainer overrides more."""

from __future__ import annotations

import pytest

from alignpipe.engines.local.trl_seams import Seams, check_seams, seam_problems
from alignpipe.errors import UnsupportedSetting


def _private_overrides(cls: type, base: type) -> set[str]:
    """Private (single underscore) methods ``cls`` defines that ``base`` already had."""
    return {
        name
        for name, value in vars(cls).items()
        if name.startswith("_") and not name.startswith("__") and callable(value) and hasattr(base, name)
    }


def test_grpo_seams_hold_on_the_installed_trl_and_are_all_it_overrides() -> None:
    from trl import GRPOTrainer

    from alignpipe.engines.local import grpo

    assert seam_problems(GRPOTrainer, grpo.GRPO_SEAMS) == []
    trainer = grpo.make_trainer_class()
    overridden = _private_overrides(trainer, GRPOTrainer)
    assert overridden == set(grpo.GRPO_SEAMS.overrides)
    assert len(overridden) <= 2


def test_a_changed_trl_method_is_named() -> None:
    """A TRL release whose _compute_loss takes one more parameter, and which dropped a method
    alignpipe calls: the error names both, with the signature found and the one relied on."""
    from trl import GRPOTrainer

    from alignpipe.engines.local.grpo import GRPO_SEAMS

    class NextTRL(GRPOTrainer):
        def _compute_loss(self, model, inputs, num_items_in_batch):
            return None

        _prepare_inputs = None  # gone in this imagined release

    with pytest.raises(UnsupportedSetting) as err:
        check_seams(NextTRL, GRPO_SEAMS)
    text = str(err.value)
    assert "NextTRL._compute_loss(self, model, inputs, num_items_in_batch)" in text
    assert "as (self, model, inputs)" in text
    assert "_prepare_inputs" in text and "make venv" in text
    assert "_generate_and_score_completions" not in text  # that one still holds


def test_a_call_seam_needs_only_the_parameters_passed() -> None:
    class Lib:
        def method(self, a, b, c=None):
            return a

    assert seam_problems(Lib, Seams(overrides={}, calls={"method": ("a", "c")})) == []
    [problem] = seam_problems(Lib, Seams(overrides={}, calls={"method": ("a", "d")}))
    assert "Lib.method(self, a, b, c=None)" in problem


def test_dpo_seams_hold_on_the_installed_trl_and_are_all_it_overrides() -> None:
    from trl import DPOTrainer

    from alignpipe.engines.local.stages import dpo

    assert seam_problems(DPOTrainer, dpo.DPO_SEAMS) == []
    overridden = _private_overrides(dpo.make_trainer_class(), DPOTrainer)
    assert overridden == set(dpo.DPO_SEAMS.overrides)
    assert len(overridden) <= 2
