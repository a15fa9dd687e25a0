"""Random routing (`moe.routing: random`, a benchmark mode): each token's experts drawn uniformly
at random instead of chosen by score, as the reference system was measured.

Letters: T tokens, E experts, K top-k.
`RandomRouter` is a `TopKRouter` whose `select` draws K distinct experts per token (the top-k of
uniform noise) from a device generator seeded by (seed, draw number), one draw per forward. Its
weights are still the scores at the drawn experts and its losses the router's, so compute and
gradients keep their shape. The draw counter is the module's own state: a CPU int64 tensor (read
on the host: seeding needs no device read) returned as its extra state, so a checkpoint carries
it (DCP loads into it in place) and a resumed run draws what the unbroken run would. A recompute
takes its forward's draw number again (moe/recompute.py).
"""

from __future__ import annotations

import torch

from moetrain.kernels.topk import route_topk
from moetrain.moe.recompute import forward_value
from moetrain.moe.router import RouterConfig, TopKRouter


class RandomRouter(TopKRouter):
    def __init__(self, d_model: int, config: RouterConfig, *, seed: int = 0) -> None:
        super().__init__(d_model, config)
        self.seed = seed
        self._generator: torch.Generator | None = None
        # on the CPU whatever device the model is built on or moved to: not a buffer
        self._draws = torch.zeros((), dtype=torch.int64, device="cpu")

    def select(self, scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        generator = self._draw_rng(scores_TE.device)
        noise_TE = torch.rand(scores_TE.shape, device=scores_TE.device, generator=generator)
        return route_topk(noise_TE, self.top_k)

    @torch.compiler.disable  # host work: the counter, the generator's seed
    def _draw_rng(self, device: torch.device) -> torch.Generator:
        """The generator for this forward's experts, seeded by (seed, draw number); a recompute
        reuses its forward's draw number."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        draw = forward_value(self._next_draw)
        self._generator.manual_seed(self.seed * 1_000_003 + draw)
        return self._generator

    def _next_draw(self) -> int:
        draw = int(self._draws)
        self._draws += 1
        return draw

    @property
    def draws(self) -> int:
        """The draws so far (forwards that were not recomputes)."""
        return int(self._draws)

    @draws.setter
    def draws(self, value: int) -> None:
        self._draws.fill_(value)

    def get_extra_state(self) -> torch.Tensor:
        return self._draws

    def set_extra_state(self, state: torch.Tensor) -> None:
        self._draws.copy_(state)

    def reset_buffers(self) -> None:
        super().reset_buffers()
        self._generator = None
        self._draws.zero_()
