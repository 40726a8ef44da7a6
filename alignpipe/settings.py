"""The ``alignpipe:`` section of a stage profile, typed: the settings NeMo-RL does not know.

One frozen dataclass per concern, every field with its one default and a line of help (as TRL's
trainer configs); a profile sets only what differs from these. ``from_config`` reads the section
of a resolved stage config: an unknown key at any depth is refused with the closest known one,
a value of the wrong type with the type expected (an integer passes for a number), each naming
the file that set it. ``config.resolve_stage_config`` calls it, so ``alignpipe plan`` and
``alignpipe run`` refuse on every engine before anything runs; stages read
``StageContext.settings``. docs/SETTINGS.md lists every field (``python -m alignpipe.settings``
writes it).
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from types import NoneType, UnionType
from typing import Any, TypeVar

from alignpipe.errors import ConfigError

# A location for errors: the profile file, or a function of the dotted key naming the file that set it.
Where = str | Callable[[str], str]
T = TypeVar("T")


def setting(default: Any, help: str, choices: tuple[str, ...] = ()) -> Any:
    """A field with its one default (``[]``: a fresh empty list each time) and its help line."""
    metadata = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, help: str) -> Any:
    """A nested section of settings, each with its own default."""
    return field(default_factory=cls, metadata={"help": help})


class InvalidSetting(ValueError):
    """A rule between values (a section's ``__post_init__``): the field it concerns, and what is wrong."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} {problem}")
        self.name, self.problem = name, problem


def _bounds(name: str, value: list[float | None] | None) -> None:
    if value is None:
        return
    if len(value) != 2:
        raise InvalidSetting(name, f"must be [lo, hi] (either may be null), got {value!r}")
    lo, hi = value
    if lo is not None and hi is not None and lo > hi:
        raise InvalidSetting(name, f"has its lower bound {lo} above the upper {hi}")


# --------------------------------------------------------------------------- held-out sampling


@dataclass(frozen=True)
class HeldoutVllm:
    """``vllm.LLM`` arguments for held-out sampling on vLLM; null leaves vLLM's own default."""

    dtype: str | None = setting(None, "weights' dtype in vLLM (bfloat16 on the GPU profiles)")
    tensor_parallel_size: int | None = setting(None, "GPUs one engine spans")
    gpu_memory_utilization: float | None = setting(None, "share of GPU memory vLLM may take")
    max_model_len: int | None = setting(None, "longest prompt + completion, in tokens")
    enforce_eager: bool | None = setting(None, "no CUDA graphs (slower, starts faster)")


@dataclass(frozen=True)
class Heldout:
    """Held-out verifier accuracy: the sampling every policy stage and evaluate share
    (``alignpipe.measure.heldout``). Samples are keyed by these, so keep them equal across stages."""

    enabled: bool = setting(
        False, "nemo_rl engine: measure the published policy after training (local: always)"
    )
    backend: str = setting(
        "hf",
        "what samples a published model: transformers here, or vLLM in the image (another RNG)",
        ("hf", "vllm"),
    )
    data_path: str = setting("data/prepared/rlvr/test.jsonl", "held-out prompts (repo-relative JSONL)")
    limit: int | None = setting(None, "first N prompts only; null: all")
    max_new_tokens: int = setting(16, "token budget of each sampled answer")
    temperature: float = setting(1.0, "sampling temperature (0: greedy)")
    top_p: float = setting(1.0, "nucleus sampling threshold")
    batch_size: int = setting(128, "prompts per generate() call (hf); batching moves the RNG stream")
    seed: int = setting(1234, "sampling seed")
    max_tool_turns: int = setting(
        4, "prompts offering tools (a row's tools): assistant turns per answer at most (hf only)"
    )
    vllm: HeldoutVllm = section(HeldoutVllm, "backend vllm: the engine's arguments")


# --------------------------------------------------------------------------- rewards (rlvr, rlhf)


@dataclass(frozen=True)
class RewardShaping:
    """Shaping on top of the verifier's 0/1 (``alignpipe.rl.shaping``); every option off by default:
    ``r - format_penalty * bad_format - length_penalty * max(0, length - target_length)``, then clip."""

    format_penalty: float = setting(
        0.0, "subtracted for an empty answer or one with a character outside allowed_chars"
    )
    allowed_chars: str | None = setting(
        None, "regex character class body; null: anything but control characters and U+FFFD"
    )
    length_penalty: float = setting(0.0, "subtracted per unit of length beyond target_length")
    target_length: int | None = setting(None, "length without penalty (needed when length_penalty > 0)")
    length_unit: str = setting("chars", "what length counts", ("chars", "tokens"))
    clip: list[float | None] | None = setting(None, "[lo, hi]: clamp the shaped reward (either may be null)")

    def __post_init__(self) -> None:
        if self.length_penalty and self.target_length is None:
            raise InvalidSetting("length_penalty", "needs target_length")
        for name in ("format_penalty", "length_penalty"):
            if getattr(self, name) < 0:
                raise InvalidSetting(name, "is a magnitude and must be >= 0")
        _bounds("clip", self.clip)
        if self.allowed_chars is not None:
            try:  # compiled as shaping compiles it: a bad class fails here, not mid-training
                re.compile(f"[^{self.allowed_chars}]")
            except re.error as e:
                raise InvalidSetting(
                    "allowed_chars", f"{self.allowed_chars!r} is not a character class: {e}"
                ) from None


@dataclass(frozen=True)
class Judge:
    """``reward_source: judge``: a causal LM grades or compares answers (``engines/local/judge.py``)."""

    model_name: str = setting("models/sft", "the judge: a repo path or a cached Hugging Face id")
    mode: str = setting(
        "score", "grade each answer, or compare it with its group's first", ("score", "pairwise")
    )
    template: str | None = setting(None, "prompt template; null: the built-in one for the mode")
    score_max: float = setting(10.0, "score mode: the top grade; reward = grade / score_max")
    max_new_tokens: int = setting(4, "token budget of a verdict (greedy)")
    batch_size: int = setting(64, "judge prompts per generate() call")
    unparseable: float | None = setting(None, "reward of an unparseable verdict; null: unknown (advantage 0)")

    def __post_init__(self) -> None:
        if self.score_max <= 0:
            raise InvalidSetting("score_max", "must be > 0")
        needed = (
            ("{prompt}", "{response}")
            if self.mode == "score"
            else ("{prompt}", "{response_a}", "{response_b}")
        )
        missing = [p for p in needed if self.template is not None and p not in self.template]
        if missing:
            raise InvalidSetting("template", f"for mode {self.mode!r} lacks {', '.join(missing)}")


@dataclass(frozen=True)
class RewardHacking:
    accuracy_drop: float = setting(
        0.02,
        "reward hacking is flagged when the RM score rises while held-out accuracy falls by more than "
        "this (default 0.02), by rlhf's warning and evaluate's flag alike",
    )


@dataclass(frozen=True)
class NemoGym:
    default_agent_ref: str = setting(
        "responses_api_agents/simple_agent", "Gym agent every converted row goes to ('<type>/<name>')"
    )


@dataclass(frozen=True)
class ToolSandbox:
    """Resource limits of a sandboxed tool call (``alignpipe.rewards.sandbox``); null: the sandbox's own."""

    memory_mb: int | None = setting(None, "address space of the call's process, in MiB")
    nproc: int | None = setting(None, "processes of the sandbox's uid")
    fsize_mb: int | None = setting(None, "largest file the call may write, in MiB")
    nofile: int | None = setting(None, "open files")


@dataclass(frozen=True)
class Tools:
    """Agentic rlvr: tools the policy calls mid-rollout (``alignpipe.tools``); off while ``tools`` is empty.
    Each assistant turn's ``<tool_call>`` blocks are run and their results appended, until a turn
    without a call (scored by the row's verifier) or ``max_rollout_turns``."""

    tools: list[str | dict[str, Any]] = setting(
        [],
        "builtins by name (calculator, python) or {name, function: 'module:function', description, "
        "parameters, sandbox, timeout_s} (alignpipe/tools/toolset.py); empty: no tools",
    )
    max_rollout_turns: int = setting(
        4, "assistant turns per rollout at most; the last one's calls are not run"
    )
    malformed_penalty: float = setting(
        0.0, "subtracted from a rollout's reward per <tool_call> block that could not be read"
    )
    timeout_s: float = setting(10.0, "wall-clock limit of a call, unless its tool sets its own")
    max_output_chars: int = setting(4096, "an observation longer than this is cut, with a marker")
    sandbox: ToolSandbox = section(ToolSandbox, "limits of sandboxed calls (python, user tools)")

    def __post_init__(self) -> None:
        if self.max_rollout_turns < 1:
            raise InvalidSetting("max_rollout_turns", "must be >= 1")
        if self.malformed_penalty < 0:
            raise InvalidSetting("malformed_penalty", "is a magnitude and must be >= 0")

    @property
    def enabled(self) -> bool:
        return bool(self.tools)

    def toolset_config(self) -> dict[str, Any]:
        """The config ``alignpipe.tools.build_toolset`` reads (its module docstring)."""
        limits = {k: v for k, v in vars(self.sandbox).items() if v is not None}
        return {
            "tools": [t if isinstance(t, str) else dict(t) for t in self.tools],
            "timeout_s": self.timeout_s,
            "max_output_chars": self.max_output_chars,
            **({"sandbox": limits} if limits else {}),
        }


# --------------------------------------------------------------------------- convert


@dataclass(frozen=True)
class ExportGeneration:
    """Overrides written into the export's ``generation_config.json``; null keeps the model's own."""

    do_sample: bool | None = setting(None, "sample instead of greedy decoding")
    max_new_tokens: int | None = setting(None, "token budget of model.generate()")
    temperature: float | None = setting(None, "sampling temperature")
    top_k: int | None = setting(None, "top-k sampling (0: off)")
    top_p: float | None = setting(None, "nucleus sampling threshold")


@dataclass(frozen=True)
class ExportVerify:
    """The export is reloaded offline and checked against its source before it is published."""

    data_path: str = setting("data/prepared/rlvr/test.jsonl", "prompts of the check (repo-relative JSONL)")
    prompts: int = setting(8, "first N prompts")
    max_new_tokens: int = setting(12, "greedy tokens generated by the export and the source")
    logits_atol: float = setting(
        1e-4, "largest absolute logit difference to the source allowed (no dtype cast)"
    )
    merged_logits_atol: float = setting(
        1e-3, "the same for a merged LoRA chain (merging reorders float32 sums)"
    )


@dataclass(frozen=True)
class Export:
    dtype: str | None = setting(
        None, "cast of the exported weights; null keeps the checkpoint's", ("float32", "bfloat16", "float16")
    )
    adapter: bool = setting(True, "a LoRA source: also export the adapter alone (adapter/)")
    generation: ExportGeneration = section(ExportGeneration, "the export's sampling defaults")
    verify: ExportVerify = section(ExportVerify, "the check before publishing")


@dataclass(frozen=True)
class Converter:
    hf_model_name: str | None = setting(None, "NeMo-RL checkpoints: --hf-model-name for NeMo-RL's converter")


# --------------------------------------------------------------------------- benchmark, evaluate


@dataclass(frozen=True)
class BenchmarkVllm:
    """lm-eval's ``VLLM`` arguments (``backend: vllm``); null leaves lm-eval's own default."""

    dtype: str | None = setting(None, "weights' dtype in vLLM")
    tensor_parallel_size: int | None = setting(None, "GPUs one engine spans")
    data_parallel_size: int | None = setting(None, "engines side by side")
    gpu_memory_utilization: float | None = setting(None, "share of GPU memory vLLM may take")
    max_model_len: int | None = setting(None, "longest prompt + completion, in tokens")
    max_gen_toks: int | None = setting(None, "lm-eval's generation budget")


@dataclass(frozen=True)
class Benchmark:
    """lm-evaluation-harness on each policy (``alignpipe.measure.benchmarks``)."""

    lm_eval_version: str | None = setting(None, "required: the installed lm-eval must be this version")
    backend: str = setting(
        "hf", "lm-eval's transformers backend here, or its vLLM one in the image", ("hf", "vllm")
    )
    batch_size: int = setting(32, "lm-eval batch size (hf; vLLM batches itself)")
    download: bool = setting(False, "let lm-eval's builtin tasks fetch their data from the Hugging Face Hub")
    fail_on_regression: bool = setting(False, "a benchmark regression fails evaluate")
    tasks: list[str | dict[str, Any]] = setting(
        [],
        "required: {name, file, limit, num_fewshot, apply_chat_template, fewshot_as_multiturn, gen_kwargs, max_drop}",
    )
    vllm: BenchmarkVllm = section(BenchmarkVllm, "backend vllm: lm-eval's VLLM arguments")


@dataclass(frozen=True)
class EvaluatedPolicy:
    name: str = field(metadata={"help": "its row in the table"})
    path: str = field(metadata={"help": "its directory (repo-relative)"})


@dataclass(frozen=True)
class Evaluate:
    policies: list[EvaluatedPolicy] = setting(
        [], "required: the compared policies, {name, path}, in table order"
    )
    reference: str = setting("sft", "the policy KL, differences and flags are measured against")
    reward_model: str | None = setting(None, "scores every sample (rm_score); null: no such column")
    benchmarks: str | None = setting(None, "the benchmark stage's results; null: no benchmark columns")


# --------------------------------------------------------------------------- the section


@dataclass(frozen=True)
class AlignpipeSettings:
    """The whole section; ``StageContext.settings`` of every stage."""

    torch_threads: int | None = setting(
        None, "torch's intra-op CPU threads; fixed on CPU profiles so bytes match"
    )
    heldout: Heldout = section(Heldout, "held-out sampling, shared by every policy stage and evaluate")
    import_checkpoint: str | None = setting(None, "sft: publish this HF checkpoint instead of training")
    zero_reward_batches: int = setting(
        0, "rlvr/rlhf: fail when the first N rollout batches all score 0; 0: off"
    )
    reward_shaping: RewardShaping = section(RewardShaping, "rlvr: shaping on top of the verifier")
    reward_source: str = setting("rm", "rlhf: what rewards the rollouts", ("rm", "judge"))
    reward_clip: list[float | None] | None = setting(None, "rlhf: [lo, hi] clamp of the RM score; null: none")
    judge: Judge = section(Judge, "rlhf: the generative judge")
    reward_hacking: RewardHacking = section(RewardHacking, "rlhf and evaluate: the reward-hacking flag")
    tools: Tools = section(Tools, "rlvr: tools the policy calls in multi-turn rollouts")
    nemo_gym: NemoGym = section(NemoGym, "nemo_gym profile: Gym's data conversion")
    export: Export = section(Export, "convert: what is exported and how it is checked")
    converter: Converter = section(Converter, "convert: NeMo-RL's checkpoint converter")
    benchmark: Benchmark = section(Benchmark, "benchmark: lm-evaluation-harness")
    evaluate: Evaluate = section(Evaluate, "evaluate: what is compared")

    def __post_init__(self) -> None:
        _bounds("reward_clip", self.reward_clip)


# --------------------------------------------------------------------------- reading


def from_config(cfg: Mapping[str, Any], where: Where) -> AlignpipeSettings:
    """The typed ``alignpipe:`` section of a resolved stage config (every default when absent)."""
    return parse(AlignpipeSettings, cfg.get("alignpipe"), where, "alignpipe")


def parse(cls: type[T], raw: Any, where: Where, key: str) -> T:
    """``raw`` (a mapping; None: every default) as the dataclass ``cls``, its settings under ``key``."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise _error(where, key, f"must be a mapping of settings, found {_found(raw)}")
    known = {f.name: f for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in raw.items():
        dotted = f"{key}.{name}"
        if name not in known:
            close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
            hint = f"Did you mean '{key}.{close[0]}'? " if close else ""
            raise _error(where, dotted, f"is not a setting. {hint}Known under '{key}': {', '.join(known)}")
        values[name] = _typed(hints[name], value, where, dotted)
        choices = known[name].metadata.get("choices")
        if choices and values[name] is not None and values[name] not in choices:
            allowed = [*choices, *(["null"] if NoneType in _options(hints[name]) else [])]
            raise _error(where, dotted, f"is {value!r}; expected one of {', '.join(allowed)}")
    missing = [name for name, f in known.items() if name not in values and _required(f)]
    if missing:
        raise _error(where, key, f"lacks {', '.join(missing)}")
    try:
        return cls(**values)
    except InvalidSetting as e:
        raise _error(where, f"{key}.{e.name}", e.problem) from None


def _required(f: Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _typed(hint: Any, value: Any, where: Where, key: str) -> Any:
    """``value`` as the field type ``hint``: a float from an integer, a section parsed, list items checked."""
    for option in _options(hint):
        if not _fits(option, value):
            continue
        if is_dataclass(option):
            return parse(option, value, where, key)
        if option is float:
            return float(value)
        if typing.get_origin(option) is list:
            (item,) = typing.get_args(option)
            return [_typed(item, v, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return value
    raise _error(where, key, f"must be {' or '.join(map(_kind, _options(hint)))}, found {_found(value)}")


def _options(hint: Any) -> tuple[Any, ...]:
    """The alternatives of a union type (``int | None``), else the type alone."""
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, UnionType) else (hint,)


def _fits(hint: Any, value: Any) -> bool:
    """Whether ``value`` is of the outer type ``hint``: an int is a float, a bool is no int, a null
    section is every default."""
    if is_dataclass(hint):
        return isinstance(value, Mapping) or value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(hint) or hint)


KINDS = {NoneType: "null", bool: "true or false", int: "an integer", float: "a number", str: "a string",
         list: "a list", dict: "a mapping"}  # fmt: skip


def _kind(hint: Any) -> str:
    return "a mapping of settings" if is_dataclass(hint) else KINDS[typing.get_origin(hint) or hint]


def _found(value: Any) -> str:
    if value is None:
        return "null"
    kind = "a boolean" if isinstance(value, bool) else KINDS.get(type(value), type(value).__name__)
    return f"{value!r} ({kind})"


def _error(where: Where, key: str, problem: str) -> ConfigError:
    place = where(key) if callable(where) else where
    return ConfigError(f"{place}: '{key}' {problem}")


# --------------------------------------------------------------------------- the reference


def reference_rows(cls: type = AlignpipeSettings, key: str = "alignpipe") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) of every setting, depth first, in field order."""
    rows = []
    for f in fields(cls):
        dotted = f"{key}.{f.name}"
        if f.default_factory is not MISSING and is_dataclass(f.default_factory):
            rows.append((dotted, "", f.metadata["help"]))
            rows += reference_rows(f.default_factory, dotted)
        else:
            default = f.default_factory() if f.default is MISSING else f.default
            choices = f" (one of {', '.join(f.metadata['choices'])})" if f.metadata.get("choices") else ""
            rows.append((dotted, _yaml(default), f.metadata["help"] + choices))
    return rows


def _yaml(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def reference_markdown() -> str:
    """docs/SETTINGS.md: every ``alignpipe:`` setting, its default and its meaning."""
    lines = [
        "# `alignpipe:` settings",
        "",
        "The `alignpipe:` section of `stages/<stage>/config/<profile>.yaml`: what NeMo-RL does not know",
        "(the nemo_rl engine drops the section before rendering). Every setting has the one default below;",
        "a profile sets only what differs, and `params.yaml` may change a key the profile sets",
        "(`dvc exp run -S evaluate.alignpipe.heldout.seed=7`). An unknown key or a value of the wrong type",
        "is refused by `alignpipe plan` and `alignpipe run`, naming the file. Generated from",
        "`alignpipe/settings.py` by `python -m alignpipe.settings > docs/SETTINGS.md`; each stage's README",
        "says which sections it reads.",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    lines += [f"| `{key}` | {default} | {help} |" for key, default, help in reference_rows()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
