"""Each Triton kernel behind a `triton_op` must be seen to write only its outputs.

Under torch.compile, Inductor clones every tensor that torch's analysis of a user kernel's TTIR
says the kernel writes, and a clone of a graph input (a saved activation in the backward graph)
cannot be optimized away. The analysis gives up on some constructs, a call from one jitted
function to another among them, and then marks every tensor argument as written. A refactor of
the SwiGLU kernels that shared a jitted tile loader did exactly that: the backward's input h
(268 MB a layer of `small`) was copied before every launch, 1 ms a step on the H200.

The analysis needs only TTIR, no GPU: without a CUDA driver the tests name a Hopper target.
"""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRETER_CHILD, TRITON_INSTALLED

pytestmark = pytest.mark.skipif(
    not TRITON_INSTALLED or INTERPRETER_CHILD, reason="needs Triton (compiled, not interpreted)"
)


@pytest.fixture(autouse=True)
def ttir_target():
    """Hopper as Triton's target when no GPU driver is active (TTIR generation needs no device)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if torch.cuda.is_available():
        yield
        return

    class HopperTarget:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver = triton.runtime.driver
    previous = driver._active
    driver.set_active(HopperTarget())
    try:
        yield
    finally:
        driver._active = previous


class Recorder:
    """A stand-in for `wrap_triton`: records each launch (kernel, named arguments), runs none."""

    def __init__(self) -> None:
        self.launches: list[tuple[object, dict]] = []

    def __call__(self, kernel):
        recorder = self

        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    named = dict(zip(kernel.arg_names, args, strict=False))
                    named.update({k: v for k, v in kwargs.items() if k in kernel.arg_names})
                    recorder.launches.append((kernel, named))

                return launch

        return Launcher()


def written_tensors(kernel, named: dict) -> set[str]:
    """Names of the tensor arguments torch's analysis says `kernel` writes."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    if hasattr(wrap, "identify_accessed_tensors"):  # torch >= 2.12
        accessed = wrap.identify_accessed_tensors(kernel, named, {})
        names = {dep.name for dep in accessed.read_writes.writes}
    else:
        names = set(wrap.identify_mutated_tensors(kernel, named, {}))
    return {n for n in names if isinstance(named.get(n), torch.Tensor)}


def assert_writes_only(launch, expected: set[str]) -> None:
    recorder = Recorder()
    launch(recorder)
    assert recorder.launches, "nothing was launched"
    for kernel, named in recorder.launches:
        assert written_tensors(kernel, named) == expected, kernel.fn.__name__


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(shape).to(dtype)


def test_route_topk_kernel_writes_only_its_outputs():
    from moetrain.kernels import topk

    scores = torch.rand(32, 64)
    ids, counts = torch.empty(32, 8, dtype=torch.int64), torch.zeros(64, dtype=torch.int32)
    assert_writes_only(
        lambda w: topk._launch(scores, 8, ids, counts, wrap=w), {"ids_ptr", "counts_ptr"}
    )


@pytest.mark.parametrize("F_", [512, 96])
def test_swiglu_kernels_write_only_their_outputs(F_):
    from moetrain.kernels import swiglu_triton as s

    h, grad = randn(64, 2 * F_), randn(64, F_)
    assert_writes_only(lambda w: s.launch_forward(h, torch.empty_like(grad), wrap=w), {"out_ptr"})
    assert_writes_only(
        lambda w: s.launch_backward(h, grad, torch.empty_like(h), wrap=w), {"dh_ptr"}
    )
    w_N, dw = torch.rand(64), torch.empty(64, s.num_column_blocks(F_))
    assert_writes_only(
        lambda w: s.launch_forward(h, torch.empty_like(grad), w_N, wrap=w), {"out_ptr"}
    )
    assert_writes_only(
        lambda w: s.launch_backward(h, grad, torch.empty_like(h), w_N, dw, wrap=w),
        {"dh_ptr", "dw_ptr"},
    )
    assert_writes_only(  # the forward's output written again
        lambda w: s.launch_backward(
            h, grad, torch.empty_like(h), w_N, dw, wrap=w, out_NF=torch.empty_like(grad)
        ),
        {"dh_ptr", "dw_ptr", "out_ptr"},
    )


@pytest.mark.parametrize("D", [1024, 8192 + 64])  # one block per row, and several
def test_gather_kernels_write_only_their_outputs(D):
    from moetrain.kernels import gather_triton as g

    T, K = 32, 4
    x, inverse, rows = randn(T, D), torch.randperm(T * K).view(T, K), randn(T * K, D)
    assert_writes_only(lambda w: g.launch_spread_routes(x, inverse, rows.clone(), wrap=w), {"dst_ptr"})  # fmt: skip
    assert_writes_only(lambda w: g.launch_sum_routes(rows, inverse, x.clone(), wrap=w), {"dst_ptr"})


@pytest.mark.parametrize("heads,head_dim", [(16, 64), (4, 20)])
def test_qk_norm_rope_kernels_write_only_their_outputs(heads, head_dim):
    from moetrain.kernels import qk_norm_rope_triton as q

    S, D = 8, heads * head_dim
    qkv = randn(2 * S, 3 * D)  # the fused projection the op passes slices of
    x, v, grad_y, grad_v = qkv[:, :D], qkv[:, 2 * D :], randn(2 * S, D), randn(2 * S, D)
    weight, rstd = torch.ones(D), torch.rand(2 * S)
    cos, sin = torch.rand(S, head_dim // 2), torch.rand(S, head_dim // 2)
    for copy, written in ((None, set()), ((v, torch.empty_like(grad_y)), {"copy_dst_ptr"})):
        assert_writes_only(
            lambda w, copy=copy: q.launch_qk_norm_rope_forward(
                x, weight, cos, sin, torch.empty_like(grad_y), torch.empty(2 * S), S, head_dim,
                1e-5, wrap=w, copy=copy,
            ),
            {"y_ptr", "rstd_ptr"} | written,
        )  # fmt: skip
    for copy in (None, (grad_v, 2 * D)):
        assert_writes_only(
            lambda w, copy=copy: q.launch_qk_norm_rope_backward(
                grad_y, x, weight, rstd, cos, sin, torch.empty_like(qkv), torch.empty(4, D), S,
                head_dim, wrap=w, grad_x_col=D, copy=copy,
            ),
            {"grad_x_ptr", "partial_ptr"},
        )  # fmt: skip
