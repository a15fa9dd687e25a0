"""Language-model loss: LM head + cross-entropy, chunked so the full logits never exist at once.

`chunked_linear_cross_entropy(h_TD, w_VD, targets_T)` equals
`F.cross_entropy((h_TD @ w_VD.T).float(), targets_T)` (mean over tokens). It walks the tokens in
chunks; for each chunk it forms the fp32 logits, takes the loss and, while the logits are still at
hand, the gradients of h and w (softmax minus one-hot). Backward then only scales the stored
gradients, so the logits are computed once and never stored: peak extra memory is one chunk of
logits plus an fp32 gradient of the head, instead of T x V logits in the activation graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, chunk_size: int):  # type: ignore[override]
        num_tokens = h_TD.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h_TD = torch.empty_like(h_TD) if need_h else None
        acc_dtype = torch.promote_types(h_TD.dtype, torch.float32)  # fp32, or fp64 in tests
        grad_w_VD = torch.zeros(w_VD.shape, dtype=acc_dtype, device=w_VD.device) if need_w else None
        loss_sum = torch.zeros((), dtype=acc_dtype, device=h_TD.device)
        for start in range(0, num_tokens, chunk_size):
            h_CD = h_TD[start : start + chunk_size]
            t_C = targets_T[start : start + chunk_size]
            logits_CV = (h_CD @ w_VD.T).to(acc_dtype)
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            loss_sum += (lse_C - logits_CV.gather(1, t_C[:, None]).squeeze(1)).sum()
            if need_h or need_w:
                # d(mean loss)/d(logits) = (softmax - onehot) / T, computed in place on the logits
                grad_CV = logits_CV.sub_(lse_C[:, None]).exp_()
                grad_CV.scatter_add_(1, t_C[:, None], -torch.ones_like(lse_C)[:, None])
                grad_CV = grad_CV.div_(num_tokens).to(h_TD.dtype)
                if need_h:
                    grad_h_TD[start : start + chunk_size] = grad_CV @ w_VD
                if need_w:
                    grad_w_VD += grad_CV.T @ h_CD
        ctx.save_for_backward(grad_h_TD, grad_w_VD)
        ctx.w_dtype = w_VD.dtype
        return loss_sum / num_tokens

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        grad_h_TD, grad_w_VD = ctx.saved_tensors
        grad_h = grad_h_TD * grad_loss.to(grad_h_TD.dtype) if grad_h_TD is not None else None
        grad_w = (grad_w_VD * grad_loss).to(ctx.w_dtype) if grad_w_VD is not None else None
        return grad_h, grad_w, None, None


def chunked_linear_cross_entropy(
    h_TD: torch.Tensor, w_VD: torch.Tensor, targets_T: torch.Tensor, chunk_size: int = 4096
) -> torch.Tensor:
    """Mean cross-entropy of the logits h_TD @ w_VD.T against targets_T, as an fp32 scalar."""
    return _ChunkedLinearCrossEntropy.apply(h_TD, w_VD, targets_T, chunk_size)


def linear_cross_entropy_reference(
    h_TD: torch.Tensor, w_VD: torch.Tensor, targets_T: torch.Tensor
) -> torch.Tensor:
    """The slow twin: materialize all logits in fp32."""
    return F.cross_entropy((h_TD @ w_VD.T).float(), targets_T)
