"""Weighted mixes of token directories: the schedule keeps the weights, resumes exactly, and is
the same global stream under any world size; sources must share a tokenizer."""

import numpy as np
import pytest
import torch

from moetrain.config import DataConfig, DataSource
from moetrain.config.presets import tiny
from moetrain.data import MixedLoader, open_data, prepare, resolve_vocab_size, source_labels
from moetrain.data.loader import data_fingerprint

SEQ = 8


def streams():
    """Source s holds ids offset by 10_000 * s, so a row's source is its first id // 10_000."""
    return [np.arange(SEQ * n + 1, dtype=np.uint32) + 10_000 * s for s, n in enumerate((40, 7))]


def source_of(inputs_BS: torch.Tensor) -> list[int]:
    return (inputs_BS[:, 0] // 10_000).tolist()


def test_realized_fractions_track_the_weights():
    loader = MixedLoader(streams(), [0.7, 0.3], SEQ, 10, seed=0)
    seen = [0, 0]
    for n in range(1, 31):
        for s in source_of(next(loader)[0]):
            seen[s] += 1
        total = 10 * n
        assert abs(seen[0] - 0.7 * total) <= 1 and abs(seen[1] - 0.3 * total) <= 1
    assert loader.counts() == seen and loader.tokens_per_source() == [SEQ * c for c in seen]
    # source 1 (7 windows) went through several epochs, each a permutation of its windows
    assert loader.epochs[1] >= 10


def test_rows_are_windows_of_their_source():
    data = streams()
    loader = MixedLoader(data, [1, 1], SEQ, 4, seed=3)
    for _ in range(10):
        inputs, targets = next(loader)
        for row_in, row_tg, s in zip(inputs, targets, source_of(inputs), strict=True):
            start = int(row_in[0]) - 10_000 * s
            assert start % SEQ == 0
            assert row_in.tolist() == data[s][start : start + SEQ].tolist()
            assert row_tg.tolist() == data[s][start + 1 : start + SEQ + 1].tolist()


def test_resume_is_exact_and_world_size_free():
    full = MixedLoader(streams(), [0.7, 0.3], SEQ, 4, seed=1)
    expected = [next(full)[0] for _ in range(12)]
    part = MixedLoader(streams(), [0.7, 0.3], SEQ, 4, seed=1)
    for _ in range(5):
        next(part)
    again = MixedLoader(streams(), [0.7, 0.3], SEQ, 4, seed=1)
    again.load_state_dict(part.state_dict())
    for want in expected[5:]:
        assert torch.equal(next(again)[0], want)
    # two ranks of batch 2 read together what one process of batch 4 reads
    ranks = [
        MixedLoader(streams(), [0.7, 0.3], SEQ, 2, seed=1, rank=r, world_size=2) for r in (0, 1)
    ]
    for want in expected:
        assert torch.equal(torch.cat([next(r)[0] for r in ranks]), want)
    with pytest.raises(ValueError, match="one entry per source"):
        again.load_state_dict({"sources": [{"epoch": 0, "windows": 0}]})


def test_resume_after_a_source_wrapped_its_epoch():
    """Source 1 (7 windows) has gone through its epoch twice when the state is taken: the
    resumed loader must continue in that source's third epoch (its own permutation), with the
    counts of a run that never stopped."""
    full = MixedLoader(streams(), [0.7, 0.3], SEQ, 4, seed=2)
    expected = [next(full)[0] for _ in range(18)]
    part = MixedLoader(streams(), [0.7, 0.3], SEQ, 4, seed=2)
    for _ in range(13):
        next(part)
    assert part.epochs[1] == 2 and part.windows[1] > 0
    again = MixedLoader(streams(), [0.7, 0.3], SEQ, 4, seed=2)
    again.load_state_dict(part.state_dict())
    assert again.counts() == part.counts()
    for want in expected[13:]:
        assert torch.equal(next(again)[0], want)
    assert again.counts() == full.counts()


def _prepare(tmp_path, name, text):
    docs = [f"{text} {i}" for i in range(40)]
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(f'{{"text": "{d}"}}\n' for d in docs))
    return str(prepare([src], tmp_path / name, progress=False))


def test_open_data_reads_every_source(tmp_path):
    a = _prepare(tmp_path, "a", "alpha " * 20)
    b = _prepare(tmp_path, "b", "beta " * 20)
    cfg = DataConfig(sources=(DataSource(path=a, weight=0.7), DataSource(path=b, weight=0.3)))
    train, val, tok = open_data(cfg, 320)
    assert len(train) == len(val) == 2 and tok.name == "byte"
    assert source_labels(cfg) == ["a", "b"]
    assert data_fingerprint(cfg) != data_fingerprint(DataConfig(sources=cfg.sources[::-1]))
    run = tiny().with_overrides(["model.vocab_size=null", f"data.sources=[{{path: {a}}}]"])
    assert resolve_vocab_size(run).model.vocab_size == 320  # byte: 257 -> 320


def test_sources_with_different_tokenizers_are_an_error(tmp_path):
    a = _prepare(tmp_path, "a", "alpha " * 20)
    b = _prepare(tmp_path, "b", "beta " * 20)
    meta = tmp_path / "b" / "meta.json"
    meta.write_text(meta.read_text().replace('"vocab_size": 257', '"vocab_size": 50000'))
    cfg = DataConfig(sources=(DataSource(path=a), DataSource(path=b)))
    with pytest.raises(ValueError, match=r"data.sources\[1\].*same tokenizer"):
        open_data(cfg, 320)


def test_config_rejects_bad_mixes():
    with pytest.raises(ValueError, match="data.path"):
        DataConfig(path="x", sources=(DataSource(path="a"),))
    with pytest.raises(ValueError, match=r"data.sources\[0\].weight"):
        DataConfig(sources=(DataSource(path="a", weight=-1.0),))
    with pytest.raises(ValueError, match="listed twice"):
        DataConfig(sources=(DataSource(path="a"), DataSource(path="a")))
    cfg = tiny().with_overrides(["data.sources=[{path: a, weight: 0.7}, {path: b, weight: 0.3}]"])
    assert cfg.data.sources == (DataSource(path="a", weight=0.7), DataSource(path="b", weight=0.3))


def test_a_source_shorter_than_one_window_is_named():
    short = [np.arange(SEQ * 4 + 1, dtype=np.uint32), np.arange(SEQ, dtype=np.uint32)]
    with pytest.raises(ValueError, match=r"data.sources\[1\] holds 8 train tokens"):
        MixedLoader(short, [1, 1], SEQ, 2, seed=0)


def test_one_hugging_face_tokenizer_under_two_paths_is_the_same(tmp_path):
    pytest.importorskip("tokenizers")
    from test_tokenizer import train_bpe

    texts = [f"the quick brown fox {i} " * 5 for i in range(20)]
    first = train_bpe(tmp_path / "tok.json", texts)
    (tmp_path / "copy").mkdir()
    second = tmp_path / "copy" / "tok.json"
    second.write_bytes(first.read_bytes())
    other = train_bpe(tmp_path / "other.json", ["zebra yak " * 9 + str(i) for i in range(20)])
    dirs = []
    for name, tok in (("a", first), ("b", second), ("c", other)):
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
        dirs.append(str(prepare([src], tmp_path / name, tokenizer=str(tok), progress=False)))
    same = DataConfig(sources=(DataSource(path=dirs[0]), DataSource(path=dirs[1])))
    assert len(open_data(same, 1 << 16)[0]) == 2
    differ = DataConfig(sources=(DataSource(path=dirs[0]), DataSource(path=dirs[2])))
    with pytest.raises(ValueError, match=r"data.sources\[1\].*same tokenizer"):
        open_data(differ, 1 << 16)
