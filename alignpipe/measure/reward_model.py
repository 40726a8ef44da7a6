"""Reward-model scoring of (prompt, answer) pairs and the reward-hacking rule, as the rlhf
stage and evaluate both apply them."""

from __future__ import annotations

from pathlib import Path

from alignpipe.measure.generation import Prompt, model_system_prompt, prompt_messages
from alignpipe.measure.intervals import above, below
from alignpipe.measure.logprobs import LOCAL_DTYPE
from alignpipe.tokenise import turn_token_ids


def conversation_token_ids(
    tokenizer, prompts: list[Prompt], completions: list[str], system: str | None = None
) -> list[list[int]]:
    """(prompt, completion) as the rm stage trains on it and NeMo-RL's reward-model environment
    scores it: system (if any), user and assistant turns, BOS and EOS as NeMo-RL adds them."""
    return [
        [
            t
            for turn in turn_token_ids(
                tokenizer, [*prompt_messages(p, system), {"role": "assistant", "content": c}]
            )
            for t in turn
        ]
        for p, c in zip(prompts, completions, strict=True)
    ]


class RewardModelScorer:
    """Scores (prompt, completion) pairs with a sequence-classification reward model."""

    def __init__(self, model, tokenizer, system: str | None = None, batch_size: int = 128) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.model.eval()
        if self.model.config.pad_token_id is None:
            # The head reads the last non-pad token; it must know which id is padding.
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        # The RM reads conversations as it was trained on them: after its stage's system turn.
        self.system = system
        self.batch_size = batch_size

    @classmethod
    def load(cls, path: str | Path, batch_size: int = 128) -> RewardModelScorer:
        """A published reward model, with the system prompt it was trained with."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, dtype=LOCAL_DTYPE
        )
        return cls(model, tokenizer, model_system_prompt(path), batch_size)

    def __call__(self, prompts: list[Prompt], completions: list[str]) -> list[float]:
        import torch

        sequences = conversation_token_ids(self.tokenizer, prompts, completions, self.system)
        pad = self.tokenizer.pad_token_id
        scores: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk], device=self.model.device)
            mask = torch.tensor(
                [[1] * len(s) + [0] * (width - len(s)) for s in chunk], device=self.model.device
            )
            with torch.no_grad():
                scores.extend(self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist())
        return scores


def hacking_suspected(
    rm_difference: dict[str, float], accuracy_difference: dict[str, float], accuracy_drop: float
) -> bool:
    """The reward model likes the policy more than SFT while the verifier likes it less: the
    paired difference of RM scores from SFT's is above zero, and that of held-out accuracy below
    ``-accuracy_drop``, each over its whole 95% interval (``alignpipe.measure.intervals``), so
    sampling noise on a few hundred prompts does not raise the flag."""
    return above(rm_difference) and below(accuracy_difference, accuracy_drop)
