"""Chat-formatted, seeded sampling from an HF causal LM."""

from __future__ import annotations


def user_turn(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def generate(
    model,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    batch_size: int = 128,
    seed: int = 0,
) -> list[str]:
    """Seeded sampling (greedy when temperature is 0) of one completion per prompt."""
    import torch

    tokenizer.padding_side = "left"
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    outputs: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        texts = [
            tokenizer.apply_chat_template(user_turn(p), tokenize=False, add_generation_prompt=True)
            for p in chunk
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        # Seed per batch from our own generator so results do not depend on what ran before.
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
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
