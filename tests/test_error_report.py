"""A user error of a multi-process job is printed once (moetrain/error_report.py): by the first
rank to fail, agreed on through torchrun's agent store, else by rank 0; under a real torchrun
at world 2 a config error raised on both ranks appears once in the job's output."""

import os
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

from moetrain.error_report import report_error


def _env(rank: int, port: int | None, restart: int = 0) -> dict[str, str]:
    env = {"WORLD_SIZE": "2", "RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(restart)}
    if port is not None:
        env |= {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1"}
        env |= {"MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "job"}
    return env


def test_the_first_failing_rank_prints_once_per_restart(capsys):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    report_error("error: rank 1 first", _env(1, store.port))
    report_error("error: rank 0 second", _env(0, store.port))
    assert capsys.readouterr().err == "error: rank 1 first\n"
    report_error("error: after a restart", _env(0, store.port, restart=1))
    report_error("error: after a restart", _env(1, store.port, restart=1))
    assert capsys.readouterr().err == "error: after a restart\n"


def test_without_a_launcher_store_rank_0_prints(capsys):
    for rank in (1, 0):
        report_error(f"error: from rank {rank}", _env(rank, None))
    report_error("error: one process", {})
    assert capsys.readouterr().err == "error: from rank 0\nerror: one process\n"


def test_a_config_error_on_every_rank_under_torchrun_prints_once(tmp_path):
    env = {**os.environ, "MOETRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--standalone", "-m", "moetrain", "train", "--preset", "tiny"]
    command += ["--run-dir", str(tmp_path / "run"), "--set", "train.steps=-1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert output.count("error: train.steps (-1) must be > 0") == 1, output[-3000:]
