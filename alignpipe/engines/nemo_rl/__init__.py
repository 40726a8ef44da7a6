"""The production engine: NeMo-RL v0.7.0's own trainers in their pinned container.

The pipeline renders NeMo-RL configs, launches NeMo-RL's entry scripts, and collects
checkpoints and metrics; it never reimplements a training loop. See engine.py for the
flow, render.py for the config, inputs.py and publish.py for what a run reads and writes, convert.py for checkpoint formats and converters,
metrics.py for the TensorBoard -> DVCLive name mapping, environment.py for alignpipe's
verifiers inside NeMo-RL, and docs/GPU.md for the GPU-host workflow.

The package imports nothing itself: alignpipe.stage runs ``engine`` (``run``, ``plan``), and the
local engine's convert stage reads ``convert`` (the converters' command lines) without pulling in
the renderer, so that neither becomes a dependency of a stage that never runs it.
"""
