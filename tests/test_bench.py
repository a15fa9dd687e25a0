"""`moetrain bench` on CPU (smoke: it times real training steps and writes what it reports) and
the profiler post-processing (pure functions)."""

import json

from moetrain.cli import main
from moetrain.config import presets
from moetrain.tools.bench.harness import warmed_trainer
from moetrain.tools.bench.phases import classify, idle_gaps


def test_bench_on_cpu_times_real_steps_and_writes_json_and_markdown(tmp_path, capsys):
    out, md = tmp_path / "r.json", tmp_path / "RESULTS.md"
    args = ["bench", "--preset", "tiny", "--steps", "2", "--warmup", "1", "--optimizer", "mixed"]
    assert main([*args, "--json", str(out), "--results-md", str(md)]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert result["system"] == "moetrain" and result["preset"] == "tiny"
    assert len(result["times_ms"]) == 2 and all(t > 0 for t in result["times_ms"])
    tokens = result["tokens_per_step"]
    assert (
        abs(result["tokens_per_s"] - tokens / (result["stats"]["median_ms"] / 1e3)) < 1e-6 * tokens
    )
    assert result["cuda_graph"] is False  # CPU: never graphed
    assert result["gpu_state"] is None  # no NVML samples without a GPU
    assert "| moetrain | tiny | learned | mixed |" in md.read_text()
    assert "no GPU" in capsys.readouterr().err


def test_bench_micro_batches_time_accumulating_steps(tmp_path):
    """--micro-batches 2: each timed step runs two micro-batches (what a gradient-accumulation
    cost is measured on), and its tokens count both."""
    out = tmp_path / "r.json"
    args = ["bench", "--preset", "tiny", "--steps", "2", "--warmup", "1", "--optimizer", "mixed"]
    assert main([*args, "--micro-batches", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    cfg = presets.tiny().train
    assert result["tokens_per_step"] == 2 * cfg.micro_batch_size * cfg.seq_len
    for micro_batches in (1, 2):
        with warmed_trainer(
            presets.tiny(), "mixed", warmup=3, device="cpu", micro_batches=micro_batches
        ) as (trainer, _):
            assert trainer.step == 3 and trainer.train_loader.batches == 3 * micro_batches


def test_warmed_trainer_is_the_benchmarks_trainer_after_its_warm_up_steps():
    with warmed_trainer(presets.tiny(), "bf16-adamw", warmup=2, device="cpu") as (trainer, it):
        cfg = trainer.config
        assert cfg.data.random_tokens and cfg.train.eval_every == 0
        assert cfg.precision.param_dtype == "bf16" and not cfg.precision.master_weights
        assert trainer.step == 2 and trainer.train_loader.batches == 2
        inputs, targets = next(it)
        assert inputs.shape == (cfg.train.micro_batch_size, cfg.train.seq_len)
        run_dir = trainer.run_dir.path
        assert run_dir.exists()
    assert not run_dir.exists()  # a temporary run directory, removed afterwards


def test_idle_gaps_are_the_stretches_no_kernel_covers():
    spans = [(0, 10, "a"), (5, 12, "b"), (20, 30, "c"), (31, 40, "d"), (32, 35, "e")]
    gaps = idle_gaps(spans, top=5)
    assert gaps == [
        {"us": 8, "after": "b", "before": "c"},
        {"us": 1, "after": "c", "before": "d"},
    ]
    assert idle_gaps(spans, top=1) == gaps[:1]


def test_kernel_names_map_to_phases():
    assert classify("_adamw_kernel") == "optimizer"
    assert classify("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert classify("_spread_routes_kernel") == "dispatch/combine (sort, gather, scatter)"
    assert classify("nvjet_sm90_tst_256x128_64x4") == "dense GEMMs (projections, router, LM head)"
    assert classify("_swiglu_backward_kernel") == "norms, activations, elementwise"
    assert classify("_route_topk_kernel") == "dispatch/combine (sort, gather, scatter)"
    assert classify("_ce_rows_kernel") == "loss (softmax, logsumexp)"
    assert classify("_qk_norm_rope_backward_kernel") == "norms, activations, elementwise"
    assert classify("_sum_of_squares_kernel") == "optimizer"
    for quantizer in ("_column_kernel", "_rowwise_kernel"):
        assert classify(quantizer) == "FP8 conversions"
    assert classify("something_new") == "other"


def test_kernel_ms_on_cpu_warms_up_with_prep_then_times_one_call():
    from moetrain.tools.bench.timing import kernel_ms

    calls = []
    ms = kernel_ms(lambda: calls.append("fn"), warmup=2, prep=lambda: calls.append("prep"))
    assert calls == ["prep", "fn", "prep", "fn", "fn"] and ms >= 0
