"""The experts' FP8 weight gradient taken apart at a preset's shapes, against the BF16 one.

    python benchmarks/fp8_weight_grad.py [--presets olmoe8,small] [--tiles] [--json OUT.json]

Per projection (up: gw = x^T dh with x (N, D), dh (N, 2F); down: gw = a^T gy with a (N, F),
gy (N, D)), N = T K rows in uneven groups (a skewed multinomial draw, one expert empty): the
BF16 product (`torch._grouped_mm`) and the FP8 one's pieces (moe/fp8_weight_grad.py): the
per-(group, column) quantization of the bf16 operand times the other's row scales, the byte
transpose of the other's FP8 rows, the product on padded groups (precise and fast accumulation)
and the whole `grouped_weight_grad_fp8`. CUDA-graph replays, median ms. Errors: relative
Frobenius against fp32 math on the bf16 inputs. `--tiles` also times the two kernels' tiles.

Prediction (olmoe8 up, 131,072 x 2048 on each side): BF16 1.72 ms, the FP8 product 0.99 (fast
accumulation, session 13); the quantization reads its operand twice (the second time partly
from L2) and writes 1 byte (~0.2 ms), the byte transpose 1 + 1 bytes (~0.07 ms): ~1.3 ms.
"""

from __future__ import annotations

import argparse
import json

import torch
from fp8_training import graph_timed, rel

from moetrain.kernels import quant_groups_triton as kernels
from moetrain.kernels.quant import padded_group_offsets, padded_group_width
from moetrain.moe.fp8_gemm import _grouped_weight_grad
from moetrain.moe.fp8_weight_grad import group_operands, grouped_weight_grad_fp8, scaled_weight_grad
from moetrain.nn.fp8 import quantize_rows
from moetrain.presets import get_preset


def uneven_offsets(n: int, e: int, gen: torch.Generator) -> torch.Tensor:
    """Cumulative ends of n rows over e groups: multinomial with log-normal weights, group 1 empty."""
    weights = torch.exp(0.4 * torch.randn(e, generator=gen))
    weights[1] = 0
    groups = torch.multinomial(weights, n, replacement=True, generator=gen)
    return torch.bincount(groups, minlength=e).cumsum(0).to(torch.int32).cuda()


def fp32_weight_grad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out, start = [], 0
    for end in offs.tolist():
        out.append(a[start:end].float().T @ b[start:end].float())
        start = end
    return torch.stack(out)


def projection_rows(preset: str, name: str, a, b, offs, tiles: bool) -> list[dict]:
    b_q, b_s = quantize_rows(b)
    n, e = a.shape[0], offs.numel()
    pad, width = padded_group_offsets(offs), padded_group_width(n, e)
    operands = group_operands(a, b_q, b_s, offs)
    bf16 = torch.bfloat16

    def whole(fast: bool):
        return lambda: grouped_weight_grad_fp8(
            a, b_q, b_s, offs, bf16, emulate=False, use_fast_accum=fast
        )

    pieces = {
        "bf16 weight grad": lambda: _grouped_weight_grad(a, b, offs),
        "fp8: quantize a * s per (group, column)": lambda: kernels.quantize_group_columns_triton(
            a, offs, pad, width, b_s
        ),
        "fp8: transpose b's FP8 rows": lambda: kernels.transpose_group_rows_triton(
            b_q, offs, pad, width
        ),
        "fp8: padded offsets": lambda: padded_group_offsets(offs),
        "fp8: product, precise": lambda: scaled_weight_grad(*operands, bf16, False, False),
        "fp8: product, fast": lambda: scaled_weight_grad(*operands, bf16, False, True),
        "fp8 weight grad, precise": whole(False),
        "fp8 weight grad, fast": whole(True),
    }
    if tiles:
        for tile in [
            (64, 64, 4),
            (32, 64, 4),
            (128, 64, 4),
            (64, 32, 4),
            (64, 128, 8),
            (64, 64, 8),
        ]:
            pieces[f"quantize tile {tile}"] = lambda tile=tile: tiled(
                "QUANT_TILE", tile, kernels.quantize_group_columns_triton, a, offs, pad, width, b_s
            )
        for tile in [(64, 128, 4), (32, 128, 4), (128, 128, 8), (64, 64, 4), (64, 256, 8)]:
            pieces[f"transpose tile {tile}"] = lambda tile=tile: tiled(
                "BYTES_TILE", tile, kernels.transpose_group_rows_triton, b_q, offs, pad, width
            )
    rows = []
    print(f"  {preset} {name}: {n} rows, {e} groups, ({a.shape[1]}, {b.shape[1]}) per group")
    for piece, fn in pieces.items():
        ms = graph_timed(fn)
        rows.append({"preset": preset, "projection": name, "piece": piece, "ms": ms})
        print(f"    {piece:<44} {ms:7.3f} ms", flush=True)
    want = fp32_weight_grad(a, b, offs)
    errs = {
        "bf16": rel(_grouped_weight_grad(a, b, offs), want),
        "fp8 precise": rel(whole(False)(), want),
        "fp8 fast": rel(whole(True)(), want),
    }
    rows.append({"preset": preset, "projection": name, "piece": "errors", **errs})
    print("    error against fp32 math: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    return rows


def tiled(attr: str, tile, fn, *args):
    old = getattr(kernels, attr)
    setattr(kernels, attr, tile)
    try:
        return fn(*args)
    finally:
        setattr(kernels, attr, old)


def preset_rows(preset: str, tiles: bool) -> list[dict]:
    config = get_preset(preset)
    t, m, moe = config.train, config.model, config.moe
    n = t.micro_batch_size * t.seq_len * moe.top_k
    gen = torch.Generator().manual_seed(0)
    offs = uneven_offsets(n, moe.num_experts, gen)
    f = moe.expert_hidden

    def rows_of(width: int) -> torch.Tensor:
        return torch.randn(n, width, generator=gen).to(device="cuda", dtype=torch.bfloat16)

    x, dh = rows_of(m.d_model), rows_of(2 * f) * 1e-3
    rows = projection_rows(preset, "up", x, dh, offs, tiles)
    a, gy = rows_of(f), rows_of(m.d_model) * 1e-3
    return rows + projection_rows(preset, "down", a, gy, offs, tiles)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default="olmoe8,small")
    p.add_argument("--tiles", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": []}
    for preset in args.presets.split(","):
        results["rows"] += preset_rows(preset, args.tiles)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
