"""Processes die and come back: nothing is lost, and only the steps after the newest complete
checkpoint are computed again."""

import pytest
from _bench import harness, processes

pytestmark = pytest.mark.slow


def test_sigkill_anywhere_then_resume_loses_nothing(tmp_path, module_cache):
    """Four SIGKILLs of `moetrain train --resume` at random moments (saves are slowed down so
    that most land inside one) and one self-kill between a save's shards and its manifest,
    each followed by a restart of the same command: every restart resumed from the newest
    complete checkpoint (never a partial one), redid at most checkpoint_every steps, and the run
    ends with the uninterrupted run's loss at every step and its final model and optimizer
    tensors, bitwise. The first start, with no checkpoint yet, also ran with --resume."""
    random_kills, in_save = processes.kill_anywhere(
        tmp_path, module_cache, kills=4, steps=24, seed=1
    )
    restarts = random_kills.details["restarts"]
    assert restarts[0]["newest"] == 0 and restarts[0]["resumed_from_newest"]  # first start
    assert all(r["resumed_from_newest"] for r in restarts), restarts
    assert all(0 <= r["redo"] <= harness.CHECKPOINT_EVERY for r in restarts), restarts
    assert random_kills.injected == 4 and random_kills.survived == 4
    assert in_save.details["killed_in_save"] and in_save.details["partial_left"]
    assert in_save.survived == 1
    assert random_kills.lost == 0  # losses and final weights equal the uninterrupted run's


@pytest.mark.distributed
def test_a_dying_rank_is_restarted_by_torchrun_and_loses_nothing(tmp_path, module_cache):
    """2 gloo processes under torchrun --max-restarts=1: rank 1 os._exit(1)s after step 5;
    torchrun restarts both, they resume from step 4 and end with the losses and weights of an
    uninterrupted 2-process run."""
    outcome = processes.rank_death(tmp_path, module_cache, steps=8, die_after=5)
    assert outcome.details["died"], "the fault did not fire"
    assert (outcome.injected, outcome.survived, outcome.lost) == (1, 1, 0)
    losses = harness.losses(tmp_path / "ranks_run")
    assert sorted(losses) == list(range(1, 9))
