"""Pipeline parallelism (with expert and data parallelism inside each stage) equals one process.

Each case builds the model the trainer's way (meta -> parallelize, whose first step is the
pipeline split -> to_empty -> init_weights -> Pipeline) and a single-process reference from the
same seed, then runs 3 AdamW steps. At every step each rank's loss (summed over pp from the last
stage) and every gradient it holds, after the data-parallel sync, must equal the reference's,
which accumulates every micro-batch of every dp rank with its own load-balancing and z-losses.
Several cases share one spawned process group to keep the suite fast.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed

from moetrain.config import (
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from moetrain.config.presets import tiny
from moetrain.data.heldout import WindowRows
from moetrain.model.transformer import Transformer, build_model
from moetrain.optim.clip import global_grad_norm, params_with_kinds
from moetrain.optim.param_groups import build_param_groups
from moetrain.parallel import (
    GradientSync,
    ParallelDims,
    init_distributed,
    is_expert_param,
    parallelize,
)
from moetrain.parallel.pipeline import Pipeline, pipeline_layout, split_model
from moetrain.train.evaluate import score_rows

pytestmark = pytest.mark.distributed

STEPS, BATCH, SEQ, VOCAB, LAYERS, ACCUM = 3, 2, 16, 64, 4, 4
MOE_OPTIONS = ("dispatcher", "routing", "overlap")
EOS = 5  # the "documents" option: document masking with reset positions, EOS at every 4th token


def tiny_config(pp: int, dp: int, ep: int, schedule: str, **options) -> RunConfig:
    documents = options.pop("documents", False)
    dense_layers = options.pop("dense_layers", ())
    parallel = {k: v for k, v in options.items() if k not in MOE_OPTIONS}
    data = DataConfig(document_masking=True, reset_positions=True, eos_id=EOS) if documents else DataConfig()  # fmt: skip
    return RunConfig(
        data=data,
        model=ModelConfig(
            vocab_size=VOCAB, d_model=32, num_layers=LAYERS, num_heads=4, dense_layers=dense_layers
        ),
        moe=MoEConfig(
            num_experts=8,
            top_k=2,
            expert_hidden=32,
            lb_loss_weight=0.1,
            z_loss_weight=0.01,
            dispatcher="all_to_all" if ep > 1 else "auto",
        ),
        parallel=ParallelConfig(pp=pp, dp=dp, ep=ep, pp_schedule=schedule, **parallel),
        train=TrainConfig(
            seq_len=SEQ,
            micro_batch_size=BATCH,
            global_batch_tokens=ACCUM * BATCH * SEQ * dp,
            seed=3,
        ),
    )


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, what: str, rel=1e-5) -> None:
    """max |actual - expected| <= rel * max |expected| (fp32 summation orders differ)."""
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale + 1e-12, f"{what}: max error {err:.3e}, scale {scale:.3e}"


def make_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    # a small lr keeps near-zero gradients' fp32 noise within the tolerance (test_ep_training.py)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)


def run_case(config: RunConfig) -> None:
    dims = init_distributed(config)
    with torch.device("meta"):
        model = Transformer(config)
    parallelize(model, config, dims)
    model.to_empty(device="cpu")
    model.init_weights()
    pipeline = Pipeline(model, config, dims)
    reference = build_model(dataclasses.replace(config, parallel=ParallelConfig()))
    ref_params = dict(reference.named_parameters())

    sync = GradientSync(model, dims)
    pairs = params_with_kinds(build_param_groups(model, config.train))
    opt, ref_opt = make_adamw(model), make_adamw(reference)
    dp, accum = dims.dp, ACCUM
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (STEPS, dp, accum, BATCH, SEQ + 1), generator=generator)
    if config.data.document_masking:
        eos = torch.rand(tokens.shape, generator=generator) < 0.25
        tokens = torch.where(eos, EOS, tokens)
    for layer in reference.moe_layers():
        layer.aux_grad_scale = 1.0 / (accum * dp)
    for step in range(STEPS):
        ref_losses = torch.zeros(dp)
        for rank in range(dp):
            for micro in range(accum):
                batch = tokens[step, rank, micro]
                loss = reference.loss(reference(batch[:, :-1]), batch[:, 1:])
                (loss / (accum * dp)).backward()
                ref_losses[rank] += loss.detach() / accum
        own = tokens[step, dims.dp_rank]
        batches = iter([(b[:, :-1], b[:, 1:]) for b in own])
        loss = pipeline.forward_backward(batches, sync.no_sync)
        sync.finish()
        assert_close_rel(loss, ref_losses[dims.dp_rank], f"loss {step}")
        for name, param in model.named_parameters():
            expected = ref_params[name].grad
            if is_expert_param(name):
                offset = model.get_submodule(name.rsplit(".", 1)[0]).expert_offset
                expected = expected[offset : offset + param.shape[0]]
            assert_close_rel(param.grad, expected, f"step {step} grad {name}")
        norm = global_grad_norm(pairs, ep_group=dims.ep_group, pp_group=dims.pp_group)
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
        assert_close_rel(norm, ref_norm, f"step {step} gradient norm over stages")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # Evaluation: forward-only through the schedule; 9 windows (padded to whole steps on every
    # dp rank), each row's summed NLL equal to the reference's on every rank.
    held_out = torch.randint(0, VOCAB, (9 * SEQ + 1,), generator=generator).numpy()
    rows = WindowRows([held_out], SEQ, 9, "held-out tokens")
    expected = score_rows(reference, rows, BATCH)
    assert_close_rel(score_rows(model, rows, BATCH, dims, pipeline), expected, "row NLL")
    assert model.training
    # Each weight lives on one stage: over all ranks, dense weights are held dp times and
    # expert weights dp / ep times (ep ranks hold disjoint slices).
    held = torch.tensor(float(sum(p.numel() for p in model.parameters())))
    dist.all_reduce(held)
    sizes = [(is_expert_param(n), p.numel()) for n, p in reference.named_parameters()]
    dense, expert = (sum(n for e, n in sizes if e == kind) for kind in (False, True))
    assert held.item() == dense * dp + expert * dp // dims.ep
    # Every rank gets every MoE layer's routes, in model order (dense layers anywhere between):
    # at dp 1 the reference's, which saw the same tokens.
    gathered = pipeline.gather_moe_stats([layer.read_stats() for layer in model.moe_layers()])
    if dp == 1:
        expected_routes = [layer.read_stats()["tokens_per_expert"] for layer in reference.moe_layers()]  # fmt: skip
        assert [g["tokens_per_expert"].tolist() for g in gathered] == [
            r.tolist() for r in expected_routes
        ]


def _run_cases(rank, world_size, cases):
    for pp, dp, ep, schedule, options in cases:
        config = tiny_config(pp, dp, ep, schedule, **options)
        moe_options = {k: v for k, v in options.items() if k in MOE_OPTIONS}
        if moe_options.get("dispatcher") == "no_sync":  # capacity factor E / K: never drops
            moe_options["capacity_factor"] = 4.0
        if moe_options:
            config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, **moe_options))
        run_case(config)


def test_pp2_matches_single_process():
    """Every schedule at pp=2 (world 2), and 1f1b with activation checkpointing; with random
    routing too, where a recompute runs several micro-batches after its forward and must draw
    that forward's experts. With document masking (interleaved: two stages a rank), where
    every stage derives the documents from the token ids it is handed. With a dense layer between
    MoE layers, whose routing statistics every rank gathers in model order."""
    cases = [(2, 1, 1, s, {}) for s in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")]
    cases.append((2, 1, 1, "interleaved_1f1b", {"documents": True}))
    cases.append((2, 1, 1, "1f1b", {"activation_checkpointing": "full"}))
    cases.append((2, 1, 1, "1f1b", {"dense_layers": (1,)}))  # stage 0: MoE, dense; 1: MoE, MoE
    cases.append((2, 1, 1, "1f1b", {"activation_checkpointing": "moe", "routing": "random"}))
    run_distributed(_run_cases, 2, cases)


def test_pp2_dp2_ep2_matches_single_process():
    """pp=2 x dp=2 with ep=2 inside each stage (world 4): every schedule with the all-to-all
    dispatcher, and two with the no-sync dispatcher (one under MoE checkpointing); 1f1b with
    moe.overlap=two_chunk under full checkpointing."""
    cases = [(2, 2, 2, s, {}) for s in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")]
    cases.append((2, 2, 2, "zero_bubble", {"dispatcher": "no_sync"}))
    cases.append(
        (2, 2, 2, "interleaved_1f1b", {"dispatcher": "no_sync", "activation_checkpointing": "moe"})
    )
    cases.append((2, 2, 2, "1f1b", {"overlap": "two_chunk", "activation_checkpointing": "full"}))
    run_distributed(_run_cases, 4, cases)


def _bf16_stage_gradients(schedule: str) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
    """One step of this rank's bf16 stage with fp32 gradient accumulation (GradientSync, as
    `precision.grad_dtype=fp32` builds it): per parameter, the accumulated fp32 gradient and
    the bf16 gradients of the micro-batches as autograd's post-accumulate hooks saw them."""
    config = tiny_config(2, 1, 1, schedule)
    dims = init_distributed(config)
    with torch.device("meta"):
        model = Transformer(config)
    parallelize(model, config, dims)
    model.to_empty(device="cpu")
    model.init_weights()
    model.to(torch.bfloat16)
    seen: dict[str, list[torch.Tensor]] = {name: [] for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():  # before GradientSync's hooks, which free .grad
        param.register_post_accumulate_grad_hook(lambda p, n=name: seen[n].append(p.grad.clone()))
    sync = GradientSync(model, dims, grad_dtype=torch.float32)
    pipeline = Pipeline(model, config, dims)
    tokens = torch.randint(
        0, VOCAB, (ACCUM, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5)
    )
    pipeline.forward_backward(iter([(b[:, :-1], b[:, 1:]) for b in tokens]), sync.no_sync)
    sync.finish()
    return {name: (p.main_grad.clone(), seen[name]) for name, p in model.named_parameters()}


def _zero_bubble_accumulates_in_fp32(rank, world_size):
    one_f_one_b, zero_bubble = (_bf16_stage_gradients(s) for s in ("1f1b", "zero_bubble"))
    rounded = 0
    for name, (grad, micro) in one_f_one_b.items():
        assert len(micro) == ACCUM, name
        fp32_sum, bf16_sum = micro[0].float(), micro[0]
        for g in micro[1:]:
            fp32_sum, bf16_sum = fp32_sum + g.float(), bf16_sum + g
        assert torch.equal(grad, fp32_sum), f"1f1b: {name}"
        # the zero-bubble stage's gradient is the same fp32 sum of the same micro-batch gradients
        assert torch.equal(zero_bubble[name][0], fp32_sum), f"zero_bubble: {name}"
        rounded += not torch.equal(bf16_sum.float(), fp32_sum)
    assert rounded >= len(one_f_one_b) - 2  # a bf16 sum would differ: the test can fail


def test_zero_bubble_stage_accumulates_bf16_gradients_in_fp32():
    """bf16 parameters, 4 micro-batches, pp=2: every stage's gradient, under zero_bubble as under
    1f1b, is the fp32 sum of its micro-batches' bf16 gradients (torch's split weight pass writes
    `.grad` itself; without the stage running the accumulation hooks it summed them in bf16)."""
    run_distributed(_zero_bubble_accumulates_in_fp32, 2)


# ---- the trainer: pp=2 x dp=2 (ep=2) checkpoint, resumed at pp=1 in one process ---------------
def _records(run_dir: Path, kind: str) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["kind"] == kind}


def _trainer_config(pp: int, dp: int, ep: int) -> RunConfig:
    # the same 16 sequences per step, in micro-batches of 2, in every layout; evaluation of the
    # same 5 windows (padded to whole pipeline steps on each dp rank) at steps 2 and 4
    return tiny().with_overrides(
        [
            "model.d_model=32",
            f"model.num_layers={LAYERS}",
            f"train.seq_len={SEQ}",
            f"train.micro_batch_size={BATCH}",
            f"train.global_batch_tokens={16 * SEQ}",
            "train.optimizer=sharded",
            "train.steps=4",
            "train.log_every=1",
            "train.eval_every=2",
            "train.eval_sequences=5",
            "train.checkpoint_every=2",
            "moe.lb_loss_weight=0.1",
            "moe.z_loss_weight=0.01",
            "moe.dispatcher=all_to_all",
            f"parallel.pp={pp}",
            f"parallel.dp={dp}",
            f"parallel.ep={ep}",
            "parallel.pp_schedule=interleaved_1f1b",
        ]
    )


def _train(rank, world, run_dir, cache, pp, dp, ep, resume):
    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.train.trainer import Trainer

    Trainer(_trainer_config(pp, dp, ep), run_dir, resume=resume, progress=False).train()


def test_trainer_checkpoint_from_pp2_resumes_at_pp1(tmp_path):
    cache = str(tmp_path / "cache")
    source, target = tmp_path / "pp2_dp2_ep2", tmp_path / "pp1"
    run_distributed(_train, 4, str(source), cache, 2, 2, 2, False)
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "step-2", target / "checkpoints" / "step-2")
    _train(0, 1, str(target), cache, 1, 1, 1, True)
    reference, resumed = _records(source, "train"), _records(target, "train")
    assert sorted(reference) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    a, b = _records(source, "eval")[4]["val_loss"], _records(target, "eval")[4]["val_loss"]
    assert abs(a - b) <= 1e-5 * b, (a, b)
    for step in (3, 4):
        a, b = reference[step], resumed[step]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (step, a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], step
        # routing statistics of every layer, gathered from both stages, as in one process (the
        # expert load is summed over dp; lb_loss and entropy are rank 0's own, at any dp)
        assert [x["layer"] for x in a["moe"]] == [x["layer"] for x in b["moe"]] == [0, 1, 2, 3]
        for x, y in zip(a["moe"], b["moe"], strict=True):
            assert (x["cv"], x["max_mean"]) == pytest.approx((y["cv"], y["max_mean"])), step


# ---- the split and its validation (no processes) -----------------------------------------------
def _split(config: RunConfig, pp_rank: int) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    split_model(model, pipeline_layout(config, dp=1), pp_rank)
    return model


def test_split_keeps_global_names():
    """interleaved_1f1b on pp=2: stages 0..3 hold one layer each; rank 0 runs stages 0 and 2
    (embedding, layers 0 and 2), rank 1 stages 1 and 3 (layers 1 and 3, final norm, head)."""
    config = tiny_config(2, 1, 1, "interleaved_1f1b")
    full = {n for n, _ in Transformer(config).named_parameters()}
    first, last = _split(config, 0), _split(config, 1)
    assert list(first.blocks) == ["0", "2"] and list(last.blocks) == ["1", "3"]
    assert first.embed is not None and first.norm is None and first.lm_head is None
    assert last.embed is None and last.norm is not None and last.lm_head is not None
    names = [{n for n, _ in m.named_parameters()} for m in (first, last)]
    assert names[0] | names[1] == full and not names[0] & names[1]
    # an uneven split gives the extra layer to the last stage (2 stages: nothing in between)
    five = dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=5))
    layout = pipeline_layout(dataclasses.replace(five, parallel=ParallelConfig(pp=2)), dp=1)
    assert layout.layers == (range(0, 2), range(2, 5)) and layout.num_microbatches == ACCUM


@pytest.mark.parametrize(
    ("pp", "schedule", "overrides", "message"),
    [
        (3, "interleaved_1f1b", {}, r"parallel.pp \(3\) x 2 stage\(s\) per rank .* = 6 pipeline"),
        (2, "1f1b", {"pp_microbatches": 1}, r"pp_microbatches \(1\) must be >= parallel.pp"),
        (
            4,
            "zero_bubble",
            {},
            r"pp_microbatches \(2, the accumulation steps\) must be >= parallel.pp \(4\)",
        ),
        (2, "interleaved_1f1b", {"pp_microbatches": 3}, r"pp_microbatches \(3\) must divide"),
        (2, "zero_bubble", {"activation_checkpointing": "moe"}, "recompute every"),
        (2, "1f1b", {"data_parallel": "fsdp"}, r"data_parallel \(fsdp\) is not supported"),
    ],
)
def test_invalid_split_errors(pp, schedule, overrides, message):
    config = tiny_config(pp, 1, 1, schedule, **overrides)
    if pp == 4:  # 2 accumulation steps: fewer micro-batches than stages
        train = dataclasses.replace(config.train, global_batch_tokens=2 * BATCH * SEQ)
        config = dataclasses.replace(config, train=train)
    with pytest.raises(ValueError, match=message):
        pipeline_layout(config, dp=1)


def test_invalid_split_errors_more():
    # torch runs interleaved micro-batches in rounds of pp: 5 is not a multiple of 5 // 2
    interleaved = tiny_config(2, 1, 1, "interleaved_1f1b")
    batch = dataclasses.replace(interleaved.train, global_batch_tokens=5 * BATCH * SEQ)
    with pytest.raises(ValueError, match=r"\(5\) must be a multiple of .* // parallel.pp \(2\)"):
        pipeline_layout(dataclasses.replace(interleaved, train=batch), dp=1)
    tied = tiny_config(2, 1, 1, "1f1b")
    tied = dataclasses.replace(tied, model=dataclasses.replace(tied.model, tie_embeddings=True))
    with pytest.raises(ValueError, match="model.tie_embeddings"):
        pipeline_layout(tied, dp=1)
    # gpipe runs fewer micro-batches than stages
    gpipe = tiny_config(2, 1, 1, "gpipe", pp_microbatches=1)
    assert pipeline_layout(gpipe, dp=1).microbatch_size == ACCUM * BATCH


def test_parallelize_splits_first():
    """The recipe splits before anything else (on meta, without process groups here), and
    rejects compiled blocks under zero_bubble."""

    def dims(pp_rank: int) -> ParallelDims:
        return ParallelDims(
            **dict.fromkeys(("mesh", "dp_mesh", "dp_group", "ep_group", "edp_group"), None),
            **dict.fromkeys(("rank", "local_rank", "dp_rank", "ep_rank", "edp_rank"), 0),
            world_size=2,
            dp=1,
            ep=1,
            pp=2,
            pp_group=None,
            pp_rank=pp_rank,
            device=torch.device("cpu"),
        )

    config = tiny_config(2, 1, 1, "1f1b", activation_checkpointing="full")
    with torch.device("meta"):
        model = parallelize(Transformer(config), config, dims(1))
    assert list(model.blocks) == ["2", "3"] and model.embed is None
    assert [n for n, _ in model.named_parameters()][-2:] == ["norm.weight", "lm_head.weight"]
    compiled = tiny_config(2, 1, 1, "zero_bubble", compile=True)
    with pytest.raises(ValueError, match="parallel.compile=false"):
        with torch.device("meta"):
            parallelize(Transformer(compiled), compiled, dims(0))
