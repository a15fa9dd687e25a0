"""Per-column (transposed) weight quantization: variants of the one-pass column kernel, on the H200.

The forward's FP8 weight quantization (`quantize_fp8_rowwise_triton(w, dim=-2, transposed=True)`)
against the row-scaled kernel on the same bytes, and the variants measured in session 15
(benchmarks/RESULTS.md): grid order, warps, columns a program, amax in bf16, q transposed in
registers before the store, and a chunked amax-then-cast. Every variant is checked bit for bit
against the library kernel on a weight with an inf and a NaN, then timed with `do_bench`.

    python benchmarks/column_quant_sweep.py
"""

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from moetrain.kernels import quant_triton as qt

_jit = triton.jit

# --- grid order, warps and columns a program (session 15, call 1) ------------------------------


@_jit
def _col_swapped(
    x_ptr,
    q_ptr,
    scale_ptr,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,
    SWAP: tl.constexpr,
    STORE: tl.constexpr,
):
    if SWAP:
        blk = tl.program_id(0)
        batch = tl.program_id(1)
    else:
        batch = tl.program_id(0)
        blk = tl.program_id(1)
    base = batch.to(tl.int64) * M * N
    rows = tl.arange(0, BLOCK_M)
    for s in range(SUB):
        cols = (blk * SUB + s) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = (rows < M)[:, None] & col_mask[None, :]
        offsets = base + rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(qt._finite_abs(x), axis=0)
        inv, scale = qt._scales_from_amax(amax)
        if STORE:
            qt._store_column_tile(q_ptr, x, inv, offsets, base, rows, cols, M, mask, False, True)
        tl.store(scale_ptr + batch * N + cols, scale, mask=col_mask)


def variant(w, block_n, sub, swap, warps, store=True):
    b, m, n = w.shape
    q = torch.empty((b, n, m), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((b, n), dtype=torch.float32, device=w.device)
    nb = triton.cdiv(n, block_n * sub)
    grid = (nb, b) if swap else (b, nb)
    _col_swapped[grid](
        w,
        q,
        scale,
        m,
        n,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        SUB=sub,
        SWAP=swap,
        STORE=store,
        num_warps=warps,
    )
    return q, scale


# --- bf16 amax, transposed store, chunked (session 15, call 2) ---------------------------------


@triton.jit
def _e4m3(v):
    c = tl.minimum(tl.maximum(v, -448.0), 448.0)
    c = tl.where(v != v, float("nan"), c)
    return c.to(tl.float8e4nv)


@triton.jit
def _col(
    x_ptr,
    q_ptr,
    scale_ptr,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BF16_AMAX: tl.constexpr,
    TRANS_STORE: tl.constexpr,
):
    blk = tl.program_id(0)
    batch = tl.program_id(1)
    base = batch.to(tl.int64) * M * N
    rows = tl.arange(0, BLOCK_M)
    cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    offsets = base + rows.to(tl.int64)[:, None] * N + cols[None, :]
    xb = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if BF16_AMAX:
        a = tl.abs(xb)
        a = tl.where(a < float("inf"), a, 0.0)
        amax = tl.max(a, axis=0).to(tl.float32)
    else:
        amax = tl.max(qt._finite_abs(xb.to(tl.float32)), axis=0)
    inv, scale = qt._scales_from_amax(amax)
    if TRANS_STORE:
        q = _e4m3(xb.to(tl.float32) * inv[None, :])
        qt_ = tl.trans(q)
        q_off = base + cols.to(tl.int64)[:, None] * M + rows[None, :]
        tl.store(q_ptr + q_off, qt_, mask=col_mask[:, None] & (rows < M)[None, :])
    else:
        qt._store_column_tile(
            q_ptr, xb.to(tl.float32), inv, offsets, base, rows, cols, M, mask, False, True
        )
    tl.store(scale_ptr + batch * N + cols, scale, mask=col_mask)


@triton.jit
def _col_chunked(
    x_ptr,
    q_ptr,
    scale_ptr,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK_M: tl.constexpr,
):
    """amax over the whole column block in chunks (HBM), then cast+transposed store in chunks
    (second read from L2), each chunk transposed in registers."""
    blk = tl.program_id(0)
    batch = tl.program_id(1)
    base = batch.to(tl.int64) * M * N
    cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    amax = tl.zeros([BLOCK_N], dtype=tl.float32)
    for mb in range(BLOCK_M // CHUNK_M):
        rows = mb * CHUNK_M + tl.arange(0, CHUNK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        x = tl.load(
            x_ptr + base + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0
        )
        amax = tl.maximum(amax, tl.max(qt._finite_abs(x.to(tl.float32)), axis=0))
    inv, scale = qt._scales_from_amax(amax)
    for mb in range(BLOCK_M // CHUNK_M):
        rows = mb * CHUNK_M + tl.arange(0, CHUNK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        x = tl.load(
            x_ptr + base + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0
        )
        q = tl.trans(_e4m3(x.to(tl.float32) * inv[None, :]))
        q_off = base + cols.to(tl.int64)[:, None] * M + rows[None, :]
        tl.store(q_ptr + q_off, q, mask=col_mask[:, None] & (rows < M)[None, :])
    tl.store(scale_ptr + batch * N + cols, scale, mask=col_mask)


def run(w, kind, bn, warps, bf16_amax=False, trans=False, chunk=0):
    b, m, n = w.shape
    q = torch.empty((b, n, m), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((b, n), dtype=torch.float32, device=w.device)
    grid = (triton.cdiv(n, bn), b)
    bm = triton.next_power_of_2(m)
    if kind == "resident":
        _col[grid](
            w,
            q,
            scale,
            m,
            n,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BF16_AMAX=bf16_amax,
            TRANS_STORE=trans,
            num_warps=warps,
        )
    else:
        _col_chunked[grid](
            w, q, scale, m, n, BLOCK_M=bm, BLOCK_N=bn, CHUNK_M=chunk, num_warps=warps
        )
    return q, scale


CONFIGS = [
    ("resident 16c 4w (swapped lib)", dict(kind="resident", bn=16, warps=4)),
    ("resident 16c 4w bf16-amax", dict(kind="resident", bn=16, warps=4, bf16_amax=True)),
    ("resident 16c 4w trans-store", dict(kind="resident", bn=16, warps=4, trans=True)),
    (
        "resident 16c 4w bf16+trans",
        dict(kind="resident", bn=16, warps=4, bf16_amax=True, trans=True),
    ),
    ("resident 16c 2w trans-store", dict(kind="resident", bn=16, warps=2, trans=True)),
    ("resident 16c 8w trans-store", dict(kind="resident", bn=16, warps=8, trans=True)),
    (
        "resident 32c 8w bf16+trans",
        dict(kind="resident", bn=32, warps=8, bf16_amax=True, trans=True),
    ),
    (
        "resident 32c 4w bf16+trans",
        dict(kind="resident", bn=32, warps=4, bf16_amax=True, trans=True),
    ),
    ("chunked 32c x256 4w", dict(kind="chunked", bn=32, warps=4, chunk=256)),
    ("chunked 64c x128 4w", dict(kind="chunked", bn=64, warps=4, chunk=128)),
    ("chunked 64c x256 8w", dict(kind="chunked", bn=64, warps=8, chunk=256)),
    ("chunked 128c x64 4w", dict(kind="chunked", bn=128, warps=4, chunk=64)),
]


SWEEP_1 = [
    ("16c sub1 grid(b,n) 8w [session 14]", 16, 1, False, 8),
    ("16c sub1 grid(n,b) 8w", 16, 1, True, 8),
    ("16c sub2 grid(b,n) 8w", 16, 2, False, 8),
    ("16c sub2 grid(n,b) 8w", 16, 2, True, 8),
    ("16c sub4 grid(n,b) 8w", 16, 4, True, 8),
    ("16c sub1 grid(n,b) 4w [library now]", 16, 1, True, 4),
    ("32c sub1 grid(n,b) 16w", 32, 1, True, 16),
]


def sweep(label: str, shape: tuple[int, int, int]) -> None:
    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w[0, 3, 5] = float("inf")
    w[1, 7, 9] = float("nan")
    mb = w.numel() * 3 / 1e6
    ref_q, ref_s = qt.quantize_fp8_rowwise_triton(w, dim=-2, transposed=True)

    def show(name: str, t: float, extra: str = "") -> None:
        print(f"{label:12s} {name:36s} {t:.4f} ms  {mb / t / 1e3:.2f} TB/s  {extra}", flush=True)

    library = lambda: qt.quantize_fp8_rowwise_triton(w, dim=-2, transposed=True)  # noqa: E731
    show("library column kernel", do_bench(library, rep=200))
    show("row kernel (same bytes)", do_bench(lambda: qt.quantize_fp8_rowwise_triton(w), rep=200))
    runs = [(name, lambda c=c: variant(w, *c)) for name, *c in SWEEP_1] + [
        (name, lambda kw=kw: run(w, **kw)) for name, kw in CONFIGS
    ]
    reads = lambda: variant(w, 16, 1, True, 4, False)  # noqa: E731
    show("library's tiling, reads only (no q)", do_bench(reads, rep=200))
    for name, fn in runs:
        try:
            q, scale = fn()
            same = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
            same = same and torch.equal(scale, ref_s)
            show(name, do_bench(fn, rep=200), f"same={same}")
        except Exception as e:  # noqa: BLE001
            print(f"{label:12s} {name:36s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


def main() -> None:
    torch.manual_seed(0)
    sweep("olmoe8 up", (64, 2048, 2048))
    sweep("olmoe8 down", (64, 1024, 2048))
    sweep("small up", (64, 1024, 1024))
    sweep("small down", (64, 512, 1024))


if __name__ == "__main__":
    main()
