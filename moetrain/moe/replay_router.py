"""Replayed routing: each forward's experts read from a recording instead of chosen by score.

Letters: N recorded forwards, T tokens, E experts, K top-k.
`ReplayRouter` is a `TopKRouter` whose `select` returns forward n's recorded ids `routes_NTK[n]`
(any integer dtype, on the device the model runs on) and their routes per expert. Its weights
are still the scores at those experts and its losses the router's, so the gate trains as it
would have with that choice. The forward counter is the module's own state, a CPU int64 tensor
returned as its extra state (a checkpoint carries it; a resumed run reads on where the unbroken
run would), and a recompute takes its forward's index again (moe/recompute.py). Evaluation
(eval mode) routes by score and counts nothing. Past the last
recorded forward it raises, or with `wrap` starts again from the first (benchmarks).
"""

from __future__ import annotations

import torch

from moetrain.moe.recompute import forward_value
from moetrain.moe.router import RouterConfig, TopKRouter


class ReplayRouter(TopKRouter):
    def __init__(
        self, d_model: int, config: RouterConfig, routes_NTK: torch.Tensor, *, wrap: bool = False
    ) -> None:
        super().__init__(d_model, config)
        assert routes_NTK.dim() == 3 and routes_NTK.shape[2] == config.top_k
        # a plain attribute, not a buffer: materializing a meta model (to_empty) keeps it
        self.routes_NTK = routes_NTK
        self.wrap = wrap
        self._forwards = torch.zeros((), dtype=torch.int64, device="cpu")

    def select(self, scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.training:  # evaluation routes by score and leaves the counter alone
            return super().select(scores_TE)
        ids_TK = self._recorded(scores_TE.shape[0]).to(device=scores_TE.device, dtype=torch.int64)
        flat = ids_TK.reshape(-1)
        counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        return ids_TK, counts_E.scatter_add_(0, flat, torch.ones_like(flat))

    @torch.compiler.disable  # host work: the counter picks the recorded forward
    def _recorded(self, num_tokens: int) -> torch.Tensor:
        N, T, _ = self.routes_NTK.shape
        if num_tokens != T:
            raise ValueError(
                f"replayed routes hold {T} tokens a forward, this forward routes {num_tokens} "
                "(train.micro_batch_size x train.seq_len must be the recorded run's)"
            )
        n = forward_value(self._next_forward)
        if n >= N and not self.wrap:
            raise RuntimeError(
                f"replayed routes hold {N} forwards; forward {n} has no recorded routes "
                "(train.steps past the recording, or more micro-batches a step than recorded)"
            )
        return self.routes_NTK[n % N]

    def _next_forward(self) -> int:
        n = int(self._forwards)
        self._forwards += 1
        return n

    @property
    def forwards(self) -> int:
        """Forwards replayed so far (not counting recomputes)."""
        return int(self._forwards)

    def get_extra_state(self) -> torch.Tensor:
        return self._forwards

    def set_extra_state(self, state: torch.Tensor) -> None:
        self._forwards.copy_(state)

    def reset_buffers(self) -> None:
        super().reset_buffers()
        self._forwards.zero_()
