"""moe.overlap=two_chunk as a transform: each MoE block runs its micro-batch as two chunks of
sequences, a and b, so that every all-to-all has the other chunk's compute to run under
(docs/design.md "Overlap"):

    compute: attn a | attn b       | experts a  | experts b  | shared a, b |
    links:          | dispatch a   | dispatch b | combine a  | combine b   |

`apply_two_chunk` (a step of the parallelize recipe) replaces each MoE block's forward with
`two_chunk_forward`, which runs the block's parts and the MoE layer's (router, `finish_routing`,
`run_experts`, shared expert) in that order, and the dispatcher in halves (`SplitPhase`): an
`ExpertParallel` dispatcher launches each exchange in one half and waits for it on the device in
the next; any other dispatcher (nothing crosses ranks) does its whole work in the first half.
Losses, gradients and statistics are those of the block's own forward (chunk b's routing carries
both chunks' auxiliary losses and statistics, `_merge`). Autograd runs the backward in reverse
order, so it overlaps the same way (comm.AsyncExchange). No loops in the halves: a graph break
inside a loop makes torch.compile run the whole frame eagerly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from moetrain.config import RunConfig
from moetrain.model.transformer import Block, Transformer
from moetrain.moe.balance import load_balancing_loss
from moetrain.moe.capacity import keeps_every_route
from moetrain.moe.dispatch import Dispatcher
from moetrain.moe.layer import MoELayer
from moetrain.moe.router import RoutingResult
from moetrain.nn.document_mask import DocumentMask
from moetrain.parallel.ep_dispatch import ExpertParallel
from moetrain.parallel.expert import resolve_dispatcher
from moetrain.parallel.mesh import ParallelDims


def apply_two_chunk(model: Transformer, config: RunConfig, dims: ParallelDims) -> None:
    """moe.overlap two_chunk: every MoE block's forward on two chunks (`two_chunk_forward`).
    Refuses the no_sync dispatcher at a capacity factor that drops routes
    (`check_two_chunk_capacity`)."""
    if config.moe.overlap != "two_chunk":
        return
    blocks = [b for b in model.blocks.values() if isinstance(b.ffn, MoELayer)]
    if blocks and resolve_dispatcher(config, dims) == "no_sync":
        check_two_chunk_capacity(config)
    for block in blocks:
        block.forward = two_chunk_forward(block)


def check_two_chunk_capacity(config: RunConfig) -> None:
    """Capacity mode decides each chunk's drops on the chunk's own capacity, half the
    micro-batch's, so the chunks would drop other routes than the whole micro-batch does, against
    the overlap's equivalence with moe.overlap none. Only a factor that drops nothing keeps it."""
    moe = config.moe
    if keeps_every_route(moe.capacity_factor, moe.top_k, moe.num_experts):
        return
    auto = "" if moe.dispatcher == "no_sync" else f" (moe.dispatcher {moe.dispatcher!r}'s pick)"
    raise ValueError(
        f"moe.overlap ('two_chunk') cannot run on the no_sync dispatcher{auto} at "
        f"moe.capacity_factor {moe.capacity_factor!r}: each chunk would get half the "
        "micro-batch's capacity and drop other routes than moe.overlap none. Use the dropless "
        "dispatcher (moe.capacity_factor null), a factor >= moe.num_experts / moe.top_k "
        f"({moe.num_experts / moe.top_k:g}: nothing is dropped), or moe.overlap none"
    )


def two_chunk_forward(block: Block) -> Callable[..., torch.Tensor]:
    """`block`'s forward on two chunks of its micro-batch (its own forward for one sequence), to
    install as the block's forward (names, parameters and the call signature unchanged)."""
    own_forward = block.forward

    @functools.wraps(own_forward)
    def forward(x_BSD: torch.Tensor, documents: DocumentMask | None = None) -> torch.Tensor:
        if x_BSD.shape[0] < 2:
            return own_forward(x_BSD, documents)
        assert documents is None, "the config refuses document masking with moe.overlap"
        return _two_chunks(block, x_BSD)

    return forward


def _two_chunks(block: Block, x_BSD: torch.Tensor) -> torch.Tensor:
    moe, phases = block.ffn, SplitPhase(block.ffn.dispatcher)
    x_a, x_b = x_BSD.tensor_split(2)
    h_a = x_a + block.attn(block.attn_norm(x_a))
    a = _send(moe, phases, block.ffn_norm(h_a))
    h_b = x_b + block.attn(block.attn_norm(x_b))
    b = _send(moe, phases, block.ffn_norm(h_b), first=a)
    _compute(moe, phases, a)
    _compute(moe, phases, b)
    y_a, y_b = _receive(moe, phases, a, b)
    return torch.cat([h_a + y_a, h_b + y_b])


# ---- the MoE layer in halves ------------------------------------------------------------------


@dataclasses.dataclass
class Chunk:
    """A chunk of a micro-batch between the layer's halves."""

    shape: torch.Size  # of the chunk's input (B, S, D)
    x_TD: torch.Tensor
    routing: RoutingResult
    pending: Any  # the dispatch in flight, then the combine


def _send(moe: MoELayer, phases: SplitPhase, x_BSD: torch.Tensor, first: Chunk | None = None):
    """Routes a chunk and launches its dispatch. The micro-batch's second chunk passes the
    first: it carries the auxiliary losses of both (on its router weights) and records the
    statistics of both, so that they are the whole micro-batch's."""
    x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
    routing = moe.router(x_TD)
    if first is not None and moe.training:
        routing = moe.finish_routing(routing, _merge(first.routing, routing))
    return Chunk(x_BSD.shape, x_TD, routing, phases.dispatch_begin(x_TD, routing))


def _compute(moe: MoELayer, phases: SplitPhase, chunk: Chunk) -> None:
    """Waits (on the device) for the chunk's rows, runs the experts, launches the combine."""
    rows_ND, offsets_e, handle = phases.dispatch_end(chunk.pending)
    chunk.pending = phases.combine_begin(moe.run_experts(rows_ND, offsets_e, handle), handle)


def _receive(moe: MoELayer, phases: SplitPhase, a: Chunk, b: Chunk):
    """Both chunks' outputs: the shared expert of each first, under the combines still in
    flight, then the waits."""
    if moe.shared_expert is not None:
        shared_a, shared_b = moe.shared_expert(a.x_TD), moe.shared_expert(b.x_TD)
    y_a, y_b = phases.combine_end(a.pending), phases.combine_end(b.pending)
    if moe.shared_expert is not None:
        y_a, y_b = y_a + shared_a, y_b + shared_b
    return y_a.view(a.shape), y_b.view(b.shape)


def _merge(a: RoutingResult, b: RoutingResult) -> RoutingResult:
    """The routing of a micro-batch from its two chunks', for its losses and statistics: the
    balance loss of all its routes, the z-loss as the mean over all its tokens."""
    probs_TE = torch.cat([a.probs_TE, b.probs_TE])
    counts_E = a.tokens_per_expert_E + b.tokens_per_expert_E
    T_a, T_b = a.probs_TE.shape[0], b.probs_TE.shape[0]
    return RoutingResult(
        expert_ids_TK=torch.cat([a.expert_ids_TK, b.expert_ids_TK]),
        weights_TK=torch.cat([a.weights_TK, b.weights_TK]),
        tokens_per_expert_E=counts_E,
        probs_TE=probs_TE,
        lb_loss=load_balancing_loss(probs_TE, counts_E),
        z_loss=(a.z_loss * T_a + b.z_loss * T_b) / (T_a + T_b),
    )


# ---- the dispatcher in halves -----------------------------------------------------------------


class SplitPhase:
    """`dispatcher`'s dispatch and combine in halves: `*_begin` does the work up to the exchange
    and launches it, `*_end` waits for it on the device and does the rest. Each end returns what
    the whole call returns."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.moves = isinstance(dispatcher, ExpertParallel)

    def dispatch_begin(self, x_TD: torch.Tensor, routing: RoutingResult) -> Any:
        if not self.moves:
            return self.dispatcher.dispatch(x_TD, routing)
        send_RD, handle, offsets_e = self.dispatcher.plan(x_TD, routing)
        return self.dispatcher.launch(send_RD, handle, True), handle, offsets_e

    def dispatch_end(self, pending: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        if not self.moves:
            return pending
        flight, handle, offsets_e = pending
        return self.dispatcher.arrive(flight.end(), handle, offsets_e)

    def combine_begin(self, y_ND: torch.Tensor, handle: Any) -> Any:
        if not self.moves:
            return self.dispatcher.combine(y_ND, handle)
        return self.dispatcher.launch(self.dispatcher.depart(y_ND, handle), handle, False), handle

    def combine_end(self, pending: Any) -> torch.Tensor:
        if not self.moves:
            return pending
        flight, handle = pending
        return self.dispatcher.weighted_sum(flight.end(), handle)
