"""What a local stage process imports: transformers' optional scikit-learn and SciPy imports
are skipped where no stage code uses them (each stage's start is ~2 s shorter), and kept for
benchmark, whose lm-eval metrics may need them."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from alignpipe.engines.local.stages import skip_unused_libraries
skip_unused_libraries({stage!r})
import torch
torch.manual_seed(0)
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).eval()
# min_new_tokens: a random model's greedy token may be its eos (id 2) and stop generation early.
out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, min_new_tokens=2, do_sample=False)
print(out.shape[1], sys.modules.get("sklearn") is not None, sys.modules.get("scipy") is not None)
{more}
"""


def probe(stage: str, more: str = "") -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(stage=stage, more=more)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_a_training_stage_generates_without_importing_scikit_learn_or_scipy() -> None:
    assert probe("sft") == ["5", "False", "False"]


def test_benchmark_keeps_scikit_learn_and_scipy_for_lm_evals_metrics() -> None:
    out = probe("benchmark", "from sklearn.metrics import f1_score; print(f1_score([0, 1], [0, 1]))")
    assert out[:2] == ["5", "True"] and out[-1] == "1.0"  # SciPy comes with scikit-learn
