"""Sample text from a trained model (`moetrain generate`). Generation recomputes the whole prefix
at every token: fine for small models, not a serving engine.
"""

from __future__ import annotations

import torch

from moetrain.model.transformer import Transformer


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    eos_id: int | None = None,
    seed: int = 0,
) -> list[int]:
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt_ids], device=device)
    for _ in range(max_new_tokens):
        logits_V = model.logits(model(ids))[0, -1].float()
        if temperature <= 0:
            next_id = logits_V.argmax()
        else:
            logits_V = logits_V / temperature
            if top_k:
                kth = torch.topk(logits_V, min(top_k, logits_V.numel())).values[-1]
                logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
            next_id = torch.multinomial(logits_V.softmax(-1), 1, generator=generator)[0]
        if eos_id is not None and int(next_id) == eos_id:
            break
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids) :].tolist()
