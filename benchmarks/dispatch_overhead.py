"""Each dispatcher's own time per MoE layer (dispatch + combine, forward and backward), with the
transport taken out, at ep = 1, 2, 4, 8, against the LocalDispatcher.

    python benchmarks/dispatch_overhead.py --preset olmoe-1b-7b [--ep 2 4 8] [--capacity 1.25]

One process plays one rank of an ep group whose ranks all route alike: the count exchanges
return this rank's counts as every rank's, and the row exchanges return a buffer of the right
shape without moving bytes (an allocation from the caching allocator), in both directions. So
what is timed is the dispatcher's own work (counts, keep rule, route sort, index arithmetic,
gathers into and out of the send and receive buffers, the weighted combine and their
backwards); the AllToAll dispatcher's host sync on the split sizes stays in (it is its own
work). The experts are an identity. Uniform random routing over E experts, top-K, the preset's
micro-batch of T tokens and width D, bf16, eager (in training the dispatchers' non-collective
parts sit in compiled blocks between graph breaks). Times are medians of `kernel_ms`.
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import torch

from moetrain.bench.timing import kernel_ms
from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.router import RoutingResult
from moetrain.parallel import ep_dispatch
from moetrain.presets import get_preset


class _NoBytes(torch.autograd.Function):
    """A row exchange that moves nothing: `rows` rows of x's width (zeros past `data_rows`)."""

    @staticmethod
    def forward(ctx, x_RD, data_rows, sink_rows):  # type: ignore[override]
        ctx.in_rows = x_RD.shape[0]
        out = x_RD.new_empty((data_rows + sink_rows, *x_RD.shape[1:]))
        out[data_rows:].zero_()
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.new_empty((ctx.in_rows, *grad.shape[1:])), None, None


@contextlib.contextmanager
def simulated_group(ranks: int, me: int):
    """Patch ep_dispatch's collectives: `ranks` ranks that all route like this one."""

    def gather_counts(counts_E, group):
        return counts_E.unsqueeze(0).expand(ranks, -1).contiguous()

    def a2a_counts(counts_E, group):  # rank s sends me slice `me` of its (= my) counts
        return counts_E.view(ranks, -1)[me].unsqueeze(0).expand(ranks, -1).contiguous()

    def a2a(x_RD, group, output_split_sizes=None, input_split_sizes=None, sink_rows=0, payload="bf16"):  # fmt: skip
        rows = x_RD.shape[0] if output_split_sizes is None else sum(output_split_sizes)
        return _NoBytes.apply(x_RD, rows, sink_rows)

    with (
        mock.patch.object(ep_dispatch, "group_size", lambda group: ranks),
        mock.patch.object(ep_dispatch, "all_gather_counts", gather_counts),
        mock.patch.object(ep_dispatch, "all_to_all_counts", a2a_counts),
        mock.patch.object(ep_dispatch, "all_to_all", a2a),
    ):
        yield


def routing(T: int, K: int, E: int, device) -> RoutingResult:
    ids_TK = torch.rand(T, E, device=device).topk(K, dim=-1).indices
    weights_TK = torch.rand(T, K, device=device, dtype=torch.float32).softmax(-1).requires_grad_()
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E)
    zero = torch.zeros((), device=device)
    return RoutingResult(
        expert_ids_TK=ids_TK, weights_TK=weights_TK, tokens_per_expert_E=counts_E,
        probs_TE=torch.empty(0, device=device), lb_loss=zero, z_loss=zero,
    )  # fmt: skip


def layer_ms(dispatcher, x_TD: torch.Tensor, route: RoutingResult) -> float:
    grad_TD = torch.randn_like(x_TD)

    def step():
        x = x_TD.detach().requires_grad_()
        rows, offsets, handle = dispatcher.dispatch(x, route)
        weights = getattr(handle, "row_weights_N", None)
        y = rows if weights is None else rows * weights[:, None].to(rows.dtype)
        dispatcher.combine(y, handle).backward(grad_TD)

    return kernel_ms(step, reps=20, warmup=3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="olmoe-1b-7b")
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--capacity", type=float, default=1.25)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    config = get_preset(args.preset)
    device = torch.device(args.device)
    t, moe = config.train, config.moe
    T, K, E, D = t.micro_batch_size * t.seq_len, moe.top_k, moe.num_experts, config.model.d_model
    torch.manual_seed(0)
    x_TD = torch.randn(T, D, device=device, dtype=torch.bfloat16)
    route = routing(T, K, E, device)
    print(f"{args.preset}: T={T} K={K} E={E} D={D}; per layer, forward + backward, transport out")
    local = layer_ms(LocalDispatcher(), x_TD, route)
    print(f"| ep | dispatcher | ms per layer | vs local |\n|---|---|---|---|\n| 1 | local | {local:.3f} | 1.00x |")  # fmt: skip
    for ep in args.ep:
        with simulated_group(ep, me=0):
            kinds = {
                "all_to_all (dropless)": ep_dispatch.AllToAllDispatcher(E, object()),
                f"no_sync (cf {args.capacity})": ep_dispatch.NoSyncDispatcher(
                    E,
                    object(),
                    0,
                    capacity_factor=args.capacity,
                    transport=ep_dispatch.AllToAllTransport(object()),  # fmt: skip
                ),
            }
            for name, dispatcher in kinds.items():
                ms = layer_ms(dispatcher, x_TD, route)
                print(f"| {ep} | {name} | {ms:.3f} | {ms / local:.2f}x |")


if __name__ == "__main__":
    main()
