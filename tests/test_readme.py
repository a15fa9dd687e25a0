"""The README's quick tour as written: every `moetrain` line parses with the real CLI, and the
commands that run on a CPU in seconds run, the extend-a-run pair end to end (its steps scaled
down by appended --set overrides, the schedule, LR and flags as written)."""

import re
import shlex
from pathlib import Path

import pytest

from moetrain.cli import build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_tour() -> list[list[str]]:
    """The quick tour's `moetrain` commands as argv lists (comments, redirections and the
    `[optional]` parts dropped)."""
    text = README.read_text().split("## Quick tour", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = []
    for line in block.splitlines():
        line = re.sub(r"\[[^\]]*\]", "", line.split("  #")[0].split(" > ")[0]).strip()
        if line.startswith("moetrain "):
            commands.append(shlex.split(line)[1:])
    return commands


def test_every_quick_tour_command_parses():
    commands = quick_tour()
    assert len(commands) >= 30 and ["train"] in commands
    for argv in commands:
        build_parser().parse_args(argv)  # an unknown flag or choice exits here


def _scaled(argv: list[str]) -> list[str]:
    """`argv` with its train.steps divided by 10 and no evaluations between (appended: a later
    --set wins), so a CPU runs it in seconds."""
    steps = [int(a.split("=")[1]) for a in argv if a.startswith("train.steps=")]
    return [*argv, "--set", f"train.steps={steps[-1] // 10}", "--set", "train.eval_every=0"]


def test_the_extend_a_run_pair_runs_as_written(tmp_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    commands = quick_tour()
    first = next(c for c in commands if c[:3] == ["train", "--preset", "tiny"])
    second = next(c for c in commands if "--run-dir" in c and "--resume" in c)
    assert main([*_scaled(first), "--quiet"]) == 0
    assert main([*_scaled(second), "--quiet"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "a jump above" not in err and "train.schedule: 'wsd' -> 'constant'" in err, err
    assert (tmp_path / "runs" / "tiny" / "checkpoints" / "step-40").is_dir()


@pytest.mark.parametrize("command", ["config", "inspect"])
def test_the_quick_tours_printing_commands_run(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in (c for c in quick_tour() if c[0] == command and "--preset" in c):
        assert main(argv) == 0, (argv, capsys.readouterr().err)
        assert capsys.readouterr().out.strip(), argv
