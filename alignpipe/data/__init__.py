"""Stage ``prep``: builtin tiny tasks, source readers, validation, content-keyed splits, manifest.

Entry point: :func:`alignpipe.data.prepare.prepare` (called by ``alignpipe.engines.local.stages.prep``).
Row schemas per family are in :mod:`alignpipe.data.schema` (and DEVELOPING.md, "Prepared data").
"""

from alignpipe.data.schema import FAMILIES, SPLITS, VERIFIERS

__all__ = ["FAMILIES", "SPLITS", "VERIFIERS"]
