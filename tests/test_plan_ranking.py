"""`moetrain plan`'s one ranking (tools/plan/ranking.py, tools/plan/answer.py): every layout family in one
table at one stated global batch, each row a config `moetrain train` accepts, and the best row's
command, whose dry run prints the planned memory. The acceptance question of issue 50: 2 nodes
of 8 H100 80GB, olmoe-1b-7b, resident experts or FSDP2?"""

from __future__ import annotations

import json
import re
import shlex
from types import SimpleNamespace

import pytest
import torch

from moetrain import cli
from moetrain.config.presets import get_preset
from moetrain.parallel.expert import resolve_dispatcher
from moetrain.parallel.overlap import check_two_chunk_capacity
from moetrain.tools import fits
from moetrain.tools import plan as P
from moetrain.tools.dry_run import dry_run, layout_from_config
from moetrain.tools.plan import answer
from moetrain.tools.plan.overlap import ASSUMED, Overlap, Pair
from moetrain.tools.plan.rank_compute import GLOBAL_BATCH_TOKENS, Setting
from moetrain.tools.plan.ranking import rank
from moetrain.tools.plan.run_memory import run_memory

QUESTION = ["plan", "--preset", "olmoe-1b-7b", "--gpus", "16", "--gpu", "h100"]
H100S = P.Cluster(gpu=P.GPUS["h100"], num_gpus=16)


@pytest.fixture(autouse=True)
def _no_calibration_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # not this machine's calibration


def _accepted_by_train(config) -> None:
    """What train checks before it builds: the config (done by constructing it), the dispatcher
    it resolves on GPUs, and two_chunk's capacity rule on that dispatcher."""
    dims = SimpleNamespace(ep=config.parallel.ep, device=torch.device("cuda"))
    if resolve_dispatcher(config, dims) == "no_sync" and config.moe.overlap == "two_chunk":
        check_two_chunk_capacity(config)


def test_the_2x8_h100_question_gets_one_ranking_and_a_command_whose_dry_run_prints_its_memory(
    capsys,
):
    assert cli.main(QUESTION) == 0
    text = capsys.readouterr().out
    assert text.count("Answer: ") == 1 and text.count("tok/s/GPU") == 1  # one ranking
    assert f"global batch: {GLOBAL_BATCH_TOKENS:,} tokens a step" in text
    assert "micro-batch: the sequences one GPU runs" in text and "2 (8,192 tok)" in text
    for family in answer.FAMILIES:  # ep 1 included, each family's best shown
        assert f"│ {family}" in text, family
    assert not re.search(r"\bsigma\b|\beta\b", text)

    assert cli.main([*QUESTION, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    best = plan["best"]
    assert best["rank"] == 1 and plan["answer"][0] in text
    assert f"-m {best['train_command']}" in text and best["dry_run_command"] in text
    assert all(
        r["tokens"] * r["microbatches"] * r["dp"] == GLOBAL_BATCH_TOKENS for r in plan["rows"]
    )

    argv = shlex.split(best["dry_run_command"])
    assert argv[:2] == ["moetrain", "train"] and cli.main(argv[1:]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert f"Estimated peak {best['peak_gib']:.2f} GiB" in printed
    args = cli.build_parser().parse_args(argv[1:])
    config = cli.load_config(args)
    report = dry_run(config, layout_from_config(config, args.world_size), args.rank)
    assert report.memory.peak == best["peak_bytes"]
    _accepted_by_train(config)
    assert fits.predicted_peak(config, 16, "cuda") == best["peak_bytes"]  # train's own check

    assert cli.main([*QUESTION, "--compare-fsdp"]) == 0  # the old mode's flag: the same answer
    old = capsys.readouterr()
    assert old.out == text and "no longer needed" in old.err


@pytest.mark.parametrize(
    "moe",
    [[], ["moe.capacity_factor=1.25"], ["moe.capacity_factor=8"]],
    ids=["dropless", "drops routes", "keeps every route"],
)
def test_every_row_is_a_config_train_accepts_and_its_dry_run_memory(moe):
    """With overlap pairs that hide the all-to-alls, two_chunk rows are ranked where train runs
    them: on the dropless dispatcher, or on no_sync at a factor that drops nothing (E / K = 8)."""
    config = get_preset("olmoe-1b-7b").with_overrides(moe)
    hides = Overlap(dict(ASSUMED.pairs, a2a=Pair(0.0, 0.5)), "a test's")
    ranking = rank(config, Setting(cluster=H100S, overlap=hides))
    assert {r.family for r in ranking.rows} == set(answer.FAMILIES)
    drops = moe == ["moe.capacity_factor=1.25"]
    assert any(r.variant.two_chunk for r in ranking.rows) != drops
    assert any("drops routes" in note for note in ranking.not_ranked) == drops
    seen = set()  # each variant at each (pp, ep, checkpointing) once
    for r in ranking.rows:
        key = (r.variant, r.layout.pp, r.layout.ep, r.layout.activation_checkpointing)
        if key in seen:
            continue
        seen.add(key)
        assert config.with_overrides(list(r.overrides)) == r.config
        layout = layout_from_config(r.config, 16)
        assert layout == r.layout
        peaks = [
            run_memory(r.config, layout, s, r.row.microbatches, overhead=2 * P.GIB).peak
            for s in range(layout.pp)
        ]
        assert max(peaks) == peaks[r.peak_stage] == r.row.peak_bytes, r.describe()
        _accepted_by_train(r.config)
    for variant in {
        r.variant for r in ranking.rows
    }:  # its best row, as the dry run and train see it
        r = next(r for r in ranking.rows if r.variant == variant)
        report = dry_run(r.config, r.layout, answer.dry_run_rank(r))
        assert report.memory.peak == r.row.peak_bytes, r.describe()
        assert fits.predicted_peak(r.config, 16, "cuda") == r.row.peak_bytes, r.describe()


def test_one_stated_global_batch_from_the_flag_the_config_or_the_default(capsys):
    tiny = ["plan", "--preset", "tiny", "--gpus", "2", "--gpu", "h100", "--json"]
    for extra, tokens, source in (
        ([], GLOBAL_BATCH_TOKENS, "default"),
        (["--set", "train.global_batch_tokens=8192"], 8192, "config"),
        (["--set", "train.global_batch_tokens=8192", "--global-batch-tokens", "4096"], 4096, "--"),
    ):
        assert cli.main([*tiny, *extra]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["global_batch_tokens"] == tokens
        assert all(r["tokens"] * r["microbatches"] * r["dp"] == tokens for r in plan["rows"])
        assert f"train.global_batch_tokens={tokens}" in plan["best"]["overrides"]
        assert cli.main([*tiny[:-1], *extra]) == 0
        head = capsys.readouterr().out.splitlines()[1]
        assert head.startswith(f"global batch: {tokens:,} tokens a step") and source in head


def test_a_vocabulary_left_to_the_tokenizer_is_planned_stated_and_set_in_the_command(capsys):
    """The planner reads no data: it plans such a config at 50,304 tokens, says so, and the
    command sets it, so that the dry run (and train) build the model the plan counted."""
    argv = ["plan", "--preset", "tiny", "--gpus", "2", "--set", "model.vocab_size=null"]
    assert cli.main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert any(
        line.startswith("model.vocab_size: the config leaves it") for line in plan["caveats"]
    )
    command = shlex.split(plan["best"]["dry_run_command"])
    assert command[command.index("model.vocab_size=null") + 2] == "model.vocab_size=50304"
    args = cli.build_parser().parse_args(command[1:])
    config = cli.load_config(args)
    report = dry_run(config, layout_from_config(config, 2), args.rank)
    assert report.memory.peak == plan["best"]["peak_bytes"]
