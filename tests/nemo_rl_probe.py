"""NeMo-RL v0.7.0's own code on given inputs, for the equivalence suite. Runs in a subprocess.

    python -m tests.nemo_rl_probe <probe> in.pt out.pt

with NeMo-RL's source first on PYTHONPATH and the interpreter from ``nemo_rl_runtime_python``
(tests/conftest.py): ``in.pt`` is the payload the test saved, ``out.pt`` what the probe returns.
Nothing here re-implements NeMo-RL; each probe builds NeMo-RL's objects the way its algorithm
code does (file and function named) and calls them. The test compares the result with the
local engine's own functions in its own process.

One adjustment, to the interpreter rather than to NeMo-RL: on Python 3.11 pydantic refuses
``typing.TypedDict``, which NeMo-RL's config modules use (it needs 3.13); ``typing_extensions``
has the same class with the same semantics, so it is put in its place before NeMo-RL imports.
"""

from __future__ import annotations

import sys
import types
import typing

import typing_extensions

typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
typing.NotRequired = typing_extensions.NotRequired  # type: ignore[misc]

import torch  # noqa: E402


def advantages(payload: dict) -> list[torch.Tensor]:
    """Per case: the estimator ``grpo.py::_create_advantage_estimator`` builds from the rendered
    ``grpo``/``loss_fn`` sections, applied as grpo_train applies it (right-padded prompt ids,
    token mask), then clipped by ``_clip_grpo_advantages``."""
    from nemo_rl.algorithms.grpo import _clip_grpo_advantages, _create_advantage_estimator

    out = []
    for case in payload["cases"]:
        config = types.SimpleNamespace(grpo=case["grpo"], loss_fn=case.get("loss_fn", {}))
        estimator = _create_advantage_estimator(config)
        mask = torch.ones(case["rewards"].shape[0], 3)
        adv = estimator.compute_advantage(
            prompt_ids=case["prompt_ids"], rewards=case["rewards"].clone(), mask=mask, repeated_batch={}
        )
        out.append(_clip_grpo_advantages(adv, case["grpo"])[:, 0].clone())
    return out


PROBES = {"advantages": advantages}


def main() -> None:
    probe, src, dst = sys.argv[1:4]
    result = PROBES[probe](torch.load(src, weights_only=False))
    torch.save(result, dst)


if __name__ == "__main__":
    main()
