"""A one-process `NoSyncDispatcher` transport whose exchange runs where NCCL's would: a device
copy on a side stream with the two device-side waits NCCL's stream gets, so the overlapped MoE
layer has on one GPU the stream structure it has on many (for the CUDA stream sanitizer and
benchmarks). `stand_in(send_RD)`, if given, runs on the side stream after the copy, taking what
the real exchange would of the link (benchmarks/overlap.py). On the CPU the copy runs at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetrain.moe.payload import BF16_PAYLOAD, Payload
from moetrain.parallel.comm import AsyncExchange, Wait


class LoopbackTransport:
    def __init__(self, stand_in: Callable[[torch.Tensor], None] | None = None) -> None:
        self.stand_in = stand_in
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def exchange(self, send_RD: torch.Tensor, payload: Payload = BF16_PAYLOAD) -> torch.Tensor:
        return self.begin(send_RD, payload).end()

    def begin(self, send_RD: torch.Tensor, payload: Payload = BF16_PAYLOAD) -> AsyncExchange:
        return AsyncExchange(None, payload=payload, launch=self._launch).begin(send_RD)

    def _launch(self, out: torch.Tensor, x: torch.Tensor, recv_splits, send_splits) -> Wait:
        assert recv_splits is None and send_splits is None, "a group of one: equal blocks"
        if x.device.type != "cuda":
            out.copy_(x)
            if self.stand_in is not None:
                self.stand_in(x)
            return lambda: None
        # created once per device (on first use: before any CUDA-graph capture, in warm-up)
        side = self._streams.setdefault(x.device, torch.cuda.Stream(x.device))
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            out.copy_(x)
            if self.stand_in is not None:
                self.stand_in(x)
        x.record_stream(side)  # the allocator must not reuse them before the copy is done
        out.record_stream(side)
        done = torch.cuda.Event()
        done.record(side)
        return lambda: torch.cuda.current_stream(x.device).wait_event(done)
