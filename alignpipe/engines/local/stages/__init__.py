"""The local engine's stage entry modules, one per stage and named for it: ``alignpipe.stage``
loads ``stages.<stage>`` by name and calls its ``run(ctx)`` (and ``plan``/``needs_image`` where
it has them)."""

import sys

# The stages that may import scikit-learn and SciPy: lm-eval's f1 and mcc metrics do.
USE_SCIENTIFIC_STACK = frozenset({"benchmark"})


def skip_unused_libraries(stage: str) -> None:
    """Keep transformers from importing scikit-learn and SciPy in a stage that never uses them.
    transformers imports each whenever it is installed (scikit-learn for assisted generation's
    candidate thresholds, SciPy for the object-detection losses), and lm-eval needs them
    installed; the two imports are about 2 s of every stage process's start (benchmarks/RESULTS.md,
    "stop 48"). ``None`` in ``sys.modules`` is Python's own way to say a module is absent:
    ``find_spec`` returns None and an import raises ImportError."""
    if stage not in USE_SCIENTIFIC_STACK:
        for name in ("sklearn", "scipy"):
            sys.modules.setdefault(name, None)
