"""Loss-spike detection on the device: a step is a spike when its loss exceeds
``mean + sigma * std`` (population std) of the last `window` applied steps' losses, once the
window is full; the trainer skips it like a non-finite step. Only applied steps enter the window,
so a lasting jump is skipped until `train.max_bad_steps` stops the run. No host sync; the window
travels in checkpoints so resumed runs decide alike.
"""

from __future__ import annotations

from typing import Any

import torch


class LossSpikeDetector:
    def __init__(self, sigma: float, window: int, device: torch.device) -> None:
        if sigma <= 0 or window < 2:
            raise ValueError(f"sigma ({sigma}) must be > 0 and window ({window}) >= 2")
        self.sigma, self.window = float(sigma), int(window)
        self.losses_W = torch.zeros(window, device=device)  # a ring: slot = count % window
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # losses recorded

    def is_spike(self, loss: torch.Tensor) -> torch.Tensor:
        """Device bool: `loss` is finite and above the band of the window (always false until the
        window is full; a non-finite loss is the trainer's other skip reason, not a spike)."""
        loss = loss.float()
        std, mean = torch.std_mean(self.losses_W, correction=0)
        above = loss > mean + self.sigma * std
        return (self.count >= self.window) & above & torch.isfinite(loss)

    def record(self, loss: torch.Tensor, applied: torch.Tensor) -> None:
        """Add `loss` to the window where the device bool `applied` is true."""
        slot_1 = (self.count % self.window).view(1)
        old_1 = self.losses_W.index_select(0, slot_1)
        self.losses_W.index_copy_(0, slot_1, torch.where(applied, loss.float(), old_1))
        self.count += applied.long()

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (read once, at checkpoint time): float32 -> float is exact."""
        return {"losses": self.losses_W.tolist(), "count": int(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A window of another length (train.spike_window changed on resume) is not restored:
        the window starts empty and detection resumes once it has filled again."""
        losses = state["losses"]
        if len(losses) != self.window:
            return
        self.losses_W.copy_(torch.tensor(losses, dtype=self.losses_W.dtype))
        self.count.fill_(int(state["count"]))
