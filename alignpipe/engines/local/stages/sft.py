"""Stage ``sft`` on the local engine: TRL's SFTTrainer warm start (or import of an HF checkpoint).

Loss is on the assistant turns, tokenised as NeMo-RL's ``sft_processor`` tokenises them
(``alignpipe.tokenise``: the assistant header is trained, BOS/EOS per
``data.add_bos``/``add_eos``, a conversation too long for ``data.max_input_seq_length`` kept
at weight 0); TRL gets the token ids and completion mask ready-made. The policy is left
deliberately short of perfect on held-out prompts (few steps): alignment stages need
room to show gains, and ``heldout/accuracy`` records where SFT leaves off.
"""

from __future__ import annotations

from alignpipe import console
from alignpipe.context import StageContext
from alignpipe.engines.local import live_log, lora
from alignpipe.engines.local.checkpoints import publish_trained, scheduled, train_resumable
from alignpipe.engines.local.micro_batches import length_sorted
from alignpipe.engines.local.nemo_rl_keys import SftDataKeys, sft_keys, stage_keys
from alignpipe.engines.local.torch_threads import apply_torch_threads
from alignpipe.engines.local.trl_args import refuse_gpu_only_settings, trl_common_args
from alignpipe.errors import DataError, UnsupportedSetting
from alignpipe.jsonl import read_jsonl
from alignpipe.measure.generation import with_system
from alignpipe.measure.heldout import headline, log_heldout, sample_heldout, samples_file
from alignpipe.measure.logprobs import LOCAL_DTYPE
from alignpipe.measure.metrics import local_keys
from alignpipe.tokenise import sft_example, unrendered_tool_names

# trainer log key -> pipeline metric name (same names on the NeMo-RL engine)
METRICS = local_keys("sft")  # TRL log key -> pipeline metric (measure/metrics.py)


def resolve_model_path(ctx: StageContext, name: str) -> str:
    """A path relative to the repo if it exists there, else an HF id from the local cache."""
    candidate = ctx.root / name
    return str(candidate) if candidate.exists() else name


def sft_examples(
    tokenizer, rows: list[dict], data: SftDataKeys, system: str | None = None, where: str = ""
) -> list[dict]:
    """Prepared sft rows (OpenAI ``messages``, optional ``tools``) -> TRL's tokenised SFT rows
    (``input_ids``, ``completion_mask``), with NeMo-RL's ``data.add_bos``/``add_eos``/
    ``add_generation_prompt`` and ``max_input_seq_length``, after the stage's system turn
    (``system``) unless a row has its own. A tool-calling row whose calls the chat template
    cannot render is refused, naming the template (``where``: the data file, for the error)."""
    out = []
    for line, row in enumerate(rows, 1):
        turns, tools = with_system(row["messages"], system), row.get("tools")
        missing = unrendered_tool_names(tokenizer, turns, tools)
        if missing:
            raise DataError(
                where or "sft data",
                line,
                "messages",
                f"a tool-calling conversation, but the chat template of {tokenizer.name_or_path} does not "
                f"render tools or tool calls ({', '.join(repr(n) for n in missing)} missing from the rendered text)",
                "use a model whose chat template takes `tools` (e.g. Qwen2.5, Llama 3.1 instruct), give the "
                "model directory a chat_template.jinja that does (for a ChatML model such as SmolLM2: "
                "benchmarks/smollm2_tools.jinja), or leave tool-calling sources out of sft",
            )
        out.append(
            sft_example(
                tokenizer,
                turns,
                max_length=data.max_input_seq_length,
                add_bos=data.add_bos,
                add_eos=data.add_eos,
                add_generation_prompt=data.add_generation_prompt,
                tools=tools,
            )
        )
    return out


def run(ctx: StageContext) -> None:
    refuse_gpu_only_settings(ctx)  # before the imports below: a refused setting fails in a second
    keys, sft = stage_keys(ctx), sft_keys(ctx)
    adapter = lora.lora_settings(ctx)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    apply_torch_threads(ctx)
    model_path = resolve_model_path(ctx, keys.policy.model_name)
    tokenizer_path = resolve_model_path(ctx, keys.policy.tokenizer_name)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    import_from = ctx.settings.import_checkpoint

    live = live_log.open_live(ctx)
    if import_from and adapter:
        raise UnsupportedSetting(
            f"stages/sft/config/{ctx.profile}.yaml: alignpipe.import_checkpoint publishes an existing "
            f"checkpoint, so there is no adapter to train; turn {lora.LORA_KEY}.enabled off"
        )
    if import_from:
        # Warm start from an existing HF checkpoint instead of training one.
        model = AutoModelForCausalLM.from_pretrained(
            resolve_model_path(ctx, import_from), local_files_only=True, dtype=LOCAL_DTYPE
        )
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(ctx, import_from), local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=LOCAL_DTYPE)
        peft = {"peft_config": lora.peft_config(model, adapter)} if adapter else {}

        def examples(path: str) -> Dataset:
            rows = read_jsonl(ctx.root / path)
            return Dataset.from_list(sft_examples(tokenizer, rows, sft.data, ctx.system_prompt, where=path))

        train = examples(keys.data.train_path)
        val_path = keys.data.validation_path
        val = examples(val_path) if val_path else None
        if val is not None and sft.val_batches:
            n = sft.val_batches * sft.val_global_batch_size
            val = val.select(range(min(n, len(val))))
        args = SFTConfig(
            **trl_common_args(ctx, ctx.scratch_dir),
            # sft_examples applied NeMo-RL's length rule; TRL's would also drop the weight-0 rows
            max_length=None,
            packing=False,
            completion_only_loss=True,
            eval_on_start=sft.val_at_start,
        )
        trainer = scheduled(ctx, length_sorted(SFTTrainer, lambda row: len(row["input_ids"])))(
            model=model,
            args=args,
            train_dataset=train,
            eval_dataset=val,
            processing_class=tokenizer,
            callbacks=[live_log.make_live_callback(live, METRICS)],
            **peft,
        )
        if adapter:
            lora.prepare(ctx, trainer.model, adapter, model_path, sft.seed)
        train_resumable(ctx, trainer, live, METRICS)
        if val is not None and sft.val_at_end:
            live_log.log_to_live(live, METRICS, trainer.evaluate(), trainer.state.global_step)
        model = trainer.model

    samples = sample_heldout(ctx, model, tokenizer)
    heldout = log_heldout(live, tokenizer, samples)
    publish_trained(ctx, "policy", model, tokenizer, live, files=samples_file(samples))
    console.outcome(
        "sft",
        {"heldout/accuracy": headline(heldout)},
        ctx.output("policy").relative_to(ctx.root),
        ctx.started,
    )
