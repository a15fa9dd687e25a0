"""The model a run trains, built as the recipe says (docs/design.md): the precision plan resolved
once (parallel/precision.py: a choice this machine cannot run fails here, naming the field), the
model on the meta device (its routers replaying `moe.replay_routes` where set: train/routes.py),
parallelized with that plan (parallel/parallelize.py), materialized and initialized
(`init_weights`), cast to the plan's parameter dtype. FSDP is the exception: it shards weights
already materialized.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetrain.config import RunConfig
from moetrain.model.transformer import Transformer
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.parallelize import parallelize
from moetrain.parallel.precision import resolve_precision
from moetrain.train.routes import install_replay


def build_model(
    config: RunConfig,
    dims: ParallelDims,
    model_transform: Callable[[Transformer], None] | None = None,
) -> Transformer:
    """This rank's model, in training mode. `model_transform` changes the parallelized model
    before it is materialized (on meta; with FSDP after)."""
    precision = resolve_precision(config, dims.device)
    param_dtype = precision.param_dtype
    with torch.device("meta"):
        model = Transformer(config)
    if config.moe.replay_routes is not None:  # the routers of moe.replay_routes
        install_replay(model, config, dims.rank, dims.pp, dims.device)
    fsdp = config.parallel.data_parallel == "fsdp"
    if fsdp:  # the baseline shards materialized, initialized weights (see parallel/data.py)
        _materialize(model, config, dims.device, param_dtype)
    model = parallelize(model, config, dims, precision)
    if model_transform is not None:
        model_transform(model)
    if not fsdp:
        _materialize(model, config, dims.device, param_dtype)
    model.train()
    return model


def _materialize(
    model: Transformer, config: RunConfig, device: torch.device, dtype: torch.dtype
) -> None:
    model.to_empty(device=device)
    model.init_weights(config.train.seed)
    for param in model.parameters():
        param.data = param.data.to(dtype)
