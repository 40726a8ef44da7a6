"""Builtin tiny tasks: algorithmic prompts with verifiable answers, deterministic from a seed.

Shapes (for the tiny Llama, whose tokenizer reads a digit or a word as one token; prompts are the raw user turn):

* ``sort:52813``   -> ``12358``  (digits ascending), verifier ``exact``
* ``reverse:5281`` -> ``1825``, verifier ``exact``
* ``add:37+48``    -> ``85``, verifier ``numeric``
* ``chat``: a conversation -- a system turn, a solved exchange, then the question -- whose
  answer is the last question's (``[system: Digits only., user: sort:528,
  assistant: 258, user: reverse:9134]`` -> ``4319``), so every stage trains, samples and
  scores conversations

``style: boxed`` (the ``small`` profile: a real instruct model) asks the same tasks in words
and answers in ``\\boxed{}``, read by the verifiers with ``extract: boxed`` as NeMo-RL's math
environment and NeMo-Gym read answers:

* ``Sort the digits of 52813 in ascending order. Put the final answer in \\boxed{}.`` -> ``\\boxed{12358}``

One prompt pool is generated from the seed (unique prompts, each bucketed into
train/validation/test by :class:`alignpipe.data.split.SplitSpec`), and every family draws its
rows per split from that pool, so a held-out prompt never appears in any family's train split.
"""

from __future__ import annotations

import json
import random
from typing import Any

from alignpipe.data.schema import FAMILIES, SPLITS, as_conversation, user_text
from alignpipe.data.split import SplitSpec, normalize_prompt
from alignpipe.errors import ConfigError
from alignpipe.tools.calculator import CALCULATOR_SCHEMA

# Tools a builtin row may offer (builtin.tools), by name.
BUILTIN_TOOL_SCHEMAS = {"calculator": CALCULATOR_SCHEMA}

TASKS = ("sort", "reverse", "add")  # what a builtin source without ``tasks`` draws
VERIFIER = {"sort": "exact", "reverse": "exact", "add": "numeric", "calc": "numeric"}
DEFAULT_TASKS: dict[str, dict[str, int]] = {
    "sort": {"min_digits": 3, "max_digits": 6, "weight": 1},
    "reverse": {"min_digits": 3, "max_digits": 6, "weight": 1},
    "add": {"min_digits": 1, "max_digits": 3, "weight": 1},
    "chat": {"min_digits": 3, "max_digits": 5, "weight": 1},
    # calc:4821+3597 -> 8418, solved with the calculator tool (needs builtin.tools: [calculator]):
    # the sft row calls it, reads its result and answers.
    "calc": {"min_digits": 3, "max_digits": 4, "weight": 1},
}
# chat: the system turn, and the tasks its earlier exchange and its question are drawn from.
CHAT_SYSTEM = {"plain": "Digits only.", "boxed": "Answer briefly."}
CHAT_TASKS = ("sort", "reverse")
DIGITS = "0123456789"
# A builtin prompt: ``sort:528``, or for ``chat`` (earlier question, question).
Question = str | tuple[str, str]
STYLES = ("plain", "boxed")
# style: boxed. The instruction follows Gym's own math prompts ("... in \\boxed{}").
WORDED = {
    "sort": "Sort the digits of {arg} in ascending order.",
    "reverse": "Write the digits of {arg} in reverse order.",
    "add": "What is {a} + {b}?",
    "calc": "What is {a} + {b}? Use the calculator.",
}
BOX_INSTRUCTION = " Put the final answer in \\boxed{}."


def worded(prompt: str) -> str:
    """A plain builtin prompt (``sort:52813``) asked in words, with the box instruction."""
    task, _, arg = prompt.partition(":")
    a, _, b = arg.partition("+")
    return WORDED[task].format(arg=arg, a=a, b=b) + BOX_INSTRUCTION


def boxed(answer: str) -> str:
    return f"\\boxed{{{answer}}}"


def solve(prompt: str) -> str:
    """The correct answer of a builtin prompt (``sort:..``, ``reverse:..``, ``add:a+b``)."""
    task, _, arg = prompt.partition(":")
    if task == "sort":
        return "".join(sorted(arg))
    if task == "reverse":
        return arg[::-1]
    if task in ("add", "calc"):
        a, _, b = arg.partition("+")
        return str(int(a) + int(b))
    raise ValueError(f"not a builtin task prompt: {prompt!r}")


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def make_instance(task: str, spec: dict[str, int], rng: random.Random) -> tuple[Question, str]:
    """A prompt and its answer; a ``chat`` prompt is (earlier question, question): the answer
    is the question's."""
    lo, hi = int(spec["min_digits"]), int(spec["max_digits"])
    if task == "chat":
        earlier, _ = make_instance(rng.choice(CHAT_TASKS), {**spec, "max_digits": lo}, rng)
        question, answer = make_instance(rng.choice(CHAT_TASKS), spec, rng)
        return (earlier, question), answer
    if task in ("sort", "reverse"):
        s = "".join(rng.choice(DIGITS) for _ in range(rng.randint(lo, hi)))
        prompt = f"{task}:{s}"
    elif task in ("add", "calc"):
        prompt = f"{task}:{_operand(rng, rng.randint(lo, hi))}+{_operand(rng, rng.randint(lo, hi))}"
    else:
        raise ConfigError(f"prep config: unknown builtin task '{task}'; known: {', '.join(DEFAULT_TASKS)}")
    return prompt, solve(prompt)


def corrupt(answer: str, rng: random.Random, numeric: bool = False) -> str:
    """A plausible wrong answer: wrong order, one wrong digit, or one digit dropped/duplicated.

    Always differs from ``answer``; its length is the same or off by one; numeric answers get
    no leading zero (so they also differ as numbers).
    """
    for _ in range(1000):
        kind = rng.choice(("order", "digit", "length"))
        if kind == "order":
            swaps = [i for i in range(len(answer) - 1) if answer[i] != answer[i + 1]]
            if not swaps:
                continue
            i = rng.choice(swaps)
            cand = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
        elif kind == "digit":
            i = rng.randrange(len(answer))
            pool = [
                d
                for d in DIGITS
                if d != answer[i] and not (numeric and i == 0 and len(answer) > 1 and d == "0")
            ]
            cand = answer[:i] + rng.choice(pool) + answer[i + 1 :]
        else:
            i = rng.randrange(len(answer))
            if len(answer) > 1 and rng.random() < 0.5:
                cand = answer[:i] + answer[i + 1 :]
            else:
                cand = answer[:i] + answer[i] + answer[i:]
        if cand != answer and not (numeric and len(cand) > 1 and cand[0] == "0"):
            return cand
    raise RuntimeError(f"could not corrupt answer {answer!r}")  # unreachable for digit strings


def degenerate(answer: str, prompt: str, rng: random.Random) -> str:
    """An off-distribution wrong answer a policy can drift to under RL: a run of one digit, or
    the prompt's own digits echoed back.

    A reward model that only ever saw near misses scores such outputs arbitrarily (often
    high), and GRPO finds them; showing some to the reward model as ``rejected`` closes
    that hole. Never equal to ``answer``.
    """
    echo = "".join(ch for ch in prompt.split(":", 1)[-1] if ch.isdigit())
    for _ in range(1000):
        if rng.random() < 0.5 and echo and echo != answer:
            return echo
        length = max(1, len(answer) + rng.choice((-1, 0, 0, 1)))
        cand = rng.choice(DIGITS[1:]) * length
        if cand != answer:
            return cand
    raise RuntimeError(f"could not build a degenerate answer for {answer!r}")  # unreachable


def builtin_spec(src: dict[str, Any], defaults: dict[str, Any] | None) -> dict[str, Any]:
    """The builtin source settings: the config's top-level ``builtin:`` section, then inline keys."""
    spec: dict[str, Any] = dict(defaults or {})
    spec.update({k: v for k, v in src.items() if k != "kind"})
    tasks_cfg = spec.get("tasks") or {t: {} for t in TASKS}
    if isinstance(tasks_cfg, list):
        tasks_cfg = {t: {} for t in tasks_cfg}
    tasks: dict[str, dict[str, int]] = {}
    for name, t in tasks_cfg.items():
        if name not in DEFAULT_TASKS:
            raise ConfigError(
                f"prep config: unknown builtin task '{name}'; known: {', '.join(DEFAULT_TASKS)}"
            )
        merged = {**DEFAULT_TASKS[name], **(t or {})}
        if not 1 <= int(merged["min_digits"]) <= int(merged["max_digits"]):
            raise ConfigError(
                f"prep config: builtin task '{name}' needs 1 <= min_digits <= max_digits, got {merged}"
            )
        if float(merged["weight"]) < 0:
            raise ConfigError(f"prep config: builtin task '{name}' has a negative weight")
        if float(merged["weight"]) > 0:
            tasks[name] = merged
    if not tasks:
        raise ConfigError("prep config: the builtin source has no task with a positive weight")
    counts_cfg = spec.get("counts") or {}
    counts: dict[str, dict[str, int]] = {}
    for fam, per_split in counts_cfg.items():
        if fam not in FAMILIES:
            raise ConfigError(
                f"prep config: builtin.counts has unknown family '{fam}'; known: {', '.join(FAMILIES)}"
            )
        if not isinstance(per_split, dict):
            raise ConfigError(
                f"prep config: builtin.counts.{fam} must map train/validation/test to row counts"
            )
        for split in per_split:
            if split not in SPLITS:
                raise ConfigError(
                    f"prep config: builtin.counts.{fam}.{split}: unknown split; known: {', '.join(SPLITS)}"
                )
        counts[fam] = {s: int(per_split.get(s, 0) or 0) for s in SPLITS}
    fraction = float(spec.get("degenerate_negatives", 0.0) or 0.0)
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"prep config: builtin.degenerate_negatives must be in [0, 1], got {fraction}")
    style = spec.get("style", "plain")
    if style not in STYLES:
        raise ConfigError(f"prep config: builtin.style '{style}' is not one of {', '.join(STYLES)}")
    tools = list(spec.get("tools") or [])
    unknown = sorted(set(tools) - set(BUILTIN_TOOL_SCHEMAS))
    if unknown:
        raise ConfigError(
            f"prep config: builtin.tools names {unknown[0]!r}; the builtin rows can offer {', '.join(BUILTIN_TOOL_SCHEMAS)}"
        )
    if "calc" in tasks and "calculator" not in tools:
        raise ConfigError(
            "prep config: the builtin task 'calc' is solved with the calculator: set builtin.tools: [calculator]"
        )
    out = {"seed": int(spec.get("seed", 0)), "tasks": tasks, "counts": counts, "degenerate_negatives": fraction,
           "style": style}  # fmt: skip
    return {**out, "tools": tools} if tools else out  # absent when off: the manifest stays as it was


def _pool(spec: dict[str, Any], split: SplitSpec) -> dict[str, list[tuple[str, Question, str]]]:
    need = {s: max((c[s] for c in spec["counts"].values()), default=0) for s in SPLITS}
    for s, n in need.items():
        if n > 0 and split.fraction(s) <= 0:
            raise ConfigError(
                f"prep config: builtin.counts asks for {n} '{s}' rows but split.{s}_fraction is 0; "
                f"raise the fraction or set the count to 0"
            )
    rng = random.Random(f"alignpipe-builtin-pool:{spec['seed']}")
    names = list(spec["tasks"])
    weights = [float(spec["tasks"][t]["weight"]) for t in names]
    pool: dict[str, list[tuple[str, Question, str]]] = {s: [] for s in SPLITS}
    seen: set[str] = set()
    misses = 0
    while any(len(pool[s]) < need[s] for s in SPLITS):
        task = rng.choices(names, weights)[0]
        prompt, answer = make_instance(task, spec["tasks"][task], rng)
        style = spec.get("style", "plain")
        shown = user_text(conversation(task, prompt, style))  # what prep splits by
        key = normalize_prompt(shown)
        if key in seen:
            misses += 1
            if misses > 200_000:
                raise ConfigError(
                    "prep config: the builtin tasks ran out of distinct prompts for the requested counts; "
                    "raise max_digits or lower builtin.counts"
                )
            continue
        seen.add(key)
        pool[split.assign(shown)].append((task, prompt, answer))
    return pool


def generate(spec: dict[str, Any], split: SplitSpec) -> dict[str, list[dict[str, Any]]]:
    """Rows per family (without ids); ``spec`` comes from :func:`builtin_spec`."""
    pool = _pool(spec, split)
    out: dict[str, list[dict[str, Any]]] = {f: [] for f in FAMILIES}
    for fam in FAMILIES:
        counts = spec["counts"].get(fam)
        if not counts:
            continue
        rng = random.Random(f"alignpipe-builtin-{fam}:{spec['seed']}")
        for s in SPLITS:
            for task, plain_prompt, answer in rng.sample(pool[s], counts[s]):
                row = family_row(fam, task, plain_prompt, answer, spec, rng)
                out[fam].append(row)
    return out


def conversation(task: str, prompt: Question, style: str) -> str | list[dict[str, str]]:
    """What a row asks: the prompt's text, or for ``chat`` the conversation (system turn, the
    earlier exchange answered, the question), worded and boxed in ``boxed`` style."""
    ask = worded if style == "boxed" else str
    if task != "chat":
        return ask(prompt)
    earlier, question = prompt
    reply = boxed(solve(earlier)) if style == "boxed" else solve(earlier)
    return [
        {"role": "system", "content": CHAT_SYSTEM[style]},
        {"role": "user", "content": ask(earlier)},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": ask(question)},
    ]


def family_row(
    fam: str, task: str, prompt: Question, answer: str, spec: dict[str, Any], rng: random.Random
) -> dict:
    """One row of ``fam``; in ``boxed`` style the prompt is worded and answers are boxed."""
    wrap = boxed if spec.get("style") == "boxed" else str
    shown = conversation(task, prompt, spec.get("style", "plain"))
    question = prompt[1] if task == "chat" else prompt  # the turn the answer answers
    verifier = VERIFIER[question.partition(":")[0]]
    # builtin.tools: every sft and rl row offers them, so a policy learns when to call (calc) and
    # when not (the rest), and rolls out with the prompt it was taught on.
    offered = {"tools": [BUILTIN_TOOL_SCHEMAS[t] for t in spec["tools"]]} if spec.get("tools") else {}
    if fam == "sft":
        solved = [{"role": "assistant", "content": wrap(answer)}]
        if task == "calc":
            solved = [*calculator_turns(question.partition(":")[2], answer), *solved]
        return {"task": task, "messages": [*as_conversation(shown), *solved], **offered}
    if fam == "preference":
        # Draw only when enabled, so fraction 0 leaves the data byte-identical.
        fraction = spec.get("degenerate_negatives", 0.0)
        if fraction > 0 and rng.random() < fraction:
            rejected = degenerate(answer, question, rng)
        else:
            rejected = corrupt(answer, rng, numeric=verifier == "numeric")
        return {"task": task, "prompt": shown, "chosen": wrap(answer), "rejected": wrap(rejected)}
    row = {"task": task, "prompt": shown, "answer": answer, "verifier": verifier, **offered}
    if spec.get("style") == "boxed":
        row["extract"] = "boxed"
    return row


def calculator_turns(expression: str, value: str) -> list[dict[str, Any]]:
    """The assistant's call of the calculator on ``expression`` and the tool turn with its value."""
    call = {
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": value},
    ]
