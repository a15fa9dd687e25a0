"""Differentiable collectives for expert parallelism, and the counts exchanges that feed them.

Letters: R rows, D model dim, E experts, G ranks in the group. `all_to_all` (exact splits),
`exchange_blocks` (equal splits) and `AsyncExchange` (the same in two halves, for
moe.overlap=two_chunk: docs/design.md "Overlap") move rows with autograd; `sink_rows` zero rows
appended to the output catch padding, and `payload` says what the rows travel as (moe/payload.py:
FP8_PAYLOAD sends them FP8-quantized, the gradient returning unquantized). The counts exchanges carry no gradient. `group=None` is a
group of one (world size 1 runs the same code); nothing reads device values on the host.

Under torch.compile the static-shape ones (`exchange_blocks`, `all_gather_counts`,
`all_reduce_counts`) switch to torch's functional collectives, which go into the graph; the
exact-split ones stay eager, and so does gloo with CUDA tensors (`traceable`): there the compiled
NoSync block segfaulted its rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup

from moetrain.dist_compat import all_gather_flat, functional_all_gather, group_size
from moetrain.moe.payload import BF16_PAYLOAD, Payload


@torch.compiler.disable
def all_to_all(
    x_RD: torch.Tensor,
    group: ProcessGroup | None,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    sink_rows: int = 0,
    payload: Payload = BF16_PAYLOAD,
) -> torch.Tensor:
    """Differentiable all_to_all_single over dim 0 (split sizes None: equal splits); rows
    arrive decoded in x's dtype. A group of one with no sink rows returns what the payload loops
    back (the input as is, in bf16)."""
    if group is None and sink_rows == 0:
        return payload.loop_back(x_RD)
    exchange = AsyncExchange(
        group, output_split_sizes, input_split_sizes, sink_rows=sink_rows, payload=payload
    )
    return exchange.begin(x_RD).end()


# Launch(out, x, recv_splits, send_splits) starts moving x's rows into out and returns the wait:
# a call that orders the current stream after the movement (a GPU-side wait; gloo's on the host).
Wait = Callable[[], None]
Launch = Callable[[torch.Tensor, torch.Tensor, list[int] | None, list[int] | None], Wait]


def _launch_collective(group: ProcessGroup | None) -> Launch:
    def launch(out, x, recv_splits, send_splits) -> Wait:
        if group is None:
            assert recv_splits == send_splits, "a group of one sends to itself"
            out.copy_(x)
            return lambda: None
        # NCCL runs it on its own stream; work.wait() makes the current stream wait for it
        return dist.all_to_all_single(
            out, x, recv_splits, send_splits, group=group, async_op=True
        ).wait

    return launch


class AsyncExchange:
    """One `all_to_all` in two halves: `begin(x_RD)` launches it; `end()` orders the current
    stream after it and returns what `all_to_all` returns. With NCCL neither half waits on the
    host; gloo waits in `end`. `launch` replaces the collective (parallel/loopback.py). One object
    per exchange.

    Differentiable, overlapped the same way: `end`'s backward launches the reverse exchange and
    `begin`'s waits for it. Autograd runs ready nodes in reverse forward order, so the backward of
    whatever ran between the halves runs under the exchange. Only the in-flight buffers live
    between the halves (no saved activations: activation checkpointing stays effective)."""

    def __init__(
        self,
        group: ProcessGroup | None,
        recv_splits: list[int] | None = None,
        send_splits: list[int] | None = None,
        *,
        sink_rows: int = 0,
        payload: Payload = BF16_PAYLOAD,
        launch: Launch | None = None,
    ) -> None:
        self.splits, self.sink_rows = (recv_splits, send_splits), sink_rows
        self.payload = payload
        self.launch = launch if launch is not None else _launch_collective(group)
        self.dtype: torch.dtype | None = None
        self._token = self._out = self._wait = None

    @torch.compiler.disable
    def begin(self, x_RD: torch.Tensor) -> AsyncExchange:
        self._token = _Begin.apply(x_RD, self)
        return self

    @torch.compiler.disable
    def end(self) -> torch.Tensor:
        token, self._token = self._token, None  # the token's graph must not outlive the exchange
        return _End.apply(token, self)

    def _start(self, x_RD: torch.Tensor, reverse: bool) -> None:
        recv, send = self.splits[::-1] if reverse else self.splits
        sink = 0 if reverse else self.sink_rows
        rows = x_RD.shape[0] if recv is None else sum(recv)
        self._out = x_RD.new_empty((rows + sink, *x_RD.shape[1:]))
        self._out[rows:].zero_()
        self._wait = self.launch(self._out[:rows], x_RD.contiguous(), recv, send)

    def _finish(self) -> torch.Tensor:
        self._wait()
        out, self._out, self._wait = self._out, None, None
        return out


class _Begin(torch.autograd.Function):
    """Launches the exchange; returns an empty token that orders `_End` after it."""

    @staticmethod
    def forward(ctx, x_RD, exchange):  # type: ignore[override]
        ctx.exchange = exchange
        exchange.dtype = x_RD.dtype
        exchange._start(exchange.payload.encode(x_RD), False)
        return x_RD.new_empty(0)

    @staticmethod
    def backward(ctx, _):  # type: ignore[override]
        return ctx.exchange._finish(), None


class _End(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, exchange):  # type: ignore[override]
        ctx.exchange = exchange
        out = exchange._finish()
        return exchange.payload.decode(out, exchange.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        exchange = ctx.exchange
        exchange._start(grad_out[: grad_out.shape[0] - exchange.sink_rows], True)
        return grad_out.new_empty(0), None


def traceable(group: ProcessGroup | None, device: torch.device | str | None) -> bool:
    """Whether collectives of `group` on `device` run as functional collectives under compile:
    yes, but for gloo with CUDA tensors (module docstring). Decided on the host, once."""
    if group is None or device is None or torch.device(device).type != "cuda":
        return True
    return dist.get_backend(group) != "gloo"


def exchange_blocks(
    x_RD: torch.Tensor,
    group: ProcessGroup | None,
    sink_rows: int = 0,
    payload: Payload = BF16_PAYLOAD,
    traced: bool = True,
) -> torch.Tensor:
    """`all_to_all` with equal splits (G blocks of R / G rows, block g for rank g); under
    torch.compile on functional collectives, in the graph (unless not `traced`). Same values,
    gradients and sink rows either way."""
    if not (traced and torch.compiler.is_compiling()):
        return all_to_all(x_RD, group, sink_rows=sink_rows, payload=payload)
    if group is None:
        x_RD = payload.loop_back(x_RD)
    else:
        x_RD = _FunctionalAllToAll.apply(x_RD, group, payload)
    if sink_rows == 0:
        return x_RD
    return torch.cat([x_RD, x_RD.new_zeros(sink_rows, *x_RD.shape[1:])])


def _functional_exchange(x_RD: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single(x_RD.contiguous(), None, None, group))


class _FunctionalAllToAll(torch.autograd.Function):
    """Equal-split all-to-all on functional collectives; backward: the same exchange of the
    gradient (equal splits are their own reverse), in the activations' dtype (fp8:
    straight-through)."""

    @staticmethod
    def forward(ctx, x_RD, group, payload):  # type: ignore[override]
        ctx.group = group
        packed = _functional_exchange(payload.encode(x_RD), group)
        return payload.decode(packed, x_RD.dtype)

    @staticmethod
    def backward(ctx, grad_RD):  # type: ignore[override]
        return _functional_exchange(grad_RD, ctx.group), None, None


def all_gather_counts(
    counts_E: torch.Tensor, group: ProcessGroup | None, traced: bool = True
) -> torch.Tensor:
    """[G, E]: row g is rank g's count vector (the rank order of the group). Traceable (unless
    `traced` is False)."""
    if group is None:
        return counts_E.unsqueeze(0)
    if traced and torch.compiler.is_compiling():
        gathered = functional_all_gather(counts_E.detach().contiguous(), 0, group)
        return gathered.view(group_size(group), -1)
    return _all_gather_counts_eager(counts_E, group)


@torch.compiler.disable
@torch.no_grad()
def _all_gather_counts_eager(counts_E: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out_GE = counts_E.new_empty(group_size(group), counts_E.shape[0])
    all_gather_flat(out_GE.view(-1), counts_E.contiguous(), group=group)
    return out_GE


@torch.compiler.disable
@torch.no_grad()
def all_to_all_counts(counts_E: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Rank r sends slice r of its count vector to rank r. Returns [G, E / G]: row g is the
    slice rank g sent here."""
    size = group_size(group)
    if group is None:
        return counts_E.view(1, -1)
    out_GE = torch.empty_like(counts_E)
    dist.all_to_all_single(out_GE, counts_E.contiguous(), group=group)
    return out_GE.view(size, -1)


def all_reduce_counts(
    counts_E: torch.Tensor, group: ProcessGroup | None, traced: bool = True
) -> torch.Tensor:
    """Route counts summed over the group (a new tensor; the input is left as it is).
    Traceable (unless `traced` is False)."""
    if group is None:
        return counts_E.clone()
    if traced and torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_reduce(counts_E.detach(), "sum", group))
    return _all_reduce_counts_eager(counts_E, group)


@torch.compiler.disable
@torch.no_grad()
def _all_reduce_counts_eager(counts_E: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out_E = counts_E.clone()
    dist.all_reduce(out_E, group=group)
    return out_E
