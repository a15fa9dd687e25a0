"""Checkpoints: torch.distributed.checkpoint (DCP) directories, written atomically, verified on load."""
