"""Generative judge: a causal LM asked, with a prompt template, to grade or compare answers.

Settings: ``alignpipe.judge`` (``alignpipe.settings.Judge``). Two modes (``mode``):

* ``score``: the template shows one prompt and response and asks for a grade; the first
  number in the judge's reply, if within ``[0, score_max]``, gives the reward
  ``grade / score_max``.
* ``pairwise``: each completion is compared with its group's anchor (the group's first
  completion, GRPO groups are contiguous) in both orders, to cancel the judge's position
  bias; the verdict is the first standalone ``A`` or ``B`` in the reply. The reward is
  the candidate's win rate over the parseable verdicts (the anchor itself gets 0.5).
  Validation answers each prompt once, so there is no group: each answer is compared, the
  same way, with the SFT policy's answer to its prompt (``judge_against``), and the
  validation reward is the win rate against SFT (0.5: as good as SFT by the judge).

An unparseable verdict gives ``judge.unparseable`` (default ``None``: the reward is
unknown, the sample is left out of its group's baseline and gets advantage 0), and the
fraction of unparseable verdicts is logged as ``train/judge_parse_fail_fraction``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from alignpipe.settings import Judge

SCORE_TEMPLATE = (
    "Grade the answer to the task from 0 (wrong) to {score_max} (correct). Reply with the grade only.\n"
    "task:{prompt}\nanswer:{response}\ngrade:"
)
PAIRWISE_TEMPLATE = (
    "Which answer to the task is correct? Reply A or B.\n"
    "task:{prompt}\nA:{response_a}\nB:{response_b}\nverdict:"
)

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_VERDICT = re.compile(r"(?<![A-Za-z])([AB])(?![A-Za-z])")


def prompt_template(cfg: Judge) -> str:
    return cfg.template or (SCORE_TEMPLATE if cfg.mode == "score" else PAIRWISE_TEMPLATE)


def build_score_prompt(cfg: Judge, prompt: str, response: str) -> str:
    return prompt_template(cfg).format(prompt=prompt, response=response, score_max=_fmt(cfg.score_max))


def build_pairwise_prompt(cfg: Judge, prompt: str, response_a: str, response_b: str) -> str:
    return prompt_template(cfg).format(prompt=prompt, response_a=response_a, response_b=response_b)


def parse_score(reply: str, score_max: float) -> float | None:
    """The first number in ``reply`` scaled to [0, 1], or ``None`` if there is none or it is out of range."""
    m = _NUMBER.search(reply or "")
    if not m:
        return None
    value = float(m.group(0))
    if not 0.0 <= value <= score_max:
        return None
    return value / score_max


def parse_verdict(reply: str) -> str | None:
    """``"A"`` or ``"B"``: the first standalone A/B in ``reply``; ``None`` when there is none."""
    m = _VERDICT.search(reply or "")
    return m.group(1) if m else None


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


Generate = Callable[[list[str]], list[str]]


def judge_rewards(
    cfg: Judge, generate: Generate, prompts: list[str], responses: list[str], group_size: int
) -> tuple[list[float | None], float]:
    """Rewards for ``responses`` (groups of ``group_size`` contiguous), and the unparseable fraction.

    ``generate(judge_prompts) -> replies`` runs the judge (greedy); it is injected so the
    mechanics are testable with any callable.
    """
    if cfg.mode == "score":
        replies = generate([build_score_prompt(cfg, p, r) for p, r in zip(prompts, responses, strict=True)])
        parsed = [parse_score(x, cfg.score_max) for x in replies]
        fails = sum(v is None for v in parsed)
        rewards = [cfg.unparseable if v is None else v for v in parsed]
        return rewards, fails / max(1, len(parsed))

    if len(responses) % group_size:
        raise ValueError(f"{len(responses)} responses are not whole groups of {group_size}")
    # Each non-anchor completion against its group's anchor.
    pairs = [(i, i - i % group_size) for i in range(len(responses)) if i % group_size]
    won, fails = judge_against(
        cfg, generate, [prompts[c] for c, _ in pairs], [responses[c] for c, _ in pairs],
        [responses[a] for _, a in pairs],
    )  # fmt: skip
    rewards: list[float | None] = [0.5 if i % group_size == 0 else None for i in range(len(responses))]
    for (cand, _), reward in zip(pairs, won, strict=True):
        rewards[cand] = reward
    return rewards, fails


def judge_against(
    cfg: Judge, generate: Generate, prompts: list[str], candidates: list[str], anchors: list[str]
) -> tuple[list[float | None], float]:
    """Pairwise rewards of ``candidates`` against their ``anchors`` (a group's first completion;
    in validation, the SFT policy's answer to the same prompt), and the unparseable fraction.
    Each pair is judged in both orders, candidate first and then second, which cancels the
    judge's position bias; the reward is the candidate's share of the parseable verdicts it won,
    else ``cfg.unparseable``."""
    judge_prompts = []
    for prompt, cand, anchor in zip(prompts, candidates, anchors, strict=True):
        judge_prompts.append(build_pairwise_prompt(cfg, prompt, cand, anchor))
        judge_prompts.append(build_pairwise_prompt(cfg, prompt, anchor, cand))
    verdicts = [parse_verdict(x) for x in generate(judge_prompts)] if judge_prompts else []
    rewards: list[float | None] = []
    for first, second in zip(verdicts[::2], verdicts[1::2], strict=True):
        wins = [v == "A" for v in (first,) if v is not None] + [v == "B" for v in (second,) if v is not None]
        rewards.append(sum(wins) / len(wins) if wins else cfg.unparseable)
    return rewards, sum(v is None for v in verdicts) / max(1, len(verdicts))


def load_judge(cfg: Judge, resolve: Callable[[str], str]) -> Generate:
    """A greedy generator over the judge model (chat-formatted user turn, like every stage)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignpipe.measure.generation import generate
    from alignpipe.measure.logprobs import LOCAL_DTYPE

    path = resolve(cfg.model_name)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=LOCAL_DTYPE)
    model.eval()

    def run(prompts: list[str]) -> list[str]:
        return generate(
            model,
            tokenizer,
            prompts,
            max_new_tokens=cfg.max_new_tokens,
            temperature=0.0,
            batch_size=cfg.batch_size,
        )

    return run
