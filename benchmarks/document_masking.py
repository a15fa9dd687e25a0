"""What document masking costs: `small`'s training step, plain causal against document masking.

    python benchmarks/document_masking.py [--preset small] [--mean-doc-len 512] [--steps 10]
        [--variants plain,documents,documents+reset] [--attention-only] [--json OUT.json]

1. Attention alone (forward + backward, bf16, small's shape: B 8, 16 heads, S 2048, H 64):
   cuDNN's causal SDPA (the plain step's kernel) against FlexAttention with the document block
   mask (moetrain.nn.document_mask), for rows of one document and of documents of mean length 2048,
   1024, 512 and 256 (EOS at rate 1 / L: geometric lengths), CUDA-event medians.
2. Whole steps of the preset as `moetrain bench` builds them (bf16-adamw, CUDA graph), fed
   random ids with EOS at rate 1 / --mean-doc-len: plain causal, document masking, and document
   masking with positions reset; median step ms and the ratio to plain.

Prediction from FLOPs (small, H200). Causal attention is 2 B N S^2 H = 69 GFLOP a layer forward,
~3.5x that forward + backward: 1.9 TFLOP a step over 8 layers, ~5 ms of the ~55 ms step at
cuDNN's rate. Documents of mean length L (geometric) leave a fraction ~2L / S of those FLOPs
(sum of L_i^2 over S^2), rounded up to 128 x 128 blocks: ~(2L + 128) / S, i.e. ~0.56 at
L = 512, 1 for rows of one document. FlexAttention runs at roughly flash-2's rate, about half
of cuDNN's on Hopper at H = 64 (see nn/attention.py), so the masked step should cost +~5 ms
(+~9%) on rows of one document (the worst case) and about break even at L = 512; the block
mask (a dozen small kernels a micro-batch, inside the graph) and reset positions (one int load
a row in the fused RoPE kernel) are noise. Part 1 checks the attention part of this directly.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moetrain.bench.harness import warmed_trainer
from moetrain.bench.timing import time_steps
from moetrain.nn.document_mask import DocumentMask
from moetrain.presets import get_preset

EOS = 7


def document_tokens(shape: tuple[int, int], vocab: int, mean_len: float | None) -> torch.Tensor:
    """Random ids on the GPU with EOS at rate 1 / mean_len (None: no EOS, one document)."""
    tokens = torch.randint(EOS + 1, vocab, shape, device="cuda")
    if mean_len is not None:
        tokens[torch.rand(shape, device="cuda") < 1 / mean_len] = EOS
    return tokens


class DocumentBatches:
    """(inputs, targets) micro-batches of document_tokens, as the trainer's loaders yield them."""

    def __init__(self, batch: int, seq_len: int, vocab: int, mean_len: float | None) -> None:
        self.shape, self.vocab, self.mean_len = (batch, seq_len + 1), vocab, mean_len

    def __iter__(self) -> DocumentBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = document_tokens(self.shape, self.vocab, self.mean_len)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def attention_ms(B: int, N: int, S: int, H: int, reps: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(B, N, S, H, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn_like(q)

    def fwd_bwd(attend) -> float:
        def step():
            torch.autograd.grad(attend(q, k, v), (q, k, v), grad)

        return statistics.median(time_steps(step, warmup=3, steps=reps, device=q.device))

    def cudnn(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION], set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    rows = [{"kernel": "cudnn causal", "mean_doc_len": None, "ms": fwd_bwd(cudnn)}]
    for mean_len in (None, 2048, 1024, 512, 256):
        tokens = document_tokens((B, S), 50304, mean_len)
        docs = DocumentMask.from_tokens(tokens, EOS, reset_positions=False, block_sparse=True)
        row = {"kernel": "flex documents", "mean_doc_len": mean_len, "ms": fwd_bwd(docs.attend)}
        row["block_density"] = 1 - docs.block_mask.sparsity() / 100  # vs all S^2 / 128^2 blocks
        row["cudnn_ratio"] = row["ms"] / rows[0]["ms"]
        rows.append(row)
    return rows


def step_ms(preset: str, overrides: list[str], mean_len: float, steps: int) -> float:
    config = get_preset(preset).with_overrides(overrides)
    with warmed_trainer(config, "bf16-adamw") as (trainer, _):
        t = config.train
        it = DocumentBatches(t.micro_batch_size, t.seq_len, config.model.vocab_size, mean_len)
        graphed = trainer.step_graph is not None and trainer.step_graph.graph is not None
        times = time_steps(lambda: trainer.train_step(it), warmup=2, steps=steps, device=trainer.device)  # fmt: skip
        print(
            f"  {' '.join(overrides) or 'plain causal'}: graphed {graphed}, ms {times}", flush=True
        )
    torch.cuda.empty_cache()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--mean-doc-len", type=float, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default="plain,documents,documents+reset")
    parser.add_argument("--attention-only", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    config = get_preset(args.preset)
    m, t = config.model, config.train
    shape = (t.micro_batch_size, m.num_heads, t.seq_len, m.dim_per_head)
    print(f"attention forward + backward, bf16, (B, N, S, H) = {shape}")
    results["attention"] = attention_ms(*shape, reps=20)
    save(results, args.json)
    for row in results["attention"]:
        extra = (
            f"  {row['cudnn_ratio']:.2f}x cuDNN, block density {row['block_density']:.2f}"
            if "cudnn_ratio" in row  # the cuDNN row itself has neither
            else ""
        )
        print(f"  {row['kernel']:<15} L={row['mean_doc_len']!s:<5} {row['ms']:7.3f} ms{extra}")
    if args.attention_only:
        return
    masked = ["data.document_masking=true", f"data.eos_id={EOS}"]
    variants = {
        "plain": [],
        "documents": masked,
        "documents+reset": [*masked, "data.reset_positions=true"],
    }
    print(f"{args.preset} steps, documents of mean length {args.mean_doc_len:g}")
    results["mean_doc_len"], steps = args.mean_doc_len, {}
    results["step_ms"] = steps
    for name in args.variants.split(","):
        steps[name] = step_ms(args.preset, variants[name], args.mean_doc_len, args.steps)
        save(results, args.json)  # what a time limit leaves still comes back
    for name, ms in steps.items():
        ratio = f"  ratio {ms / steps['plain']:.3f}" if "plain" in steps else ""
        print(f"  {name:<16} {ms:7.2f} ms{ratio}")


def save(results: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
