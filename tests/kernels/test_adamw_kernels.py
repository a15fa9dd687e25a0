"""Multi-tensor AdamW: the torch reference against torch.optim.AdamW, and the Triton kernel
against the reference (Triton's CPU interpreter when Triton is installed but no GPU is present;
on CUDA under `pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    TRITON_INSTALLED,
    interpreted,
    needs_cuda_and_triton,
    needs_interpreter,
    run_interpreted_tests,
)

from moetrain.kernels.adamw_reference import adamw_reference_

HYPER = dict(lr=3e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
TORCH_HYPER = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
KEYS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "masters")
# name: (param dtype, grad dtype, state dtype, fp32 masters)
SIGNATURES = {
    "fp32": (torch.float32, torch.float32, torch.float32, False),
    "bf16": (torch.bfloat16, torch.bfloat16, torch.bfloat16, False),
    "mixed": (torch.bfloat16, torch.bfloat16, torch.float32, True),
}
SHAPES = [(1,), (7,), (4095,), (4097,), (65537,), (3, 33, 65), (4096,)]
# Triton's interpreter runs each program in Python: the same cases, with 8193 in place of 65537
# (still several whole chunks and a masked tail at every block size tested)
INTERPRETER_SHAPES = [(1,), (7,), (4095,), (4097,), (8193,), (3, 33, 65), (4096,)]


def make_state(shapes, signature, seed, device="cpu"):
    """Fresh random tensors of one dtype signature (never zeros: they hide unwritten outputs)."""
    param_dtype, grad_dtype, state_dtype, with_masters = SIGNATURES[signature]
    gen = torch.Generator().manual_seed(seed)

    def rand(shape, scale, dtype, positive=False):
        x = torch.rand(shape, generator=gen) if positive else torch.randn(shape, generator=gen)
        return (x * scale).to(dtype).to(device)

    masters = [rand(s, 1.0, torch.float32) for s in shapes]
    state = {
        "params": [w.to(param_dtype, copy=True) for w in masters],
        "grads": [rand(s, 1e-2, grad_dtype) for s in shapes],
        "exp_avgs": [rand(s, 1e-3, state_dtype) for s in shapes],
        "exp_avg_sqs": [rand(s, 1e-5, state_dtype, positive=True) for s in shapes],
        "masters": masters if with_masters else None,
    }
    return state


def clone(state):
    return {k: None if v is None else [t.clone() for t in v] for k, v in state.items()}


def call(fn, state, step, **kwargs):
    fn(*(state[k] for k in KEYS), step, **{**HYPER, **kwargs})


def assert_same_bits(a, b):
    for key in KEYS:
        for x, y in zip(a[key] or [], b[key] or [], strict=True):
            assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()), key


def assert_matches(out, ref):
    """fp32 within a few ulp; bf16 equal or one bf16 ulp apart."""
    for key in ("params", "exp_avgs", "exp_avg_sqs", "masters"):
        for x, y in zip(out[key] or [], ref[key] or [], strict=True):
            x, y = x.cpu(), y.cpu()
            assert x.dtype == y.dtype and x.shape == y.shape
            if x.dtype == torch.float32:
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=key)
            else:
                x, y = x.float(), y.float()
                tiny = torch.finfo(torch.bfloat16).tiny
                ulp = torch.exp2(
                    torch.floor(torch.log2(torch.maximum(x.abs(), y.abs()) + tiny)) - 7
                )
                assert ((x - y).abs() <= ulp).all(), f"{key}: more than one bf16 ulp apart"


# --- the reference against torch.optim.AdamW --------------------------------------------------


def test_reference_matches_torch_adamw():
    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (33, 5), (4, 3, 8)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    torch_params = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(torch_params, foreach=False, **TORCH_HYPER)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    step = torch.zeros(())
    for _ in range(5):
        grads = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]
        for p, g in zip(torch_params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        step += 1
        adamw_reference_(params, grads, exp_avgs, exp_avg_sqs, None, step, **HYPER)
        for i, tp in enumerate(torch_params):
            torch.testing.assert_close(params[i], tp.detach(), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(exp_avgs[i], opt.state[tp]["exp_avg"], rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(
                exp_avg_sqs[i], opt.state[tp]["exp_avg_sq"], rtol=1e-6, atol=1e-12
            )


def test_reference_with_masters_matches_fp32_adamw_on_the_masters():
    state = make_state([(7,), (16, 9)], "mixed", seed=1)
    torch_masters = [w.clone().requires_grad_() for w in state["masters"]]
    opt = torch.optim.AdamW(torch_masters, foreach=False, **TORCH_HYPER)
    state["exp_avgs"] = [torch.zeros_like(w) for w in state["masters"]]
    state["exp_avg_sqs"] = [torch.zeros_like(w) for w in state["masters"]]
    gen = torch.Generator().manual_seed(2)
    step = torch.zeros(())
    for _ in range(5):
        state["grads"] = [
            (torch.randn(w.shape, generator=gen) * 1e-2).bfloat16() for w in torch_masters
        ]
        for w, g in zip(torch_masters, state["grads"], strict=True):
            w.grad = g.float()
        opt.step()
        step += 1
        call(adamw_reference_, state, step)
        for p, w, tw in zip(state["params"], state["masters"], torch_masters, strict=True):
            torch.testing.assert_close(w, tw.detach(), rtol=1e-6, atol=1e-7)
            assert torch.equal(p, w.bfloat16())


@pytest.mark.parametrize("signature", list(SIGNATURES))
def test_reference_found_inf_skips_the_step(signature):
    """found_inf = 1 writes nothing; the caller does `step += 1 - found_inf`, so a run with a
    skipped step equals, bit for bit, a run without it."""
    state = make_state([(5,), (3, 4)], signature, seed=3)
    skipped, plain = clone(state), clone(state)
    gen = torch.Generator().manual_seed(4)
    step_skipped, step_plain = torch.zeros(()), torch.zeros(())
    for found in (0.0, 1.0, 0.0):
        grad_dtype = state["grads"][0].dtype
        grads = [
            (torch.randn(g.shape, generator=gen) * 1e-2).to(grad_dtype) for g in state["grads"]
        ]
        if found:
            grads[0][0] = float("nan")
        found_inf = torch.tensor(found)
        before = clone(skipped)
        step_skipped += 1 - found_inf
        skipped["grads"] = grads
        call(adamw_reference_, skipped, step_skipped, found_inf=found_inf)
        if found:
            assert_same_bits({**skipped, "grads": None}, {**before, "grads": None})
            continue
        step_plain += 1
        plain["grads"] = grads
        call(adamw_reference_, plain, step_plain)
    assert step_skipped.item() == step_plain.item() == 2
    assert_same_bits(skipped, plain)


def test_reference_grad_scale_divides_the_grads():
    state = make_state([(6,), (4, 5)], "mixed", seed=5)
    scale = torch.tensor(3.7)
    scaled, divided = clone(state), clone(state)
    divided["grads"] = [(g.float() / scale) for g in state["grads"]]  # fp32 grads: no rounding
    step = torch.tensor(4.0)
    call(adamw_reference_, scaled, step, grad_scale=scale)
    call(adamw_reference_, divided, step)
    assert_same_bits({**scaled, "grads": None}, {**divided, "grads": None})


# --- the Triton kernel against the reference ---------------------------------------------------

OPTIONS = {  # name: (grad_scale, found_inf)
    "plain": (None, None),
    "grad_scale": (2.5, None),
    "found_inf=0": (0.5, 0.0),
    "found_inf=1": (2.5, 1.0),
}


def check_triton_against_reference(
    signature, option, block, device, seed=6, lr_on_device=False, shapes=SHAPES
):
    from moetrain.kernels.adamw_triton import multi_tensor_adamw_

    state = make_state(shapes, signature, seed, device)
    ref = clone(state)
    scale, found = OPTIONS[option]
    extra = {}
    if scale is not None:
        extra["grad_scale"] = torch.tensor(scale, device=device)
    if found is not None:
        extra["found_inf"] = torch.tensor(found, device=device)
    before = clone(state)
    for step, lr in ((1.0, 3e-3), (7.0, 1.7e-4)):  # the state evolves; step count from the device
        step_t = torch.tensor(step, device=device)
        kernel_lr = torch.tensor(lr, dtype=torch.float64, device=device) if lr_on_device else lr
        call(multi_tensor_adamw_, state, step_t, block=block, lr=kernel_lr, **extra)
        call(adamw_reference_, ref, step_t, lr=lr, **extra)
    assert_matches(state, ref)
    if found:
        assert_same_bits(state, before)


def check_unaligned_views(device):
    """Views at odd element offsets: the kernel must not assume 16-byte alignment."""
    from moetrain.kernels.adamw_triton import multi_tensor_adamw_

    state = make_state([(4096 * 3 + 5,)], "fp32", seed=7, device=device)
    state = {k: None if v is None else [v[0][1:]] for k, v in state.items()}
    ref = clone(state)
    step = torch.tensor(3.0, device=device)
    call(multi_tensor_adamw_, state, step)
    call(adamw_reference_, ref, step)
    assert_matches(state, ref)


@needs_interpreter
def test_adamw_triton_under_interpreter():
    """Runs this file's `interpreted` tests in a fresh process with TRITON_INTERPRET=1."""
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("block", [None, 256])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("signature", list(SIGNATURES))
def test_triton_matches_reference_interpreted(signature, option, block):
    check_triton_against_reference(signature, option, block, "cpu", shapes=INTERPRETER_SHAPES)


@interpreted
@pytest.mark.parametrize("signature", list(SIGNATURES))
def test_triton_reads_a_device_learning_rate_interpreted(signature):
    """The CUDA-graph path: the learning rate is an fp64 scalar the kernel loads."""
    check_triton_against_reference(
        signature, "grad_scale", None, "cpu", lr_on_device=True, shapes=INTERPRETER_SHAPES
    )


@interpreted
def test_triton_unaligned_views_interpreted():
    check_unaligned_views("cpu")


def test_triton_module_imports_without_triton():
    from moetrain.kernels import adamw_triton

    assert adamw_triton.triton_available() == TRITON_INSTALLED
    x = torch.zeros(4, 4).t()
    with pytest.raises(ValueError if TRITON_INSTALLED else RuntimeError, match="contiguous|Triton"):
        adamw_triton.multi_tensor_adamw_([x], [x], [x], [x], None, torch.ones(()), **HYPER)


# --- GPU: the compiled kernel -----------------------------------------------------------------

gpu = needs_cuda_and_triton


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block", [None, 4096])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("signature", list(SIGNATURES))
def test_triton_matches_reference_cuda(signature, option, block):
    check_triton_against_reference(signature, option, block, "cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("signature", list(SIGNATURES))
def test_triton_reads_a_device_learning_rate_cuda(signature):
    check_triton_against_reference(signature, "grad_scale", None, "cuda", lr_on_device=True)


@pytest.mark.gpu
@gpu
def test_triton_unaligned_views_cuda():
    check_unaligned_views("cuda")


@pytest.mark.gpu
@gpu
def test_triton_tensor_past_2_pow_31_elements_cuda():
    """Element offsets past int32 (bf16 signature: about 17 GB). The update is elementwise, so
    the reference runs on the slices that matter: the start, around 2**31 and the tail."""
    from moetrain.kernels.adamw_triton import multi_tensor_adamw_

    n = 2**31 + 4097
    state = {k: [torch.empty(n, dtype=torch.bfloat16, device="cuda")] for k in KEYS[:4]}
    state["masters"] = None
    for key, t in zip(KEYS[:4], (1.0, 1e-2, 1e-3, 1e-5), strict=True):
        state[key][0].normal_(generator=torch.Generator("cuda").manual_seed(8)).mul_(t)
    state["exp_avg_sqs"][0].abs_()
    windows = [slice(0, 5000), slice(2**31 - 3000, 2**31 + 3000), slice(n - 5000, n)]
    ref = [{k: None if v is None else [v[0][w].clone()] for k, v in state.items()} for w in windows]
    step = torch.tensor(2.0, device="cuda")
    call(multi_tensor_adamw_, state, step)
    for window, r in zip(windows, ref, strict=True):
        call(adamw_reference_, r, step)
        out = {k: None if v is None else [v[0][window]] for k, v in state.items()}
        assert_matches(out, r)
