"""A run directory is not damaged by what happens around it: data re-prepared under a run,
corrupt checkpoints at rotation and resume, a second process starting in it."""

import pytest
from _bench import bench

from moetrain import cli
from moetrain.checkpoint import manager


def _flip_a_byte(checkpoint):
    shard = next(checkpoint.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _write_docs(path, word, n=400):
    lines = [f'{{"text": "{(word + " ") * 30}{i}"}}' for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def test_resume_on_re_prepared_data_is_an_error(tmp_path, module_cache, capsys):
    """`prepare` into a used token directory needs --overwrite; after it, --resume of the run
    trained on the old tokens stops with an error naming the change (not a loader-state error
    or, worse, a silent run on other data)."""
    _write_docs(tmp_path / "a.jsonl", "alpha")
    _write_docs(tmp_path / "b.jsonl", "beta gamma")
    data, run = tmp_path / "data", tmp_path / "run"
    prep = ["prepare", "--out", str(data), "--quiet"]
    assert cli.main([*prep[:1], str(tmp_path / "a.jsonl"), *prep[1:]]) == 0
    bench.train_tiny(run, 2, f"data.path={data}")
    capsys.readouterr()
    assert cli.main([*prep[:1], str(tmp_path / "b.jsonl"), *prep[1:]]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert bench.train_tiny(run, 4, f"data.path={data}").step == 4  # unchanged data resumes
    assert cli.main([*prep[:1], str(tmp_path / "b.jsonl"), *prep[1:], "--overwrite"]) == 0
    with pytest.raises(ValueError, match="the data changed since checkpoint .*step-4"):
        bench.train_tiny(run, 6, f"data.path={data}")


def test_rotation_moves_a_corrupt_checkpoint_aside_and_keeps_the_good_one(tmp_path, module_cache):
    """step-4 corrupt: resume falls back to step-2, moves step-4 aside, and the rotation after
    the next save keeps step-2 (the newest verified before it) instead of the corrupt one."""
    run = tmp_path / "run"
    bench.train_tiny(run, 4)
    _flip_a_byte(run / "checkpoints" / "step-4")
    resumed = bench.train_tiny(run, 6, "train.checkpoint_every=100")  # saves step-6 only
    assert resumed.resumed_from.name == "step-2"
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-2", "step-4.corrupt", "step-6"]


def test_resume_with_no_verifiable_checkpoint_is_an_error(tmp_path, module_cache, capsys):
    run = tmp_path / "run"
    bench.train_tiny(run, 4)
    for step in (2, 4):
        _flip_a_byte(run / "checkpoints" / f"step-{step}")
    for _ in range(2):  # and again, once they have been moved aside
        with pytest.raises(manager.CheckpointError, match="no checkpoint .* verifies") as error:
            bench.train_tiny(run, 6)
        assert "step-2.corrupt, step-4.corrupt" in str(error.value)
    code = cli.main(["train", "--preset", "tiny", "--quiet", "--resume", "--run-dir", str(run)])
    assert code == 2 and "refusing to start over at step 0" in capsys.readouterr().err
