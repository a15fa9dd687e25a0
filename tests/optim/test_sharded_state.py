"""ShardState (optim/sharded_state.py) in one process: the boxes of a flat range, and DCP saving
one layout's chunks and loading them into another layout, a plain global tensor, or back into a
ShardedAdamW at world size 1 (no process group)."""

from __future__ import annotations

import io
import itertools
import math
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from moetrain.optim.sharded import ShardedAdamW
from moetrain.optim.sharded_state import ShardState, flat_range_boxes, shard_state


@pytest.fixture(autouse=True)
def _no_process_group_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2)])
def test_flat_range_boxes_cover_the_range_in_order(shape):
    numel = math.prod(shape)
    for lo, hi in itertools.combinations(range(numel + 1), 2):
        boxes = list(flat_range_boxes(shape, lo, hi))
        assert len(boxes) <= 2 * len(shape) - 1
        covered = []
        for offsets, sizes in boxes:
            index = torch.arange(numel).view(shape)
            box = index[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
            covered += box.reshape(-1).tolist()
        assert covered == list(range(lo, hi)), (lo, hi, boxes)


def _state(shape, cuts, buffer):
    """A ShardState holding the ranges [cuts[i], cuts[i + 1]) of the flattened `shape`, as the
    ranks of one layout would (here all in one process: DCP without a process group writes one
    state dict as the whole world's), on `buffer`, the flat tensor."""
    return shard_state(shape, buffer, [(lo, lo, hi) for lo, hi in itertools.pairwise(cuts)])


def test_dcp_reshards_between_layouts_and_into_a_plain_tensor(tmp_path):
    shape = (4, 6, 5)
    full = torch.randn(shape)
    saved = _state(shape, [0, 17, 61, 62, 120], full.reshape(-1).clone())
    assert len(saved.chunks()) > 4  # ranges that start and end inside rows: several boxes each
    dcp.save({"x": saved}, checkpoint_id=tmp_path)
    buffer = torch.zeros(full.numel())
    dcp.load({"x": _state(shape, [0, 30, 31, 90, 120], buffer)}, checkpoint_id=tmp_path)
    assert torch.equal(buffer, full.reshape(-1))
    plain = {"x": torch.zeros(shape)}
    dcp.load(plain, checkpoint_id=tmp_path)
    assert torch.equal(plain["x"], full)


def _optimizer(seed: int) -> tuple[nn.Module, ShardedAdamW]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    groups = [
        {
            "params": list(model.parameters()),
            "param_names": [n for n, _ in model.named_parameters()],
            "kind": "dense",
            "weight_decay": 0.1,
            "lr_mult": 1.0,
        }
    ]
    optimizer = ShardedAdamW(groups, dense_group=None, expert_group=None, lr=1e-2, bucket_mb=0.0005)
    for _ in range(2):
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _plain(optimizer: ShardedAdamW) -> dict:
    """The state as plain global tensors (at world size 1 the chunks cover every element)."""
    out = {}
    for name, entry in optimizer.state_dict()["state"].items():
        out[name] = {}
        for key, value in entry.items():
            full = torch.zeros(value.shape)
            for offsets, data in value.chunks():
                box = tuple(slice(o, o + n) for o, n in zip(offsets, data.shape, strict=True))
                full[box] = data
            out[name][key] = full
    return {"step": optimizer.state_dict()["step"], "state": out}


def test_world_size_one_round_trips_through_dcp_and_plain_tensors(tmp_path):
    model, optimizer = _optimizer(0)
    assert len(optimizer.buckets) > 1
    dcp.save({"optim": optimizer.state_dict()}, checkpoint_id=tmp_path)
    want = _plain(optimizer)

    other_model, other = _optimizer(1)  # other weights and moments, loaded over
    state = {"optim": other.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path)
    other.load_state_dict(state["optim"])
    assert _plain(other)["step"] == want["step"] == 2
    for name, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(_plain(other)["state"][name][key], value), (name, key)
    for p, q in zip(model.parameters(), other_model.parameters(), strict=True):
        assert torch.equal(p, q)

    third_model, third = _optimizer(2)  # the global form, as plain tensors, loads too
    third.load_state_dict(want)
    for p, q in zip(model.parameters(), third_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_shard_state_is_not_pickled_nor_taken_from_another_layout():
    _, optimizer = _optimizer(0)
    with pytest.raises(TypeError, match="torch.distributed.checkpoint"):
        torch.save(optimizer.state_dict(), io.BytesIO())
    state = optimizer.state_dict()
    weight = state["state"]["0.weight"]["exp_avg"]
    assert isinstance(weight, ShardState)
    state["state"]["0.weight"]["exp_avg"] = _state(
        weight.shape, [0, 7, weight.numel()], torch.zeros(weight.numel())
    )
    with pytest.raises(ValueError, match="another layout"):
        optimizer.load_state_dict(state)
