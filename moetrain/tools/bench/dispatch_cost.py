"""What the expert-parallel dispatchers add to a rank's step beyond the one-device permutation
of the projection's rank model (bench/balanced.py), measured on one GPU at a rank's shapes.

- Index work: NoSyncDispatcher's dispatch and combine, forward and backward, at G ranks of T
  tokens, against BalancedDispatcher's, compiled on the GPU as the step runs them. Collectives are stand-ins (every rank's counts are this
  rank's; the blocks come back unchanged): real shapes and index work, nothing sent.
- Host sync: the exact-split dispatcher's split-size read, once per MoE layer forward, costed as
  the GPU's idle time: two layer-length products with a small read between them, against without.
"""

from __future__ import annotations

import time
from unittest import mock

import torch

from moetrain.config import RunConfig
from moetrain.moe.router import RoutingResult
from moetrain.parallel import ep_dispatch
from moetrain.tools.bench.balanced import BalancedDispatcher
from moetrain.tools.bench.timing import kernel_ms


class _Loopback:
    """NoSync's transport with nothing sent: this rank's blocks come back as they are."""

    def exchange(self, send_RD: torch.Tensor, payload: str = "bf16") -> torch.Tensor:
        return send_RD


def _routing(tokens: int, top_k: int, num_experts: int, device) -> RoutingResult:
    probs = torch.rand(tokens, num_experts, device=device).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    zero = torch.zeros((), device=device)
    return RoutingResult(ids, weights, counts, probs, zero, zero)


def index_work_s(
    config: RunConfig,
    ep: int,
    capacity_factor: float,
    device: torch.device,
    compiled: bool | None = None,
) -> tuple[float, float]:
    """(BalancedDispatcher, NoSync stand-in) seconds of one MoE layer's dispatch and combine,
    forward and backward, for one micro-batch of the config at expert-parallel degree `ep`;
    `compiled` (default: on CUDA, as the step runs them) under torch.compile, dispatch and
    combine each one compiled region."""
    T = config.train.micro_batch_size * config.train.seq_len
    K, E, D = config.moe.top_k, config.moe.num_experts, config.model.d_model
    x = torch.randn(T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    routing = _routing(T, K, E, device)
    no_sync = ep_dispatch.NoSyncDispatcher(
        E, None, 0, capacity_factor, transport=_Loopback(), device=device
    )
    no_sync.num_ranks, no_sync.num_local = ep, E // ep

    def every_rank_alike(counts_E, group, traced=True):
        return counts_E.unsqueeze(0).expand(ep, -1).contiguous()

    def step_of(dispatcher):
        dispatch, combine = dispatcher.dispatch, dispatcher.combine
        if compiled:  # two regions: in the step the experts' GEMMs sit between them
            dispatch, combine = torch.compile(dispatch), torch.compile(combine)

        def step() -> None:
            rows, _, handle = dispatch(x, routing)
            combine(rows, handle).backward(torch.ones_like(x))
            x.grad = None

        return step

    compiled = device.type == "cuda" if compiled is None else compiled
    with mock.patch.object(ep_dispatch, "all_gather_counts", every_rank_alike):
        times = [kernel_ms(step_of(d)) for d in (BalancedDispatcher(E // ep), no_sync)]
    return times[0] / 1e3, times[1] / 1e3


def host_sync_s(config: RunConfig, device: torch.device, repeats: int = 20) -> float:
    """Seconds the GPU idles for one read of split sizes between two layers' work."""
    if device.type != "cuda":
        return 0.0
    n, tokens = config.model.d_model, config.train.micro_batch_size * config.train.seq_len
    a = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)  # a projection's work
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    sizes = torch.zeros(2 * config.parallel.ep + 2, dtype=torch.int64, device=device)

    def run(sync: bool) -> float:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
            if sync:
                sizes.tolist()
            a @ b
        torch.cuda.synchronize(device)
        return time.perf_counter() - start

    run(True)
    return max(
        0.0, (min(run(True) for _ in range(3)) - min(run(False) for _ in range(3))) / repeats
    )
