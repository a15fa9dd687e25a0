"""Single-device building blocks of the transformer. Nothing here imports torch.distributed."""
