"""The local engine's stage entry modules, one per stage and named for it: ``alignpipe.stage``
loads ``stages.<stage>`` by name and calls its ``run(ctx)`` (and ``plan``/``needs_image`` where
it has them)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

# transformers' optional uses of scikit-learn and SciPy that no stage reaches: assisted
# generation's confidence threshold (sklearn.metrics.roc_curve) and the object-detection losses
# (scipy.optimize). transformers imports both at its own import whenever they are installed, and
# lm-eval needs them installed: about 0.8 s of every stage's start (benchmarks/RESULTS.md).
OPTIONAL_PROBES = ("is_sklearn_available", "is_scipy_available")


def _absent() -> bool:
    return False


class _AnswerOptionalProbes(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``transformers.utils`` is first imported, has its module answer
    ``OPTIONAL_PROBES`` with False once it has run, before the modules that ask are imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers.utils":
            return None
        sys.meta_path.remove(self)  # the search below (and any later one) goes on without this finder
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_then_answer(module) -> None:
            run_module(module)
            for probe in OPTIONAL_PROBES:
                setattr(module, probe, _absent)

        spec.loader.exec_module = run_then_answer
        return spec


def skip_transformers_optional_imports() -> None:
    """Keep transformers from importing scikit-learn and SciPy for features no stage uses, by
    answering its own availability probes (nothing else sees the answer: both libraries stay
    importable for lm-eval's metrics, a user's tool or a model's remote code). Only before
    transformers is imported; a stage that never imports it pays nothing."""
    if "transformers.utils" not in sys.modules and not any(
        isinstance(f, _AnswerOptionalProbes) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _AnswerOptionalProbes())
