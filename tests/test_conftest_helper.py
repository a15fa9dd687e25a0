import torch
import torch.distributed as dist
from conftest import run_distributed


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_run_distributed_all_reduce():
    assert run_distributed(_all_reduce_rank, 2) == [3.0, 3.0]
