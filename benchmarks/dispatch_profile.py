"""Where NoSync's dispatch + combine time goes, at a rank's shapes (issue 53): eager and compiled,
against the one-device BalancedDispatcher, with each kernel's time and the byte-count floor.

Collectives are stand-ins, as in moetrain/tools/bench/dispatch_cost.py: every rank's counts are
this rank's, and the blocks come back unchanged (the loopback of no transfer). What is timed is
the index work and the row movements a rank of an ep-way run does.

Compiled, dispatch and combine are two regions (the experts sit between them in the step, so
neither may fuse into the other). `--rows reference` times the sink-row torch reference of the
row movements (moetrain/kernels/masked_rows.py) in place of the Triton kernels.

    python benchmarks/dispatch_profile.py --presets ref-47b,olmoe8 --ep 8 --json OUT.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from moetrain.config.presets import get_preset
from moetrain.kernels import masked_rows
from moetrain.moe.capacity import no_sync_capacities
from moetrain.parallel import ep_dispatch
from moetrain.tools.bench.balanced import BalancedDispatcher
from moetrain.tools.bench.dispatch_cost import _Loopback, _routing
from moetrain.tools.bench.timing import kernel_ms


def _dispatchers(config, ep: int, cf: float, device):
    E = config.moe.num_experts
    no_sync = ep_dispatch.NoSyncDispatcher(E, None, 0, cf, transport=_Loopback(), device=device)
    no_sync.num_ranks, no_sync.num_local = ep, E // ep
    return {"balanced": BalancedDispatcher(E // ep), "no_sync": no_sync}


def _step_fn(dispatcher, x, routing, compiled: bool):
    dispatch, combine = dispatcher.dispatch, dispatcher.combine
    if compiled:  # two regions: in the step the experts' GEMMs sit between them
        dispatch, combine = torch.compile(dispatch), torch.compile(combine)

    def step():
        rows, _, handle = dispatch(x, routing)
        y = combine(rows, handle)
        y.backward(torch.ones_like(y))
        x.grad = None

    return step


def _kernel_table(step, top: int = 25) -> list[dict]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if cuda_us > 0:
            rows.append({"kernel": e.key[:120], "calls": e.count, "us": round(cuda_us, 1)})
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def measure(preset: str, ep: int, cf: float, device, rows_impl: str = "kernels") -> dict:
    config = get_preset(preset)
    T = config.train.micro_batch_size * config.train.seq_len
    K, E, D = config.moe.top_k, config.moe.num_experts, config.model.d_model
    torch.manual_seed(0)
    x = torch.randn(T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    routing = _routing(T, K, E, device)
    _, B = no_sync_capacities(T, K, ep, E, cf)
    rows = ep * B
    # one pass over the dispatched rows (bf16), and the T x D token rows
    pass_bytes = rows * D * 2
    record = {
        "preset": preset, "ep": ep, "capacity_factor": cf, "tokens": T, "top_k": K,
        "experts": E, "d_model": D, "rows": rows, "one_pass_GB": pass_bytes / 1e9,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }  # fmt: skip

    def every_rank_alike(counts_E, group, traced=True):
        return counts_E.unsqueeze(0).expand(ep, -1).contiguous()

    use_kernels = masked_rows._use_triton if rows_impl == "kernels" else (lambda t: False)
    record["row_movements"] = rows_impl
    with (
        mock.patch.object(ep_dispatch, "all_gather_counts", every_rank_alike),
        mock.patch.object(masked_rows, "_use_triton", use_kernels),
    ):
        for name, dispatcher in _dispatchers(config, ep, cf, device).items():
            for compiled in (False, True):
                torch._dynamo.reset()
                step = _step_fn(dispatcher, x, routing, compiled)
                key = f"{name}_{'compiled' if compiled else 'eager'}"
                record[f"{key}_ms"] = kernel_ms(step, reps=10, warmup=3)
                if device.type == "cuda" and name == "no_sync":
                    record[f"{key}_kernels"] = _kernel_table(step)
    hbm = 4.8e12 if "H200" in record["gpu"] else 3.35e12
    record["one_pass_ms"] = pass_bytes / hbm * 1e3
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="ref-47b,olmoe8")
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--rows", default="kernels,reference",
        help="NoSync's row movements: the Triton kernels and/or the sink-row torch reference",
    )  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for preset, rows_impl in itertools.product(args.presets.split(","), args.rows.split(",")):
        record = measure(preset, args.ep, args.capacity_factor, device, rows_impl)
        short = {k: v for k, v in record.items() if not k.endswith("_kernels")}
        print(json.dumps(short))
        for key in ("no_sync_eager_kernels", "no_sync_compiled_kernels"):
            for row in record.get(key, [])[:15]:
                print(f"  {key[:-8]:<20} {row['us']:>10.1f} us  x{row['calls']:<4} {row['kernel']}")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
