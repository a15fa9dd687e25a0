"""LR schedules (pure functions of the step) and typed parameter groups."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import yaml

from moetrain.config import TrainConfig, presets
from moetrain.model.transformer import Transformer
from moetrain.optim.param_groups import build_param_groups
from moetrain.optim.schedule import lr_at, lr_change


def _train(**overrides) -> TrainConfig:
    base = dict(lr=1e-3, min_lr_ratio=0.1, warmup_steps=10, steps=100, schedule="cosine")
    return TrainConfig(**{**base, **overrides})


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_linear_warmup_reaches_peak(schedule):
    t = _train(schedule=schedule)
    warmup = [lr_at(step, t) for step in range(t.warmup_steps)]
    assert warmup[0] == pytest.approx(t.lr / t.warmup_steps)
    assert warmup[-1] == pytest.approx(t.lr)
    assert all(b > a for a, b in zip(warmup, warmup[1:], strict=False))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_ends_at_min_lr_and_is_monotone(schedule):
    t = _train(schedule=schedule)
    after = [lr_at(step, t) for step in range(t.warmup_steps, t.steps)]
    assert after[0] == pytest.approx(t.lr)
    assert after[-1] == pytest.approx(t.lr * t.min_lr_ratio)
    assert all(b <= a for a, b in zip(after, after[1:], strict=False))
    assert lr_at(t.steps + 50, t) == pytest.approx(t.lr * t.min_lr_ratio)  # stays at the floor


def test_cosine_midpoint_is_halfway():
    t = _train(warmup_steps=0, steps=101, min_lr_ratio=0.0)
    assert lr_at(50, t) == pytest.approx(t.lr / 2)
    assert lr_at(25, t) == pytest.approx(t.lr * 0.5 * (1 + math.cos(math.pi / 4)))


def test_wsd_plateau_then_linear_decay():
    t = _train(schedule="wsd", decay_fraction=0.2)
    decay_start = int(t.steps * (1 - t.decay_fraction))
    assert all(lr_at(s, t) == t.lr for s in range(t.warmup_steps, decay_start))
    assert lr_at(decay_start + 1, t) < t.lr
    assert lr_at(t.steps - 1, t) == pytest.approx(t.lr * t.min_lr_ratio)


def test_constant_stays_at_peak():
    t = _train(schedule="constant")
    assert {lr_at(s, t) for s in range(t.warmup_steps, t.steps)} == {t.lr}


def test_param_groups_kinds_decay_and_multipliers():
    config = presets.tiny()
    train = dataclasses.replace(config.train, expert_lr_mult=0.5, router_lr_mult=2.0)
    model = Transformer(dataclasses.replace(config, train=train))
    groups = build_param_groups(model, train)

    names = [n for g in groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each exactly once
    by_name = {n: g for g in groups for n in g["param_names"]}
    for name, param in model.named_parameters():
        group = by_name[name]
        no_decay = name.endswith("norm.weight") or name == "embed.weight" or param.ndim < 2
        assert (group["weight_decay"] == 0.0) == no_decay, name
        if not no_decay:
            assert group["weight_decay"] == train.weight_decay
    assert by_name["embed.weight"]["weight_decay"] == 0.0
    assert by_name["blocks.0.attn_norm.weight"]["weight_decay"] == 0.0
    experts = by_name["blocks.0.ffn.experts.w_up_eD2F"]
    assert (experts["kind"], experts["lr_mult"]) == ("expert", 0.5)
    router = by_name["blocks.0.ffn.router.gate.weight"]
    assert (router["kind"], router["lr_mult"]) == ("router", 2.0)
    dense = by_name["blocks.0.attn.q_proj.weight"]
    assert (dense["kind"], dense["lr_mult"]) == ("dense", 1.0)


@pytest.mark.parametrize("kind", ["expert", "router"])
def test_a_resume_that_raises_a_kinds_lr_multiplier_is_refused_like_the_lr(kind):
    """A multiplier is compared as the schedule's LR is: a higher one is refused (naming the kind,
    its LR before and after, and how to keep it) unless allowed; a lower one is reported."""
    old, step = _train(), 50
    last = lr_at(step - 1, old)
    raised = dataclasses.replace(old, **{f"{kind}_lr_mult": 10.0})
    note = (
        f"the {kind} LR (train.{kind}_lr_mult 1 -> 10) goes from {last:.3g} (step {step}) to "
        f"{10 * lr_at(step, old):.3g} at step {step + 1}, then {10 * lr_at(99, old):.3g} at step "
        "100 (cosine)"
    )
    with pytest.raises(ValueError, match=f"^--resume: {re.escape(note)}: a jump above") as error:
        lr_change(old, raised, step, allow_increase=False)
    assert f"leave train.{kind}_lr_mult at 1" in str(error.value)
    assert "--allow-lr-increase" in str(error.value)
    assert lr_change(old, raised, step, allow_increase=True) == note
    lowered = dataclasses.replace(old, **{f"{kind}_lr_mult": 0.5})
    assert lr_change(old, lowered, step, allow_increase=False).startswith(f"the {kind} LR (")
    assert lr_change(old, old, step, allow_increase=False) is None


def test_a_schedule_and_a_multiplier_changed_together_report_both():
    old, step = _train(), 50
    new = dataclasses.replace(old, steps=200, expert_lr_mult=0.5)
    note = lr_change(old, new, step, allow_increase=True)
    assert note.startswith(f"the LR goes from {lr_at(step - 1, old):.3g} (step {step}) to ")
    assert "; the expert LR (train.expert_lr_mult 1 -> 0.5) goes from" in note


def _followed(old: TrainConfig, new: TrainConfig, message: str) -> TrainConfig:
    """`new` with the `--set train.FIELD=VALUE` advice of `message` applied as the CLI would."""
    advice = dict(re.findall(r"--set train\.(\w+)=(\S+)", message))
    assert set(advice) == {"schedule", "lr", "warmup_steps"}, message
    values = {k: yaml.safe_load(v.rstrip(".;")) for k, v in advice.items()}
    return dataclasses.replace(new, **values)


def test_the_advice_of_a_refused_jump_passes_when_followed_verbatim():
    """The refusal names an LR to go on with; passed back as written, it is no jump, and it is
    the LR the run last trained with to 3 significant digits. The cases include LRs that `.3g`
    rounds up (the advice then failed its own check)."""
    rounded_up = 0
    for lr, ratio in ((0.0029999, 0.1), (1e-3, 0.1), (6.66e-4, 0.3)):
        old = _train(lr=lr, min_lr_ratio=ratio, steps=100, warmup_steps=10)
        for step in (*range(22, 100, 11), 100):
            last = lr_at(step - 1, old)
            rounded_up += float(f"{last:.3g}") > last
            new = dataclasses.replace(old, steps=300)  # cosine over 300: the LR climbs back
            with pytest.raises(ValueError, match="a jump above") as error:
                lr_change(old, new, step, allow_increase=False)
            followed = _followed(old, new, str(error.value))
            assert lr_change(old, followed, step, allow_increase=False).startswith("the LR goes")
            assert followed.lr == pytest.approx(last, rel=1e-2) and followed.lr <= last
    assert rounded_up >= 3  # the advice's old rounding would have been refused this often


def test_a_run_that_ended_at_lr_zero_is_told_any_lr_jumps():
    old = _train(min_lr_ratio=0.0)
    with pytest.raises(ValueError, match="an LR of 0 .* so any LR is a jump") as error:
        lr_change(old, dataclasses.replace(old, steps=200), old.steps, allow_increase=False)
    assert "train.lr=" not in str(error.value)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "linear"])
def test_the_lr_report_names_only_steps_of_the_run(schedule):
    """A run cut to fewer steps than its warmup (or a wsd decay start beyond its end): the
    report names its next step and its last, never a corner past the end."""
    old = _train(schedule=schedule, warmup_steps=10, steps=50)
    for steps in (4, 8, 12):
        new = dataclasses.replace(old, steps=steps)
        note = lr_change(old, new, 2, allow_increase=True)
        named = [int(n) for n in re.findall(r"at step (\d+)", note)]
        assert named[0] == 3 and named[-1] == steps and max(named) <= steps, note
