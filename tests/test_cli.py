"""The command line, called in-process: each subcommand does its job and bad input is exit 2."""

import json

import numpy as np
import pytest
import torch

from moetrain.cli import main
from moetrain.data import load_split


def test_prepare_round_trips_text_with_byte_tokenizer(tmp_path, capsys):
    text = "héllo wörld\nsecond line ✓"
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text("another document")
    assert (
        main(
            [
                "prepare",
                str(tmp_path / "a.txt"),
                str(tmp_path / "b.txt"),
                "--out",
                str(tmp_path / "tok"),
                "--val-fraction",
                "0.5",
                "--quiet",
            ]
        )
        == 0
    )
    ids = np.concatenate(
        [load_split(tmp_path / "tok", "train"), load_split(tmp_path / "tok", "val")]
    )
    docs = bytes(int(i) for i in ids if i < 256).decode()
    assert text in docs and "another document" in docs
    again = ["prepare", str(tmp_path / "b.txt"), str(tmp_path / "a.txt"), "--out"]
    assert main([*again, str(tmp_path / "tok"), "--val-fraction", "0.5", "--quiet"]) == 2
    assert "pass --overwrite to replace it" in capsys.readouterr().err
    assert main([*again, str(tmp_path / "tok"), "--val-fraction", "0.5", "--overwrite"]) == 0


def test_prepare_missing_file_is_exit_2_without_output(tmp_path, capsys):
    assert main(["prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "tok")]) == 2
    assert "nope.txt" in capsys.readouterr().err
    assert not (tmp_path / "tok").exists()


def test_inspect_json_reports_counts(capsys):
    assert main(["inspect", "--preset", "small", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["total_params"] == 942_441_472 and info["active_params"] == 186_287_104


# The published configs (config.json on the Hub) of Qwen3-30B-A3B and Mixtral-8x7B-v0.1.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 32000,
}  # fmt: skip


@pytest.mark.parametrize(
    ("preset", "hf_config", "total_b", "active_b"),
    [("qwen3-30b-a3b", QWEN3_30B_A3B, 30.5, 3.3), ("mixtral-8x7b", MIXTRAL_8X7B, 46.7, 12.9)],
)
def test_inspect_of_the_published_families_gives_their_totals(
    tmp_path, capsys, preset, hf_config, total_b, active_b
):
    """`moetrain inspect` of the preset and of the published config.json agree, and give the
    published totals (billions, to the one decimal published; the published active counts
    include the input embedding, which ours leaves out). Memory: bf16 weights and gradients,
    fp32 master weights and two moments, on one rank."""
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    infos = []
    for args in (["--preset", preset], ["--hf-config", str(tmp_path / "config.json")]):
        assert main(["inspect", *args, "--set", "train.seq_len=4096", "--json"]) == 0
        infos.append(json.loads(capsys.readouterr().out))
    ours, published = infos
    assert {k: v for k, v in ours.items() if k != "name"} == {
        k: v for k, v in published.items() if k != "name"
    }
    total, active = ours["total_params"], ours["active_params"] + ours["embedding_params"]
    assert abs(total / 1e9 - total_b) < 0.05, total
    assert abs(active / 1e9 - active_b) < 0.06, active  # Qwen prints 3.353B as 3.3B
    assert ours["weights_and_grads_bytes_per_rank"] == 4 * total
    assert ours["optimizer_state_bytes_per_rank"] == 12 * total
    assert main(["inspect", "--preset", preset, "--hf-config", "x.json"]) == 2
    assert "--hf-config replaces" in capsys.readouterr().err


def test_bad_override_is_exit_2(capsys):
    assert main(["inspect", "--preset", "tiny", "--set", "moe.top_k=99"]) == 2
    assert "moe.top_k (99)" in capsys.readouterr().err


def test_train_eval_generate(tmp_cache, tmp_path, capsys):
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--preset",
                "tiny",
                "--run-dir",
                str(run),
                "--quiet",
                "--set",
                "train.steps=6",
                "--set",
                "train.eval_every=0",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 6
    assert main(["eval", "--checkpoint", str(run), "--sequences", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["val_loss"] < 6.0 and result["step"] == 6 and result["sequences"] == 8
    assert result["checkpoint"] == str(run / "checkpoints" / "step-6")
    assert result["data"].startswith("the val split of the embedded corpus")
    assert main(["eval", "--checkpoint", str(run), "--sequences", "0"]) == 2
    assert "--sequences (0) must be >= 1" in capsys.readouterr().err
    # a token directory of its own, and a multiple-choice task, instead of the run's own
    (tmp_path / "docs.jsonl").write_text('{"text": "print(1)"}\n' * 100)
    assert main(["prepare", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "tok")]) == 0
    task = tmp_path / "sums.jsonl"
    task.write_text('{"context": "x = 1", "choices": [" + 1", "))"], "answer": 0}\n' * 3)
    capsys.readouterr()
    data = ["--data", str(tmp_path / "tok"), "--tasks", str(task), "continuation"]
    assert main(["eval", "--checkpoint", str(run), *data]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["data"] == f"{tmp_path / 'tok'} (both splits)"
    assert other["val_loss"] != result["val_loss"] and other["sequences"] == 13  # 900 tokens
    assert set(other["tasks"]) == {"sums", "continuation"}
    assert all(0 <= v <= 1 for scores in other["tasks"].values() for v in scores.values())
    assert main(["train", "--resume", "--quiet", "--run-dir", str(run)]) == 0
    assert "already at train.steps (6): nothing to train" in capsys.readouterr().err
    assert (
        main(["generate", "--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "8"])
        == 0
    )
    assert capsys.readouterr().out.startswith("def ")
    pytest.importorskip("matplotlib")
    assert main(["plot", str(run), "--out", str(tmp_path / "plots")]) == 0
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert {p.name for p in pngs} >= {"loss.png", "throughput.png", "lr.png", "expert_load.png"}
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_help_does_not_import_torch():
    """`moetrain --help` and argument errors answer at once: the CLI imports torch only for the
    command that runs."""
    import subprocess
    import sys

    code = "import sys, moetrain.cli; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_one_line(tmp_path, capsys):
    for command in (["train", "--preset", "tiny", "--run-dir", str(tmp_path)], ["generate"]):
        if command == ["generate"]:
            command = ["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]
        assert main([*command, "--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--device cuda: this machine has no CUDA device" in err


def test_inspect_memory_is_human_readable_and_version(capsys):
    assert main(["inspect", "--preset", "small"]) == 0
    out = capsys.readouterr().out
    assert "optimizer_state_per_rank" in out and "10.5 GiB" in out and "3.51 GiB" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("moetrain ")
