"""Chat-formatted, seeded sampling from an HF causal LM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from alignpipe.artifacts import MANIFEST
from alignpipe.data.schema import Message, as_conversation

# A prompt: a prepared row's conversation (messages ending with a user turn) or one user turn's text.
Prompt = str | list[Message]


def with_system(messages: list[dict[str, str]], system: str | None) -> list[dict[str, str]]:
    """``messages`` after the stage's system turn (its ``data.default.system_prompt_file``), unless
    there is none or the conversation has its own; without one the chat template adds its default."""
    if not system or (messages and messages[0]["role"] == "system"):
        return list(messages)
    return [{"role": "system", "content": system}, *messages]


def prompt_messages(prompt: Prompt, system: str | None = None) -> list[dict[str, str]]:
    """A prompt (a prepared row's conversation, or a string: one user turn) as chat messages,
    after the stage's system turn unless the conversation has its own."""
    return with_system(as_conversation(prompt), system)


def model_system_prompt(model_dir: Path | str) -> str | None:
    """The system prompt a published model was trained with (its artifact.json ``system_prompt``):
    measure it the way it was prompted."""
    manifest = Path(model_dir) / MANIFEST
    if not manifest.is_file():
        return None
    return json.loads(manifest.read_text()).get("system_prompt")


def generate(
    model,
    tokenizer,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    batch_size: int = 128,
    seed: int = 0,
    system: str | None = None,
) -> list[str]:
    """Seeded sampling (greedy when temperature is 0) of one completion per prompt."""
    import torch

    tokenizer.padding_side = "left"
    model.eval()
    outputs: list[str] = []
    for chunk in seeded_batches(prompts, batch_size, seed):
        texts = [
            tokenizer.apply_chat_template(
                prompt_messages(p, system), tokenize=False, add_generation_prompt=True
            )
            for p in chunk
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=top_p if temperature > 0 else None,
                top_k=0 if temperature > 0 else None,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        new = out[:, enc["input_ids"].shape[1] :]
        outputs.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return outputs


def seeded_batches(items: list, batch_size: int, seed: int):
    """``items`` in batches of ``batch_size``, torch's global RNG seeded before each from a
    generator of ``seed``'s own, so a batch's samples do not depend on what ran before."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        yield chunk


def chat_token_ids(tokenizer, prompts: list[Prompt], system: str | None = None) -> list[list[int]]:
    """The prompts as ``generate`` feeds them: chat template with the generation prompt, and no
    special tokens added on top (the template has its own)."""
    texts = [
        tokenizer.apply_chat_template(prompt_messages(p, system), tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def generate_vllm(
    model_dir: Path | str,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    seed: int = 0,
    system: str | None = None,
    engine: dict[str, Any] | None = None,
) -> list[str]:
    """``generate``'s sampling on vLLM (GPU profiles, inside the NeMo-RL image, which has it):
    the same prompt tokens, temperature, top-p, no top-k and token budget, one seeded request
    per prompt (seeds drawn from ``seed``); greedy when temperature is 0. The draws differ from
    transformers' (another RNG), so samples are keyed by the backend too
    (``heldout.sampling_key``)."""
    import gc
    import random

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = chat_token_ids(tokenizer, prompts, system)
    llm = LLM(model=str(model_dir), seed=seed, **{k: v for k, v in (engine or {}).items() if v is not None})
    rng = random.Random(seed)
    greedy = temperature <= 0
    params = [
        SamplingParams(
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            top_k=-1,
            max_tokens=max_new_tokens,
            seed=rng.randrange(2**31),
            skip_special_tokens=True,
        )
        for _ in prompts
    ]
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    del llm  # frees the GPU for the next policy's engine, or the KL and RM models
    gc.collect()
    return [o.outputs[0].text for o in outputs]
