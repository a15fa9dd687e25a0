"""What an optimizer that writes the experts' FP8 weights would save: a measured prototype.

Today every FP8 step quantizes each expert weight twice from its bf16 copy (per output column,
transposed, for the forward; per row for the input gradient), after AdamW wrote that copy. The
lever measured here (not built into moetrain, see docs/design.md, "What bounds FP8 on Hopper"):
one AdamW kernel over 2-D tiles of each expert matrix that writes, in place of the bf16 copy, both
FP8 layouts, scaled by the previous step's amax (delayed scaling), and gathers this step's amax
per row and per column with atomics for the next. Same update math as `multi_tensor_adamw_`.

    python benchmarks/fp8_optimizer_weights.py            # H200 (any sm90 GPU): check, then time

Prints, per weight shape of olmoe8 (64 experts), the time of today's path (AdamW with fp32
masters writing bf16, then the two quantization kernels) and of the prototype at several tiles.
The check compares the prototype with the library's AdamW (masters and moments, within 1e-6 of
the largest element) and with a torch quantization by the same scales (FP8 bits, amax), on a small
random case first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from moetrain.kernels.adamw_triton import multi_tensor_adamw_
from moetrain.kernels.quant_triton import quantize_fp8_rowwise_triton

LR, WD, BETAS, EPS, STEP = 3e-4, 0.1, (0.9, 0.95), 1e-8, 10
FP8_MAX = 448.0


@triton.jit
def _e4m3(v):
    c = tl.minimum(tl.maximum(v, -448.0), 448.0)
    return c.to(tl.float8e4nv)


@triton.jit
def _adamw_fp8_kernel(
    g_ptr, w_ptr, m_ptr, v_ptr, q_rows_ptr, q_cols_ptr, inv_row_ptr, inv_col_ptr,
    amax_row_ptr, amax_col_ptr, D, F,
    step_size, bc2_sqrt, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
    BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_D, BLOCK_F) tile of expert e's (D, F) matrix: AdamW on the fp32 master, then
    q_rows (e, D, F) scaled per row, q_cols (e, F, D) scaled per column (stored transposed),
    and this step's |w| amax per row and column (int32 bits, atomic max)."""
    e = tl.program_id(2)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    f = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    base = e.to(tl.int64) * D * F
    offs = base + d.to(tl.int64)[:, None] * F + f[None, :]
    g = tl.load(g_ptr + offs).to(tl.float32)
    w = tl.load(w_ptr + offs)
    m = tl.load(m_ptr + offs)
    v = tl.load(v_ptr + offs)
    w = w * decay
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.sqrt(v) / bc2_sqrt + eps
    w = w - (step_size * m) / denom
    tl.store(m_ptr + offs, m)
    tl.store(v_ptr + offs, v)
    tl.store(w_ptr + offs, w)
    inv_row = tl.load(inv_row_ptr + e * D + d)
    inv_col = tl.load(inv_col_ptr + e * F + f)
    tl.store(q_rows_ptr + offs, _e4m3(w * inv_row[:, None]))
    q_t = tl.trans(_e4m3(w * inv_col[None, :]))
    tl.store(q_cols_ptr + base + f.to(tl.int64)[:, None] * D + d[None, :], q_t)
    a = tl.abs(w)
    tl.atomic_max(amax_row_ptr + e * D + d, tl.max(a, axis=1).to(tl.int32, bitcast=True))
    tl.atomic_max(amax_col_ptr + e * F + f, tl.max(a, axis=0).to(tl.int32, bitcast=True))


class Case:
    """One expert weight (e, D, F) with its optimizer state, for both paths."""

    def __init__(self, shape: tuple[int, int, int], seed: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.shape = shape
        self.master = torch.randn(shape, device="cuda", generator=gen) * 0.02
        self.param = self.master.to(torch.bfloat16)
        self.grad = (torch.randn(shape, device="cuda", generator=gen) * 1e-3).bfloat16()
        self.m = torch.randn(shape, device="cuda", generator=gen) * 1e-4
        self.v = torch.rand(shape, device="cuda", generator=gen) * 1e-6
        self.step = torch.full((), float(STEP), device="cuda")
        e, d, f = shape
        amax_rows = self.master.abs().amax(dim=2)  # the previous step's, for the delayed scales
        amax_cols = self.master.abs().amax(dim=1)
        self.inv_row = FP8_MAX / amax_rows
        self.inv_col = FP8_MAX / amax_cols
        self.q_rows = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
        self.q_cols = torch.empty((e, f, d), dtype=torch.float8_e4m3fn, device="cuda")
        self.amax_row = torch.zeros((e, d), dtype=torch.int32, device="cuda")
        self.amax_col = torch.zeros((e, f), dtype=torch.int32, device="cuda")

    def adamw_only(self) -> None:
        multi_tensor_adamw_(
            [self.param], [self.grad], [self.m], [self.v], [self.master], self.step,
            lr=LR, weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
        )  # fmt: skip

    def today(self) -> None:
        self.adamw_only()
        quantize_fp8_rowwise_triton(self.param, dim=-2, transposed=True)
        quantize_fp8_rowwise_triton(self.param, dim=-1)

    def prototype(self, block_d: int, block_f: int, warps: int) -> None:
        e, d, f = self.shape
        bc1 = 1.0 - BETAS[0] ** STEP
        bc2 = 1.0 - BETAS[1] ** STEP
        self.amax_row.zero_()
        self.amax_col.zero_()
        grid = (triton.cdiv(f, block_f), triton.cdiv(d, block_d), e)
        _adamw_fp8_kernel[grid](
            self.grad, self.master, self.m, self.v, self.q_rows, self.q_cols, self.inv_row,
            self.inv_col, self.amax_row, self.amax_col, d, f,
            LR / bc1, bc2**0.5, 1.0 - LR * WD, BETAS[0], 1.0 - BETAS[0], BETAS[1], 1.0 - BETAS[1],
            EPS, BLOCK_D=block_d, BLOCK_F=block_f, num_warps=warps,
        )  # fmt: skip


def check() -> None:
    shape = (4, 256, 192)
    ref, new = Case(shape, seed=1), Case(shape, seed=1)
    ref.adamw_only()
    new.prototype(64, 64, 4)
    for name in ("master", "m", "v"):
        a, b = getattr(new, name), getattr(ref, name)
        err = ((a - b).abs().max() / b.abs().max()).item()  # multiply-adds may contract here
        assert err < 1e-6, f"{name}: error {err} of its largest element"
    w = new.master
    want_rows = (w * new.inv_row[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    want_cols = (w.mT * new.inv_col[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(new.q_rows.view(torch.uint8), want_rows.view(torch.uint8)), "q_rows"
    assert torch.equal(new.q_cols.view(torch.uint8), want_cols.contiguous().view(torch.uint8)), (
        "q_cols"
    )
    assert torch.equal(new.amax_row.view(torch.float32), w.abs().amax(dim=2)), "amax rows"
    assert torch.equal(new.amax_col.view(torch.float32), w.abs().amax(dim=1)), "amax cols"
    print(
        "check: prototype equals AdamW (within 1e-6 of the largest element) and the torch quantization (bits)"
    )


def main() -> None:
    check()
    shapes = {
        "olmoe8 up (64, 2048, 2048)": (64, 2048, 2048),
        "olmoe8 down (64, 1024, 2048)": (64, 1024, 2048),
    }
    tiles = [
        (64, 64, 4),
        (64, 64, 8),
        (32, 128, 4),
        (128, 64, 8),
        (64, 128, 8),
        (128, 32, 4),
        (128, 64, 4),
        (64, 32, 4),
        (32, 64, 4),
    ]
    print("| weight | path | ms | GB/s of its bytes |")
    print("|---|---|---|---|")
    for label, shape in shapes.items():
        case = Case(shape, seed=0)
        n = case.master.numel()
        ms = do_bench(case.adamw_only, rep=300)
        print(
            f"| {label} | AdamW, fp32 masters, bf16 copy (28 B) | {ms:.3f} | {28 * n / ms / 1e6:.0f} |"
        )
        ms = do_bench(case.today, rep=300)
        print(
            f"| {label} | today: AdamW + both quantizations (34 B) | {ms:.3f} | {34 * n / ms / 1e6:.0f} |"
        )
        for bd, bf, warps in tiles:
            ms = do_bench(lambda: case.prototype(bd, bf, warps), rep=300)  # noqa: B023
            print(
                f"| {label} | prototype, tile {bd} x {bf}, {warps} warps (28 B) | {ms:.3f} | {28 * n / ms / 1e6:.0f} |"
            )


if __name__ == "__main__":
    main()
