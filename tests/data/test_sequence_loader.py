import json

import numpy as np
import pytest
import torch

import moetrain.data.loader as loader_module
from moetrain.config import DataConfig
from moetrain.data import RandomTokenLoader, SequenceLoader, open_data, prepare

SEQ = 16


def take(loader, n):
    return [next(loader) for _ in range(n)]


def window_ids(inputs_BS: torch.Tensor) -> list[int]:
    """With tokens = arange, the first input token of a window identifies it."""
    assert torch.all(inputs_BS[:, 0] % SEQ == 0)
    return (inputs_BS[:, 0] // SEQ).tolist()


@pytest.fixture
def stream():
    return np.arange(SEQ * 50 + 5, dtype=np.uint32)  # 50 windows, plus a few spare tokens


def test_batches_are_windows_of_the_stream(stream):
    loader = SequenceLoader(stream, SEQ, 4, seed=0)
    for inputs, targets in take(loader, 20):
        assert inputs.shape == targets.shape == (4, SEQ)
        assert inputs.dtype == targets.dtype == torch.int64 and inputs.device.type == "cpu"
        assert inputs.is_contiguous() and targets.is_contiguous()
        for row_in, row_tg, w in zip(inputs, targets, window_ids(inputs), strict=True):
            assert row_in.tolist() == stream[w * SEQ : w * SEQ + SEQ].tolist()
            assert row_tg.tolist() == stream[w * SEQ + 1 : w * SEQ + SEQ + 1].tolist()


def test_windows_match_a_random_raw_stream():
    tokens = np.random.default_rng(1).integers(0, 257, 2000).astype(np.uint16)
    loader = SequenceLoader(tokens, SEQ, 3, seed=5)
    windows = {tuple(tokens[i * SEQ : i * SEQ + SEQ + 1]): i for i in range(loader.num_windows)}
    for inputs, targets in take(loader, 10):
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        for row_in, row_tg in zip(inputs, targets, strict=True):
            assert tuple(row_in.tolist() + row_tg[-1:].tolist()) in windows


def test_epoch_visits_every_window_once_and_drops_the_partial_batch(stream):
    loader = SequenceLoader(stream, SEQ, 4, seed=3, world_size=2)  # global batch 8 of 50 windows
    assert loader.num_windows == 50 and loader.batches_per_epoch == 6
    seen = [w for inputs, _ in take(loader, 6) for w in window_ids(inputs)]
    assert len(seen) == len(set(seen)) == 24  # this rank's half of 48 windows
    assert loader.state_dict() == {"epoch": 1, "windows": 0}


def test_deterministic_given_seed(stream):
    a = take(SequenceLoader(stream, SEQ, 4, seed=7), 15)
    b = take(SequenceLoader(stream, SEQ, 4, seed=7), 15)
    c = take(SequenceLoader(stream, SEQ, 4, seed=8), 15)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c, strict=True))


def test_ranks_split_the_global_batch(stream):
    world, batch = 4, 2
    single = SequenceLoader(stream, SEQ, world * batch, seed=11)
    ranks = [
        SequenceLoader(stream, SEQ, batch, seed=11, rank=r, world_size=world) for r in range(world)
    ]
    assert single.batches_per_epoch == ranks[0].batches_per_epoch == 6
    for _ in range(14):  # crosses two epoch boundaries
        expected, _ = next(single)
        parts = [window_ids(next(rank)[0]) for rank in ranks]
        flat = [w for part in parts for w in part]
        assert len(set(flat)) == len(flat)  # disjoint
        assert flat == window_ids(expected)  # and together the single process' batch


def test_resume_is_bitwise_across_an_epoch_boundary(stream):
    original = SequenceLoader(stream, SEQ, 4, seed=2, rank=1, world_size=2)
    bpe = original.batches_per_epoch
    take(original, bpe - 2)
    state = original.state_dict()
    assert json.loads(json.dumps(state)) == state == {"epoch": 0, "windows": (bpe - 2) * 8}
    expected = take(original, 5)
    resumed = SequenceLoader(stream, SEQ, 4, seed=2, rank=1, world_size=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for (x, y), (rx, ry) in zip(expected, take(resumed, 5), strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    assert resumed.state_dict() == original.state_dict() == {"epoch": 1, "windows": 3 * 8}
    # A whole epoch consumed is accepted and means the start of the next epoch.
    resumed.load_state_dict({"epoch": 0, "windows": bpe * 8})
    assert resumed.state_dict() == {"epoch": 1, "windows": 0}


def test_resume_under_another_world_and_batch_size(stream):
    """The position is counted in windows, so 2 ranks x 4 can continue as 1 rank x 8 or 4 x 2."""
    two = [SequenceLoader(stream, SEQ, 4, seed=3, rank=r, world_size=2) for r in range(2)]
    for loader in two:
        take(loader, 3)
    state = two[0].state_dict()
    expected = torch.cat([next(loader)[0] for loader in two])
    one = SequenceLoader(stream, SEQ, 8, seed=3)
    one.load_state_dict(state)
    assert torch.equal(next(one)[0], expected)
    odd = SequenceLoader(stream, SEQ, 5, seed=3)
    with pytest.raises(ValueError, match="not a multiple of this run's global batch of 5"):
        odd.load_state_dict(state)


def test_bad_arguments(stream):
    with pytest.raises(ValueError, match=r"seq_len \+ 1 = 1001 tokens.* 1 x 2 = 2 windows"):
        SequenceLoader(np.arange(1500), 1000, 2, seed=0)
    with pytest.raises(ValueError, match=r"holds 805 tokens"):
        SequenceLoader(stream, SEQ, 20, seed=0, world_size=4)
    with pytest.raises(ValueError, match=r"rank \(4\) must be in \[0, world_size \(4\)\)"):
        SequenceLoader(stream, SEQ, 1, seed=0, rank=4, world_size=4)
    with pytest.raises(ValueError, match=r"seq_len \(0\) must be a positive integer"):
        SequenceLoader(stream, 0, 1, seed=0)
    loader = SequenceLoader(stream, SEQ, 4, seed=0)
    with pytest.raises(ValueError, match="must hold ints 'epoch'"):
        loader.load_state_dict({"step": 3})
    with pytest.raises(ValueError, match=r"windows \(1000\) must be in \[0, 50\]"):
        loader.load_state_dict({"epoch": 0, "windows": 1000})


def test_random_token_loader():
    loader = RandomTokenLoader(16, 32, 8, seed=4, rank=1)
    batches = take(loader, 50)
    for inputs, targets in batches:
        assert inputs.shape == (8, 32) and inputs.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
    ids = torch.cat([x.flatten() for x, _ in batches])
    assert ids.min() >= 0 and ids.max() < 16
    counts = torch.bincount(ids, minlength=16).double()
    assert (counts / counts.mean() - 1).abs().max() < 0.1  # 12,800 draws: uniform within 10%

    resumed = RandomTokenLoader(16, 32, 8, seed=4, rank=1)
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert torch.equal(next(resumed)[0], next(loader)[0])
    other_rank = RandomTokenLoader(16, 32, 8, seed=4, rank=0)
    assert not torch.equal(next(other_rank)[0], batches[0][0])
    again = RandomTokenLoader(16, 32, 8, seed=4, rank=1)
    assert torch.equal(next(again)[0], batches[0][0])


@pytest.fixture
def prepared(tmp_path):
    inputs = []
    for i in range(10):
        inputs.append(tmp_path / f"doc{i}.txt")
        inputs[-1].write_text(f"document number {i} " * 20)
    return prepare(inputs, tmp_path / "tokens", val_fraction=0.2, progress=False)


def test_open_data_prepared_dir(prepared):
    train, val, tok = open_data(DataConfig(path=str(prepared)), vocab_size=257)
    assert tok.name == "byte" and len(train) > len(val) > 0
    loader = SequenceLoader(train, 32, 2, seed=0)
    inputs, _ = next(loader)
    assert "document number" in tok.decode(inputs.flatten())
    with pytest.raises(ValueError, match=r"is >= model.vocab_size \(200\)"):
        open_data(DataConfig(path=str(prepared)), vocab_size=200)
    with pytest.raises(ValueError, match=r"data.tokenizer \('other.json'\) differs"):
        open_data(DataConfig(path=str(prepared), tokenizer="other.json"), vocab_size=257)
    with pytest.raises(ValueError, match="does not exist"):
        open_data(DataConfig(path=str(prepared) + "-missing"), vocab_size=257)


def test_open_data_defaults_to_the_embedded_corpus(prepared, monkeypatch):
    calls = []

    def fake_corpus(tokenizer, val_fraction):
        calls.append((tokenizer, val_fraction))
        return prepared

    monkeypatch.setattr(loader_module, "embedded_corpus", fake_corpus)
    train, val, _ = open_data(DataConfig(val_fraction=0.1), vocab_size=257)
    assert calls == [("byte", 0.1)] and len(train) and len(val)
