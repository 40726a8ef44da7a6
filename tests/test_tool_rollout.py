"""Multi-turn tool rollouts (measure/tool_generation.py, GRPO's through engines/local/tool_rollout.py), with a real tiny
policy taught to call the calculator and the real toolset: the tokens a rollout produces are the
chat template's rendering of the conversation it had, the tool's tokens are masked out of the
loss, and bad calls, turn limits and budgets end as the environment says."""

from __future__ import annotations

import json

import pytest
import torch

from alignpipe import tiny
from alignpipe.measure.tool_generation import tool_rollouts
from alignpipe.tools import build_toolset

GREEDY = {"do_sample": False}
PROBLEMS = {"add 482 359": "482+359", "add 76 58": "76+58"}


def conversation(question: str, expression: str, answer: str, name: str = "calculator") -> list[dict]:
    call = {
        "type": "function",
        "function": {"name": name, "arguments": json.dumps({"expression": expression})},
    }
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": name, "content": answer},
        {"role": "assistant", "content": answer},
    ]


@pytest.fixture(scope="module")
def toolset():
    return build_toolset({"tools": ["calculator"], "timeout_s": 5})


def teach(conversations: list[list[dict]], toolset, steps: int = 150):
    """A tiny policy overfit on ``conversations``: it has learnt them by heart (the assistant
    turns only), so greedy decoding replays them."""
    schemas = toolset.schemas()
    texts = [str(m.get("content")) for c in conversations for m in c] + [json.dumps(schemas)]
    texts += [
        c["function"]["arguments"] for conv in conversations for m in conv for c in m.get("tool_calls") or []
    ]
    tokenizer = tiny.train_tokenizer(texts, "words", tools=True)
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
    model = tiny.build_causal_lm(tokenizer, cfg, seed=0)
    batch = [
        tokenizer.apply_chat_template(c, tools=schemas, return_assistant_tokens_mask=True, return_dict=True)
        for c in conversations
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        worst = 0.0
        for row in batch:
            ids = torch.tensor([row["input_ids"]])
            labels = ids.masked_fill(torch.tensor([row["assistant_masks"]]) == 0, -100)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            worst = max(worst, loss.item())
        if worst < 0.005:  # every assistant token memorised: greedy decoding replays it
            break
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def calculator_policy(toolset):
    convs = [conversation(q, e, str(eval(e))) for q, e in PROBLEMS.items()]  # noqa: S307 (test data)
    return teach(convs, toolset)


def prompts(tokenizer, toolset, questions) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            tools=toolset.schemas(),
            return_dict=False,
        )
        for q in questions
    ]


def test_a_rollout_is_the_conversation_the_chat_template_renders_with_tool_tokens_masked(
    calculator_policy, toolset
) -> None:
    model, tokenizer = calculator_policy
    rollouts, stats = tool_rollouts(
        model, tokenizer, prompts(tokenizer, toolset, PROBLEMS), toolset,
        max_turns=3, max_new_tokens=100, max_seq_len=128, sampling=GREEDY,
    )  # fmt: skip
    assert stats.calls == 2 and not stats.errors
    for (question, expression), r in zip(PROBLEMS.items(), rollouts, strict=True):
        answer = str(eval(expression))  # noqa: S307 (test data)
        assert (r.answer, r.turns, r.calls, r.malformed, r.done) == (answer, 2, 1, 0, True)
        whole = tokenizer.apply_chat_template(
            conversation(question, expression, answer), tools=toolset.schemas(), return_dict=False
        )
        assert r.prompt_ids + r.completion_ids == whole
        # The policy's tokens (mask 1): its call, then its answer; the tool's (mask 0): the result
        # and the next assistant header, exactly the observation text tokenised raw.
        tool_tokens = [t for t, m in zip(r.completion_ids, r.env_mask, strict=True) if not m]
        assert tokenizer.decode(tool_tokens) == f"{tiny.TOOL}{answer}{tiny.EOS}{tiny.ASSISTANT}"
        policy_text = tokenizer.decode([t for t, m in zip(r.completion_ids, r.env_mask, strict=True) if m])
        assert policy_text.startswith("<tool_call>") and policy_text.endswith(f"{answer}{tiny.EOS}")


def test_a_call_to_a_missing_tool_is_an_observation_and_the_rollout_goes_on(toolset) -> None:
    """The policy learnt to call `abacus`, which the toolset lacks: it reads the error as a tool
    turn and answers on its next turn; nothing raises."""
    conv = conversation("add 9 9", "9+9", "unknown tool", name="abacus")
    model, tokenizer = teach([conv], toolset, steps=120)
    [r], stats = tool_rollouts(
        model, tokenizer, prompts(tokenizer, toolset, ["add 9 9"]), toolset,
        max_turns=3, max_new_tokens=120, max_seq_len=128, sampling=GREEDY,
    )  # fmt: skip
    assert stats.errors == {"unknown_tool": 1} and r.calls == 1 and r.turns == 2 and r.done
    tool_text = tokenizer.decode([t for t, m in zip(r.completion_ids, r.env_mask, strict=True) if not m])
    assert "abacus" in tool_text and "calculator" in tool_text  # the error names what exists


def test_the_turn_limit_and_the_token_budget_end_a_rollout(calculator_policy, toolset) -> None:
    model, tokenizer = calculator_policy
    ids = prompts(tokenizer, toolset, ["add 482 359"])
    # One turn: the call is made but not run (the last turn's calls never are); no answer to score.
    [r], stats = tool_rollouts(
        model, tokenizer, ids, toolset, max_turns=1, max_new_tokens=100, max_seq_len=128, sampling=GREEDY
    )
    assert r.done and r.turns == 1 and r.calls == 1 and stats.calls == 0 and r.answer == ""
    assert all(r.env_mask)
    # A turn budget that cuts the call: an unclosed <tool_call> is a malformed call, answered
    # with an error the policy reads next turn (as NeMo-RL's environment sees a cut response).
    [r], stats = tool_rollouts(
        model, tokenizer, ids, toolset, max_turns=2, max_new_tokens=8, max_seq_len=128, sampling=GREEDY
    )
    assert r.turns == 2 and r.malformed >= 1 and stats.errors.get("malformed") == 1
    assert r.env_mask[:8] == [1] * 8 and 0 in r.env_mask
    # A sequence cap that the observation would reach: it is cut to fit and the rollout ends.
    cap = len(ids[0]) + 40
    [r], _ = tool_rollouts(
        model, tokenizer, ids, toolset, max_turns=3, max_new_tokens=100, max_seq_len=cap, sampling=GREEDY
    )
    assert r.done and r.answer is None and len(r.prompt_ids) + len(r.completion_ids) == cap


def test_a_grpo_step_with_tools_rewards_the_final_answer_and_trains_on_policy_tokens(
    calculator_policy, toolset, tmp_path
) -> None:
    """One GRPO step through TRL's GRPOTrainer with the tool rollout as its rollout_func: the
    reward reads each rollout's final answer, the tool metrics are logged, and the logged
    completion length counts the policy's tokens only (the tool's are masked out)."""
    import copy

    from datasets import Dataset
    from trl import GRPOConfig

    from alignpipe.engines.local import grpo
    from alignpipe.engines.local.tool_rollout import ToolRollouts

    model, tokenizer = calculator_policy
    seen: dict[str, list] = {}

    def exact(rows, texts, num_tokens, log_metric):
        seen.setdefault("texts", []).extend(texts)
        seen.setdefault("tokens", []).extend(num_tokens)
        return [float(t == r["answer"]) for r, t in zip(rows, texts, strict=True)]

    rows = [{"prompt": [{"role": "user", "content": q}], "answer": str(eval(e))} for q, e in PROBLEMS.items()]  # noqa: S307
    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, max_steps=1, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=100, temperature=0.7, beta=0.0, report_to=[],
        logging_steps=1, remove_unused_columns=False, seed=0, save_strategy="no",
    )  # fmt: skip
    trainer = grpo.make_trainer_class()(
        model=copy.deepcopy(model),
        reward_funcs=[grpo.RewardFn(exact, name="exact")],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        advantage_settings={"normalize_rewards": True, "leave_one_out_baseline": True, "clip": (None, None)},
        rollout_func=ToolRollouts(toolset, max_turns=3, max_seq_len=128).rollout_func(args),
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["tools/calls_per_answer"] > 0 and logged["tools/turns_per_rollout"] > 1
    assert set(seen["texts"]) <= {"841", "134", ""} and "841" in seen["texts"]  # answers, not transcripts
    # TRL counts completion length over env_mask = 1; every completion also holds tool tokens.
    assert logged["completions/mean_length"] < sum(seen["tokens"]) / len(seen["tokens"])


def test_a_template_that_rewrites_earlier_turns_is_refused(calculator_policy) -> None:
    """NeMo-RL and this engine append each observation's tokens to what came before: a template
    that renders earlier turns differently once more follow cannot be appended to."""
    from alignpipe.errors import ConfigError
    from alignpipe.tools.episode import observation_text

    _, tokenizer = calculator_policy
    shifting = copy_tokenizer(tokenizer)
    shifting.chat_template = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ConfigError, match="prefix-preserving"):
        observation_text(shifting, [{"role": "tool", "content": "841"}])
    assert (
        observation_text(tokenizer, [{"role": "tool", "content": "841"}])
        == f"{tiny.TOOL}841{tiny.EOS}{tiny.ASSISTANT}"
    )


def copy_tokenizer(tokenizer):
    import copy

    return copy.deepcopy(tokenizer)


def test_held_out_rows_that_offer_tools_are_answered_with_them(calculator_policy, tmp_path) -> None:
    """Held-out sampling (measure/heldout.py) rolls a row that offers the calculator out with
    it: the sample is the final answer, its tool use is published beside it and read back, and
    the accuracy comes with tool calls per answer and accuracy with and without a call."""
    from alignpipe.measure import heldout as H
    from alignpipe.settings import Heldout
    from alignpipe.tools.calculator import CALCULATOR_SCHEMA

    model, tokenizer = calculator_policy
    rows = [
        {"id": str(i), "task": "calc", "prompt": [{"role": "user", "content": q}], "answer": str(eval(e)),  # noqa: S307
         "verifier": "numeric", "tools": [CALCULATOR_SCHEMA]}
        for i, (q, e) in enumerate(PROBLEMS.items())
    ]  # fmt: skip
    settings = Heldout(max_new_tokens=100, temperature=0.0)
    completions, tool_use = H.heldout_completions(model, tokenizer, rows, settings)
    assert completions == ["841", "134"] and tool_use == [(1, 0), (1, 0)]
    result = H.heldout_accuracy(tokenizer, rows, completions, tool_use)
    assert result["accuracy"] == 1.0 and result["tool_calls_per_answer"] == 1.0
    assert result["tool_malformed_share"] == 0.0 and result["tool_accuracy_with_call"] == 1.0
    assert "tool_accuracy_without_call" not in result and "tool_accuracy_with_call" in result["intervals"]
    key = H.sampling_key(rows, settings)
    assert key != H.sampling_key([{k: v for k, v in r.items() if k != "tools"} for r in rows], settings)
    samples = H.HeldoutSamples(rows, completions, key, tool_use=tool_use)
    (tmp_path / H.SAMPLES_FILE).write_text(H.samples_file(samples)[H.SAMPLES_FILE])
    assert H.load_samples(tmp_path, key, len(rows)) == (completions, tool_use)
    plain = H.HeldoutSamples(rows, completions, key)  # without tools a line is what it was before
    assert "tool_calls" not in H.samples_file(plain)[H.SAMPLES_FILE]
