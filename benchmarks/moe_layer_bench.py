"""Time the MoE layer of a preset (forward + backward, bf16) against the reference loop.

    python benchmarks/moe_layer_bench.py --preset small

Reports the layer's time, the expert GEMMs' share and TFLOP/s against the 8192^3 matmul rate
measured in the same process. The reference is GroupedExperts with `grouped_mm_reference`, the
python loop over experts (it reads offsets on the host, as a naive implementation would).
"""

from __future__ import annotations

import argparse

import torch

from moetrain.bench.timing import matmul_tflops, summarize, time_steps
from moetrain.moe.experts import grouped_mm_reference
from moetrain.moe.layer import MoELayer
from moetrain.presets import get_preset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    config = get_preset(args.preset)
    device = torch.device("cuda")
    D, t = config.model.d_model, config.train
    T = t.micro_batch_size * t.seq_len
    moe = config.moe
    mm = matmul_tflops(device)
    # expert GEMM FLOPs per step: 3 products (gate/up fused counts 2) x fwd+bwd (x3)
    expert_flops = 6 * T * moe.top_k * 3 * D * moe.expert_hidden
    print(
        f"{args.preset}: T={T} D={D} E={moe.num_experts} k={moe.top_k} F={moe.expert_hidden}; "
        f"measured matmul {mm:.0f} TFLOP/s"
    )
    x = torch.randn(t.micro_batch_size, t.seq_len, D, device=device, dtype=torch.bfloat16)
    for name, gemm in (("grouped_mm", None), ("reference loop", grouped_mm_reference)):
        layer = MoELayer(moe, D).to(device)
        torch.nn.init.normal_(layer.router.gate.weight, std=0.02)
        torch.nn.init.normal_(layer.experts.w_up_eD2F, std=0.02)
        torch.nn.init.normal_(layer.experts.w_down_eFD, std=0.02)
        layer = layer.to(torch.bfloat16)
        if gemm is not None:
            layer.experts.gemm = gemm
        xi = x.clone().requires_grad_()
        grad = torch.randn_like(x)

        def step(layer=layer, xi=xi, grad=grad):
            layer(xi).backward(grad)

        stats = summarize(time_steps(step, warmup=3, steps=10, device=device))
        ms = stats["median_ms"]
        print(
            f"  {name:15s} fwd+bwd {ms:7.2f} ms  (expert GEMM FLOPs at {expert_flops / ms / 1e9:.0f} "
            f"TFLOP/s over the whole layer time = {100 * expert_flops / ms / 1e9 / mm:.0f}% of matmul)"
        )


if __name__ == "__main__":
    main()
