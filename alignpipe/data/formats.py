"""NeMo-RL record formats -> prepared rows, with checks that name the source's own keys.

Formats (``format:``) and the families they can feed (``family:``); each matches what a
NeMo-RL v0.7.0 dataset class reads:

* ``binary_preference`` (BinaryPreferenceDataset: ``prompt_key``/``chosen_key``/``rejected_key``) -> preference
* ``preference`` (PreferenceDataset: ``context`` messages + exactly two ``completions`` with ``rank``) -> preference
* ``ultrafeedback`` (``chosen``/``rejected`` conversations sharing their prompt turns, optional
  ``prompt``; the shape Tulu3PreferenceDataset reads, e.g. HuggingFaceH4/ultrafeedback_binarized) -> preference
* ``helpsteer3`` (HelpSteer3Dataset: ``context``, ``response1``/``response2``,
  ``overall_preference`` in -3..3; < 0 prefers response1, > 0 response2, 0 is a tie and dropped) -> preference
* ``response`` (ResponseDataset: ``input_key``/``output_key``, default ``input``/``output``) -> sft, rlvr, rlhf
* ``messages`` (OpenAI ``messages``) -> sft, rlvr, rlhf

``answer_format: gsm8k`` keeps only the final answer after GSM8K's ``#### `` marker (as
NeMo-RL's GSM8KDataset does with ``extract_answer``).
"""

from __future__ import annotations

from typing import Any

from alignpipe.data.schema import VERIFIERS
from alignpipe.errors import DataError

FORMATS: dict[str, tuple[str, ...]] = {
    "binary_preference": ("preference",),
    "preference": ("preference",),
    "ultrafeedback": ("preference",),
    "helpsteer3": ("preference",),
    "response": ("sft", "rlvr", "rlhf"),
    "messages": ("sft", "rlvr", "rlhf"),
}
ANSWER_FORMATS = ("text", "gsm8k")
ROLES = ("system", "user", "assistant", "tool")
GSM8K_MARKER = "####"


class SourceRecord:
    """One record of a source, with field checks that name the source's own key in errors."""

    def __init__(self, where: str, line: int, rec: Any):
        self.where, self.line, self.rec = where, line, rec
        if not isinstance(rec, dict):
            raise DataError(
                where,
                line,
                None,
                f"expected a JSON object, found {type(rec).__name__}",
                "one object per record",
            )

    def fail(self, field: str | None, problem: str, fix: str = "") -> DataError:
        return DataError(self.where, self.line, field, problem, fix)

    def get(self, key: str, required: bool = True) -> Any:
        if key not in self.rec or self.rec[key] is None:
            if not required:
                return None
            have = ", ".join(sorted(map(str, self.rec))) or "none"
            raise self.fail(
                key, f"is missing (record has: {have})", f"add '{key}', or set the source's key option"
            )
        return self.rec[key]

    def text(self, key: str, value: Any = None, role: str = "assistant") -> str:
        """A non-empty string; a message list is accepted when it is a single turn of ``role``."""
        value = self.get(key) if value is None else value
        if isinstance(value, list):
            msgs = self.messages(key, value)
            if len(msgs) != 1 or msgs[0]["role"] != role:
                fix = "flatten multi-turn conversations to one turn"
                if role == "assistant" and msgs[-1]["role"] == "assistant":
                    fix = "for conversations that end with the reply (UltraFeedback, Tulu 3), use format: ultrafeedback"
                raise self.fail(
                    key, f"must be a string or a single '{role}' message, found {len(msgs)} message(s)", fix
                )
            value = msgs[0]["content"]
        if not isinstance(value, str):
            raise self.fail(
                key, f"must be a string, found {type(value).__name__}", "store text as a JSON string"
            )
        if not value.strip():
            raise self.fail(key, "is empty", "drop the record or fill the field")
        return value

    def messages(self, key: str, value: Any = None) -> list[dict[str, str]]:
        value = self.get(key) if value is None else value
        if not isinstance(value, list) or not value:
            raise self.fail(
                key, "must be a non-empty list of {role, content} messages", "use OpenAI chat format"
            )
        out = []
        for j, m in enumerate(value):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise self.fail(
                    f"{key}[{j}]",
                    "must be an object with string 'role' and 'content'",
                    "use OpenAI chat format",
                )
            if m["role"] not in ROLES:
                raise self.fail(
                    f"{key}[{j}].role", f"unknown role '{m['role']}'", f"use one of {', '.join(ROLES)}"
                )
            if not m["content"].strip():
                raise self.fail(f"{key}[{j}].content", "is empty", "drop the message or fill it")
            out.append({"role": m["role"], "content": m["content"]})
        return out

    def prompt_from(self, key: str, msgs: list[dict[str, str]]) -> str:
        if len(msgs) != 1 or msgs[0]["role"] != "user":
            raise self.fail(
                key,
                f"the prompt must be a single user turn for this family, found {len(msgs)} message(s)",
                "use a string prompt or one user message (on_invalid: skip drops multi-turn records)",
            )
        return msgs[0]["content"]

    def context_prompt(self, key: str) -> str:
        """A string prompt, or a context of messages that is one user turn."""
        ctx = self.get(key)
        return (
            self.text(key, role="user") if isinstance(ctx, str) else self.prompt_from(key, self.messages(key))
        )


def _task(r: SourceRecord, src: dict[str, Any], default: str) -> str:
    key = src.get("task_key", "task")
    value = r.rec.get(key)
    if value is None:
        return str(src.get("task") or default)
    if not isinstance(value, str) or not value.strip():
        raise r.fail(key, "must be a non-empty string", "name the task (e.g. 'sort') or drop the field")
    return value


def final_answer(r: SourceRecord, src: dict[str, Any], answer: str, field: str) -> str:
    """The gold answer under the source's ``answer_format`` (``gsm8k``: the text after ``#### ``)."""
    if src.get("answer_format", "text") != "gsm8k":
        return answer
    if GSM8K_MARKER not in answer:
        raise r.fail(
            field,
            f"has no '{GSM8K_MARKER} <answer>' line (answer_format: gsm8k), found {answer[-60:]!r}",
            "end the solution with '#### <final answer>', or drop answer_format",
        )
    final = answer.rsplit(GSM8K_MARKER, 1)[1].strip()
    if not final:
        raise r.fail(field, f"is empty after '{GSM8K_MARKER}'", "write the final answer after '#### '")
    return final


def _tests(r: SourceRecord, src: dict[str, Any], verifier: str) -> list[str] | None:
    tkey = src.get("tests_key", "tests")
    tests = r.rec.get(tkey)
    if verifier != "code" and tests is None:
        return None
    if tests is None:
        raise r.fail(
            tkey, "is missing: verifier 'code' needs tests", f"add '{tkey}': a list of Python assert strings"
        )
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise r.fail(tkey, "must be a non-empty list of non-empty strings (Python asserts)", "fix the tests")
    return tests


def _rl_fields(
    r: SourceRecord, src: dict[str, Any], prompt: str, answer: str, answer_field: str
) -> dict[str, Any]:
    vkey = src.get("verifier_key", "verifier")
    verifier = r.rec.get(vkey, src.get("verifier"))
    if verifier is None:
        raise r.fail(
            vkey,
            "is missing: RLVR/RLHF rows need a verifier",
            f"add '{vkey}' ({'/'.join(VERIFIERS)}) to each row, or set `verifier:` on the source",
        )
    if verifier not in VERIFIERS:
        raise r.fail(vkey, f"unknown verifier {verifier!r}", f"use one of {', '.join(VERIFIERS)}")
    answer = final_answer(r, src, answer, answer_field)
    # _answer_field names the field in a later error (the math gold check); readers drop it.
    row: dict[str, Any] = {
        "prompt": prompt,
        "answer": answer,
        "verifier": verifier,
        "_answer_field": answer_field,
    }
    if verifier == "numeric":
        from alignpipe.rewards.verifiers import parse_number

        if parse_number(answer) is None:
            fix = "fix it or use verifier exact"
            if GSM8K_MARKER in answer:
                fix = "for GSM8K worked solutions ending '#### <answer>', set answer_format: gsm8k on the source"
            raise r.fail(answer_field, f"answer {answer[:80]!r} is not a number (verifier numeric)", fix)
    tests = _tests(r, src, verifier)
    if tests is not None:
        row["tests"] = tests
    return row


def _binary_preference(src: dict[str, Any], r: SourceRecord) -> dict[str, str]:
    pk, ck, rk = (
        src.get("prompt_key", "prompt"),
        src.get("chosen_key", "chosen"),
        src.get("rejected_key", "rejected"),
    )
    prompt = r.text(pk, role="user")
    return {"prompt": prompt, **_pair(r, rk, r.text(ck), r.text(rk))}


def _pair(r: SourceRecord, field: str, chosen: str, rejected: str) -> dict[str, str]:
    if chosen == rejected:
        raise r.fail(field, "is identical to the chosen response", "drop the pair: it carries no preference")
    return {"chosen": chosen, "rejected": rejected}


def _ranked_preference(src: dict[str, Any], r: SourceRecord) -> dict[str, str]:
    xk, ck = src.get("context_key", "context"), src.get("completions_key", "completions")
    prompt = r.context_prompt(xk)
    comps = r.get(ck)
    if not isinstance(comps, list) or len(comps) != 2:
        n = len(comps) if isinstance(comps, list) else type(comps).__name__
        raise r.fail(
            ck, f"must hold exactly two completions, found {n}", "keep one preferred and one rejected"
        )
    ranked = []
    for j, c in enumerate(comps):
        if not isinstance(c, dict) or "completion" not in c:
            raise r.fail(
                f"{ck}[{j}]",
                "must be an object with 'rank' and 'completion'",
                "see NeMo-RL PreferenceDataset",
            )
        rank = c.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int | float):
            raise r.fail(f"{ck}[{j}].rank", f"must be a number, found {rank!r}", "lower rank = preferred")
        ranked.append((rank, r.text(f"{ck}[{j}].completion", c["completion"])))
    if ranked[0][0] == ranked[1][0]:
        raise r.fail(
            f"{ck}[1].rank",
            f"ties rank {ranked[0][0]} of completions[0]",
            "give the preferred one the lower rank",
        )
    (_, chosen), (_, rejected) = sorted(ranked, key=lambda t: t[0])
    return {"prompt": prompt, **_pair(r, ck, chosen, rejected)}


def _ultrafeedback(src: dict[str, Any], r: SourceRecord) -> dict[str, str]:
    pk, ck, rk = (
        src.get("prompt_key", "prompt"),
        src.get("chosen_key", "chosen"),
        src.get("rejected_key", "rejected"),
    )
    convs = {}
    for key in (ck, rk):
        msgs = r.messages(key)
        if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
            raise r.fail(
                key,
                f"must be a conversation that ends with the assistant's reply, found {len(msgs)} message(s)",
                "store [prompt turns..., {role: assistant, content: reply}]",
            )
        convs[key] = msgs
    if convs[rk][:-1] != convs[ck][:-1]:
        raise r.fail(
            rk,
            f"has other turns before the reply than '{ck}'",
            "both conversations must share the prompt turns (NeMo-RL's Tulu3PreferenceDataset asserts the same)",
        )
    prompt = r.prompt_from(ck, convs[ck][:-1])
    if r.get(pk, required=False) is not None and r.text(pk, role="user").strip() != prompt.strip():
        raise r.fail(pk, f"differs from the user turn of '{ck}'", f"drop '{pk}' or make it match")
    return {"prompt": prompt, **_pair(r, rk, convs[ck][-1]["content"], convs[rk][-1]["content"])}


def _helpsteer3(src: dict[str, Any], r: SourceRecord) -> dict[str, str] | None:
    """HelpSteer3's ``overall_preference``: -3..-1 prefer response1, 1..3 response2, 0 = tie (None)."""
    xk, pk = src.get("context_key", "context"), src.get("preference_key", "overall_preference")
    k1, k2 = src.get("response1_key", "response1"), src.get("response2_key", "response2")
    prompt = r.context_prompt(xk)
    one, two = r.text(k1), r.text(k2)
    pref = r.get(pk)
    if isinstance(pref, float) and pref.is_integer():
        pref = int(pref)
    if isinstance(pref, bool) or not isinstance(pref, int) or not -3 <= pref <= 3:
        raise r.fail(
            pk,
            f"must be an integer in -3..3, found {pref!r}",
            "HelpSteer3: negative prefers response1, positive response2, 0 is a tie",
        )
    if pref == 0:
        return None
    chosen, rejected = (one, two) if pref < 0 else (two, one)
    return {"prompt": prompt, **_pair(r, k2 if pref < 0 else k1, chosen, rejected)}


PREFERENCE_READERS = {
    "binary_preference": _binary_preference,
    "preference": _ranked_preference,
    "ultrafeedback": _ultrafeedback,
    "helpsteer3": _helpsteer3,
}


def convert(
    fmt: str, family: str, src: dict[str, Any], r: SourceRecord, default_task: str
) -> dict[str, Any] | None:
    """One source record -> one prepared row (without id) of ``family``; None for a dropped tie."""
    task = _task(r, src, default_task)
    if fmt in PREFERENCE_READERS:
        pair = PREFERENCE_READERS[fmt](src, r)
        return None if pair is None else {"task": task, **pair}

    # response / messages -> sft, rlvr, rlhf
    if fmt == "messages" or (fmt == "response" and src.get("messages_key", "messages") in r.rec):
        mk = src.get("messages_key", "messages")
        msgs = r.messages(mk)
        if msgs[-1]["role"] != "assistant" or not any(m["role"] == "user" for m in msgs):
            raise r.fail(
                mk, "must contain a user turn and end with an assistant turn", "append the assistant reply"
            )
        answer_field = f"{mk}[{len(msgs) - 1}].content"
        if family == "sft":
            last = {"role": "assistant", "content": final_answer(r, src, msgs[-1]["content"], answer_field)}
            return {"task": task, "messages": [*msgs[:-1], last]}
        prompt, answer = r.prompt_from(mk, msgs[:-1]), msgs[-1]["content"]
    else:
        ik, ok = src.get("input_key", "input"), src.get("output_key", "output")
        prompt, answer = r.text(ik), r.text(ok)
        answer_field = ok
        if family == "sft":
            answer = final_answer(r, src, answer, answer_field)
            return {
                "task": task,
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
            }
    return {"task": task, **_rl_fields(r, src, prompt, answer, answer_field)}


def math_gold_error(where: str, line: int, field: str, answer: str) -> DataError:
    """The error for a gold answer math-verify cannot parse (so every reward would be 0)."""
    fix = "keep only the final answer in the field (e.g. '72', '\\frac{1}{2}', 'x^2+1')"
    if GSM8K_MARKER in answer:
        fix = "for GSM8K worked solutions ending '#### <answer>', set answer_format: gsm8k on the source"
    shown = answer if len(answer) <= 80 else answer[:40] + " ... " + answer[-30:]
    return DataError(
        where,
        line,
        field,
        f"gold answer {shown!r} is not an expression math-verify can parse (verifier math: every reward would be 0)",
        fix,
    )
