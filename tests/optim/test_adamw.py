"""The replicated AdamW: equals torch's clip_grad_norm_ + AdamW, on the foreach and the fused
(grad_scale / found_inf) paths; skipped steps change nothing; fp32 masters for bf16 params."""

import pytest
import torch
from conftest import needs_cuda_and_triton

from moetrain.optim.adamw import AdamW

LR, WD, MAX_NORM = 1e-2, 0.1, 0.5


def _params(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in [(8, 4), (5,), (3, 6)]
    ]


def _ours(params, fused, master_weights=False, kernel="torch"):
    groups = [
        {
            "params": params,
            "param_names": [f"p{i}" for i in range(len(params))],
            "lr_mult": 1.0,
            "weight_decay": WD,
        }
    ]

    def norm_fn():
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    opt = AdamW(
        groups,
        betas=(0.9, 0.95),
        eps=1e-8,
        master_weights=master_weights,
        fused=fused,
        norm_fn=norm_fn,
        kernel=kernel,
    )
    opt.init_state()
    return opt


@pytest.mark.parametrize("fused", [False, True])
def test_matches_torch_clip_and_adamw(fused):
    ours, ref = _params(0), _params(0)
    opt = _ours(ours, fused)
    torch_opt = torch.optim.AdamW(ref, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=g) * 3 for p in ours]
        for p, q, gr in zip(ours, ref, grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        norm = opt.step(LR, MAX_NORM, skip=torch.tensor(False))
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, MAX_NORM)
        torch_opt.step()
        torch.testing.assert_close(norm, ref_norm)
        assert ref_norm > MAX_NORM  # clipping binds
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
def test_skipped_step_changes_nothing(fused):
    params = _params(2)
    opt = _ours(params, fused)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step(LR, MAX_NORM, skip=torch.tensor(False))
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in opt.state_dict()["p0"].items()}
    for p in params:
        p.grad = torch.randn_like(p)
    params[1].grad[0] = float("nan")
    norm = opt.step(LR, MAX_NORM)
    assert not torch.isfinite(norm)
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)
    for k, v in opt.state_dict()["p0"].items():
        assert torch.equal(v, state[k]), k
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step(LR, MAX_NORM, skip=torch.tensor(True))  # a non-finite loss skips too
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_bf16_params_update_through_fp32_masters():
    ours, ref = (
        _params(3, torch.bfloat16),
        [torch.nn.Parameter(p.detach().float()) for p in _params(3, torch.bfloat16)],
    )
    opt = _ours(ours, fused=True, master_weights=True)
    torch_opt = torch.optim.AdamW(ref, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD)
    g = torch.Generator().manual_seed(4)
    for _ in range(20):  # many small updates: bf16-only weights would lose them to rounding
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        for p, q, gr in zip(ours, ref, grads, strict=True):
            p.grad, q.grad = gr.to(torch.bfloat16), gr.to(torch.bfloat16).float()
        opt.step(LR * 0.01, 0.0)
        for group in torch_opt.param_groups:
            group["lr"] = LR * 0.01
        torch_opt.step()
    for p, q, m in zip(ours, ref, opt.masters, strict=True):
        torch.testing.assert_close(m, q, rtol=1e-5, atol=1e-6)
        assert torch.equal(p, q.to(torch.bfloat16))


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize(
    "dtype,masters", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_triton_kernel_matches_torch_fused(dtype, masters):
    """kernel="triton" against torch's fused AdamW through the same wrapper: clipping, a skipped
    step, states and parameters; then a missing gradient falls back to torch with a warning."""
    runs = {}
    for kernel in ("torch", "triton"):
        params = [torch.nn.Parameter(p.detach().cuda()) for p in _params(5, dtype)]
        opt = _ours(params, fused=True, master_weights=masters, kernel=kernel)
        g = torch.Generator().manual_seed(6)
        for step in range(6):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=g) * 3).to(dtype).cuda()
            opt.step(LR, MAX_NORM, skip=torch.tensor(step == 3, device="cuda"))
        runs[kernel] = (params, opt.state_dict())
    (p_torch, s_torch), (p_triton, s_triton) = runs["torch"], runs["triton"]
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
    for a, b in zip(p_triton, p_torch, strict=True):
        torch.testing.assert_close(a, b, **tol)
    for name in s_torch:
        for key, value in s_torch[name].items():
            torch.testing.assert_close(s_triton[name][key].float(), value.float(), **tol)
    assert float(s_triton["p0"]["step"]) == 5.0  # the skipped step does not count
    opt = _ours(p_triton, fused=True, master_weights=masters, kernel="triton")
    p_triton[1].grad = None
    p_triton[0].grad = torch.ones_like(p_triton[0])
    p_triton[2].grad = torch.ones_like(p_triton[2])
    with pytest.warns(UserWarning, match="no gradient"):
        opt.step(LR, 0.0)
    assert opt.kernel == "torch"
