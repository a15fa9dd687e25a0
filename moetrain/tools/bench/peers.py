"""Peer systems built with the same configuration, timed by the same harness.

Hugging Face transformers' OlmoeForCausalLM: random init, bf16 parameters, SDPA attention,
fused AdamW with bf16 states, load-balancing loss through `output_router_logits`. transformers is
optional; `build_hf_olmoe` raises ValueError with the reason when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetrain.config import RunConfig


def build_hf_olmoe(
    config: RunConfig, device: torch.device, compile_model: bool = False
) -> tuple[Callable[[], torch.Tensor], torch.nn.Module]:
    try:
        from transformers import OlmoeConfig, OlmoeForCausalLM
    except ImportError as exc:
        raise ValueError(
            f"--compare hf needs transformers (pip install transformers): {exc}"
        ) from None
    m, moe, t = config.model, config.moe, config.train
    hf_config = OlmoeConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=moe.expert_hidden,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.kv_heads,
        max_position_embeddings=t.seq_len,
        rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_eps,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.renormalize,
        router_aux_loss_coef=moe.lb_loss_weight,
        output_router_logits=True,
        tie_word_embeddings=m.tie_embeddings,
        attn_implementation="sdpa",
    )
    model = OlmoeForCausalLM(hf_config).to(device=device, dtype=torch.bfloat16)
    model.train()
    if compile_model:
        model = torch.compile(model)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=1e-4,
        betas=(t.beta1, t.beta2),
        weight_decay=t.weight_decay,
        fused=device.type == "cuda",
    )
    generator = torch.Generator(device=device).manual_seed(t.seed)

    def step() -> torch.Tensor:
        ids = torch.randint(
            0, m.vocab_size, (t.micro_batch_size, t.seq_len), device=device, generator=generator
        )
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, model
