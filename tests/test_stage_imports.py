"""What a local stage process imports: transformers' optional scikit-learn and SciPy imports are
skipped (each stage's start is ~1 s shorter), while both stay importable for any code a stage runs
(lm-eval's metrics, a user's tool, a model's remote code)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from alignpipe.engines.local.stages import skip_transformers_optional_imports
skip_transformers_optional_imports()
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


def probe(more: str = "") -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(more=more)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_a_stage_generates_without_importing_scikit_learn_or_scipy() -> None:
    assert probe() == ["5", "False", "False"]


def test_scikit_learn_and_scipy_stay_importable_for_code_a_stage_runs() -> None:
    out = probe(
        "from sklearn.metrics import f1_score; from scipy.optimize import linear_sum_assignment; "
        "print(f1_score([0, 1], [0, 1]), linear_sum_assignment([[1, 0], [0, 1]])[1].tolist())"
    )
    assert out == ["5", "False", "False", "1.0", "[1,", "0]"]
