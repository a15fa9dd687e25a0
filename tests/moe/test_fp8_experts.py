"""The FP8 experts' MLP as one op (moe/fp8_experts.py) against the same products composed one by
one (`ComposedGroupedGemm`), with row weights, an empty expert and garbage padding rows: the CPU
runs the emulation, `pytest -m gpu` the tensor cores and the fused Triton SwiGLU kernels."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config

from moetrain.kernels.swiglu import swiglu_reference
from moetrain.moe.experts import ComposedGroupedGemm, GroupedExperts, grouped_mm_reference
from moetrain.moe.grouped_gemm import FP8RowwiseEmulatedGroupedGemm, FP8RowwiseGroupedGemm
from moetrain.moe.payload import BF16_PAYLOAD, FP8_PAYLOAD
from moetrain.nn.fp8 import fp8_unsupported_reason

PAYLOADS = {"bf16": BF16_PAYLOAD, "fp8": FP8_PAYLOAD}
HAS_FP8_GPU = torch.cuda.is_available() and fp8_unsupported_reason(torch.device("cuda")) is None


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def problem(counts, num_rows, d, f, *, dtype, device, seed):
    """Rows grouped by expert, padding rows past the last offset (garbage), router-like row
    weights, the experts' weights and a gradient for the real rows."""
    gen = torch.Generator().manual_seed(seed)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    n = int(offs[-1])
    x = torch.randn(num_rows, d, generator=gen)
    x[n:] = 1e30
    w_up = torch.randn(len(counts), d, 2 * f, generator=gen) / d**0.5
    w_down = torch.randn(len(counts), f, d, generator=gen) / f**0.5
    row_w = torch.rand(num_rows, generator=gen)
    g = torch.randn(n, d, generator=gen)
    to = dict(dtype=dtype, device=device)
    return x.to(**to), w_up.to(**to), w_down.to(**to), row_w.to(device), offs.to(device), g.to(**to)


def build(gemm, x, w_up, w_down, row_w, offs, g):
    """GroupedExperts holding the weights, and fresh leaves for x and the row weights."""
    experts = GroupedExperts(w_up.shape[0], w_up.shape[1], w_down.shape[1], gemm=gemm)
    experts = experts.to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        experts.w_up_eD2F.copy_(w_up)
        experts.w_down_eFD.copy_(w_down)
    x = x.detach().clone().requires_grad_()
    row_w = row_w.detach().clone().requires_grad_()
    return experts, x, row_w


def step(experts, x, row_w, offs, g, fn=None):
    """Output rows within groups and the gradients of sum(y * g) over x, both weights and the
    row weights."""
    n = g.shape[0]
    y = (experts if fn is None else fn)(x, offs, row_w)
    (y[:n].float() * g.float()).sum().backward()
    return (
        y[:n].detach(),
        x.grad[:n],
        experts.w_up_eD2F.grad,
        experts.w_down_eFD.grad,
        row_w.grad[:n],
    )


def run(gemm, x, w_up, w_down, row_w, offs, g, *, compile: bool | str = False):
    experts, x, row_w = build(gemm, x, w_up, w_down, row_w, offs, g)
    fn = torch.compile(experts, fullgraph=True, backend=compile) if compile else None
    return step(experts, x, row_w, offs, g, fn)


COUNTS = [100, 0, 250, 40, 170, 90]  # expert 1 gets no rows
NUM_ROWS, D, F = 700, 128, 96  # 50 padding rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mlp_is_the_composed_products_on_cpu(dtype):
    """Same quantization points, same products: the emulated results are equal bit for bit."""
    args = problem(COUNTS, NUM_ROWS, D, F, dtype=dtype, device="cpu", seed=1)
    fused = run(FP8RowwiseEmulatedGroupedGemm(), *args)
    composed = run(ComposedGroupedGemm(FP8RowwiseEmulatedGroupedGemm()), *args)
    for name, a, b in zip(("y", "dx", "dw_up", "dw_down", "drow_w"), fused, composed, strict=True):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name
    assert torch.equal(fused[2][1], torch.zeros_like(fused[2][1]))  # the expert without rows


def test_fused_mlp_is_close_to_fp32_math():
    """Two chained e4m3 products (about 4% each on Gaussian data) land within 10% of fp32 math;
    a scale on the wrong dim or a dropped row weight would be off by O(1)."""
    x, w_up, w_down, row_w, offs, g = problem(
        COUNTS, NUM_ROWS, D, F, dtype=torch.float32, device="cpu", seed=2
    )

    def reference(x_, offs_, w_):
        h = grouped_mm_reference(x_, experts_up, offs_)
        return grouped_mm_reference(swiglu_reference(h, w_), experts_down, offs_)

    experts_up, experts_down = w_up, w_down
    gemm = FP8RowwiseEmulatedGroupedGemm()
    got = run(gemm, x, w_up, w_down, row_w, offs, g)
    n = g.shape[0]
    xr = x.clone().requires_grad_()
    wr = row_w.clone().requires_grad_()
    experts_up = w_up.clone().requires_grad_()
    experts_down = w_down.clone().requires_grad_()
    y = reference(xr, offs, wr)
    (y[:n] * g).sum().backward()
    want = (y[:n].detach(), xr.grad[:n], experts_up.grad, experts_down.grad, wr.grad[:n])
    for name, a, b in zip(("y", "dx", "dw_up", "dw_down", "drow_w"), got, want, strict=True):
        assert rel(a, b) < 0.1, name


def test_fused_mlp_compiles_without_a_graph_break():
    args = problem(COUNTS, NUM_ROWS, D, F, dtype=torch.float32, device="cpu", seed=3)
    gemm = FP8RowwiseEmulatedGroupedGemm()
    eager = run(gemm, *args)
    compiled = run(gemm, *args, compile="aot_eager")
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def saved_rows(experts, x, row_w, offs) -> list[tuple[int, ...]]:
    """Shapes of the row-indexed activations (2-D, one row per x row) the forward saves."""
    shapes = []

    def pack(t):
        if t.dim() == 2 and t.shape[0] == x.shape[0]:
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(x, offs, row_w)
    return shapes


def test_fused_mlp_holds_x_and_h_alone_for_the_backward():
    """The SwiGLU output a (N x F) is written again by the backward instead of being held: the
    fused op keeps x and h, the composed products x, h and a."""
    x, w_up, w_down, row_w, offs, g = problem(COUNTS, NUM_ROWS, D, F, dtype=torch.float32, device="cpu", seed=8)  # fmt: skip
    args = (x, w_up, w_down, row_w, offs, g)
    fused = saved_rows(*build(FP8RowwiseEmulatedGroupedGemm(), *args), offs)
    composed = saved_rows(*build(ComposedGroupedGemm(FP8RowwiseEmulatedGroupedGemm()), *args), offs)
    assert sorted(fused) == [(NUM_ROWS, D), (NUM_ROWS, 2 * F)]
    assert sorted(composed) == [(NUM_ROWS, F), (NUM_ROWS, D), (NUM_ROWS, 2 * F)]


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_dispatcher_fp8_rows_are_the_quantized_rows(payload):
    """A LocalDispatcher with the FP8 experts' `quantized_rows`: T token rows quantized, bytes
    gathered K-fold, bit for bit `quantize_rows` of the rows it hands over (after the FP8
    payload's rounding, if any); with the default (the bf16 experts') there are none."""
    from moetrain.moe.dispatch import LocalDispatcher
    from moetrain.moe.router import RouterConfig, TopKRouter
    from moetrain.nn.fp8 import quantize_rows

    torch.manual_seed(0)
    x = torch.randn(50, 64, dtype=torch.bfloat16)
    routing = TopKRouter(64, RouterConfig(num_experts=6, top_k=3)).to(torch.bfloat16)(x)
    quantized = FP8RowwiseGroupedGemm().quantized_rows
    rows, _, handle = LocalDispatcher(PAYLOADS[payload], quantized).dispatch(x, routing)
    q, scale = handle.rows_fp8
    q_ref, scale_ref = quantize_rows(rows)
    assert q.dtype == torch.float8_e4m3fn and q.shape == rows.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)
    assert LocalDispatcher(PAYLOADS[payload]).dispatch(x, routing)[2].rows_fp8 == (None, None)


def test_dispatcher_fp8_rows_compile_to_the_eager_bits():
    """Compiled, the T rows' quantization stays the opaque op the experts' own body runs (on a
    GPU Inductor's fused twin rounded some scales differently); the byte gather is traced."""
    from moetrain.moe.fp8_experts import gather_fp8_rows

    x = torch.randn(40, 64, dtype=torch.bfloat16) * torch.logspace(-3, 3, 40)[:, None]
    token = torch.randint(0, 40, (120,))
    graphs = []

    def backend(gm, _):
        graphs.append(gm)
        return gm

    q, scale = torch.compile(gather_fp8_rows, fullgraph=True, backend=backend)(x, token)
    q_ref, scale_ref = gather_fp8_rows(x, token)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)
    code = graphs[0].code
    assert "moetrain.quantize_fp8_rows" in code and "amax" not in code


def moe_layer_run(fp8_rows: bool, *, device="cpu", compile=False, seed=9):
    """An FP8-expert MoE layer (fused MLP; the emulation off FP8 GPUs) on fresh inputs, with
    the dispatcher's FP8 rows on or off: output and every gradient."""
    from moetrain.config import MoEConfig
    from moetrain.moe.layer import MoELayer
    from moetrain.parallel.precision import make_grouped_gemm

    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig(num_experts=8, top_k=2, expert_hidden=96), 128)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, p.shape[-2] ** -0.5 if p.dim() > 1 else 1.0)
    layer = layer.to(device=device, dtype=torch.bfloat16)
    layer.experts.gemm = make_grouped_gemm("fp8_rowwise", torch.device(device))
    if fp8_rows:  # what the precision plan installs with FP8 experts
        layer.dispatcher.quantized_rows = layer.experts.gemm.quantized_rows
    x = torch.randn(2, 160, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    if compile:
        torch._dynamo.reset()  # what earlier tests compiled must not change this graph
    fn = torch.compile(layer, fullgraph=True) if compile else layer
    y = fn(x)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=device).view_as(y)).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def test_moe_layer_with_dispatcher_fp8_rows_is_bit_for_bit_the_same():
    """What the trainer installs for FP8 experts (the dispatcher quantizes T rows) against the
    experts quantizing all T*K rows: the same step, bit for bit (CPU emulation)."""
    on, off = moe_layer_run(True), moe_layer_run(False)
    for a, b in zip(on, off, strict=True):
        assert a is not None and torch.isfinite(a).all()
        assert torch.equal(a, b)


def test_mismatched_expert_weights_are_an_error():
    x, w_up, w_down, row_w, offs, _ = problem([3, 5], 8, 64, 32, dtype=torch.float32, device="cpu", seed=4)  # fmt: skip
    with pytest.raises(ValueError, match=r"w_down \(e, F, D\)"):
        FP8RowwiseEmulatedGroupedGemm().mlp(x, w_up, w_down[:, :16], offs, row_w)


# --- GPU ---------------------------------------------------------------------------------------

GPU_COUNTS = [1500, 0, 2500, 700, 1300, 17, 1000, 976]  # 8 uneven groups, one empty: 7993 rows
GPU_ROWS, GPU_D, GPU_F = 8192, 1024, 512
needs_fp8_gpu = pytest.mark.skipif(
    not HAS_FP8_GPU, reason="needs a CUDA GPU of compute capability 9.x or 10.x"
)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("fast_accum", [True, False])
def test_fused_mlp_is_the_composed_products_on_the_gpu(fast_accum):
    """Tensor cores and the fused SwiGLU kernels: equal to the composed path bit for bit (the
    same FP8 operands reach the same kernels), and close to the emulation."""
    args = problem(GPU_COUNTS, GPU_ROWS, GPU_D, GPU_F, dtype=torch.bfloat16, device="cuda", seed=5)
    fused = run(FP8RowwiseGroupedGemm(use_fast_accum=fast_accum), *args)
    composed = run(ComposedGroupedGemm(FP8RowwiseGroupedGemm(use_fast_accum=fast_accum)), *args)
    emulated = run(FP8RowwiseEmulatedGroupedGemm(), *args)
    names = ("y", "dx", "dw_up", "dw_down", "drow_w")
    for name, a, b, c in zip(names, fused, composed, emulated, strict=True):
        assert torch.isfinite(a).all(), name
        if name == "drow_w":  # row sums in the fused kernel: another fp32 summation order
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        else:
            assert torch.equal(a, b), name
        # fp32 math instead of tensor cores: bf16 roundings of h differ, and a few of a's e4m3
        # codes flip with them
        assert rel(a, c) < 3e-2, name


@pytest.mark.gpu
@needs_fp8_gpu
def test_fused_mlp_on_the_gpu_has_no_host_sync():
    args = problem(GPU_COUNTS, GPU_ROWS, GPU_D, GPU_F, dtype=torch.bfloat16, device="cuda", seed=6)
    gemm = FP8RowwiseGroupedGemm()
    run(gemm, *args)  # warm-up: Triton compiles
    experts, x, row_w = build(gemm, *args)  # host-to-device copies: outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step(experts, x, row_w, args[4], args[5])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(t is not None for t in out)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_moe_layer_with_dispatcher_fp8_rows_on_the_gpu(compile):
    """Tensor cores, the Triton quantizer and the byte gather, eager or compiled: the
    dispatcher's FP8 rows give the step the experts' own quantization gives, bit for bit.
    Compiled, the two settings are two graphs; Inductor's deterministic mode keeps it from
    picking their reduction configs (the router's softmax, ...) by timing, which can change a
    sum's order and so a routing weight's last bit (without it this test failed once on the
    H200; the timed pick is the likely cause, not a confirmed one)."""
    with torch._inductor.config.patch(deterministic=compile):
        on = moe_layer_run(True, device="cuda", compile=compile)
        off = moe_layer_run(False, device="cuda", compile=compile)
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a is not None and torch.isfinite(a).all()
        assert torch.equal(a, b), f"tensor {i}: max |difference| {(a - b).abs().max().item()}"


@pytest.mark.gpu
@needs_fp8_gpu
def test_fused_mlp_on_the_gpu_compiled_matches_eager():
    args = problem(GPU_COUNTS, GPU_ROWS, GPU_D, GPU_F, dtype=torch.bfloat16, device="cuda", seed=7)
    gemm = FP8RowwiseGroupedGemm()
    eager = run(gemm, *args)
    compiled = run(gemm, *args, compile="inductor")
    for a, b in zip(compiled, eager, strict=True):
        assert rel(a, b) < 1e-3
