"""The MoE transformer: embedding -> blocks -> final norm -> LM head (+ chunked cross-entropy).

Letters: B batch, S sequence, D d_model, V vocabulary.
Each block is pre-norm: h = x + attn(norm(x)); out = h + ffn(norm(h)), ffn a MoE layer (a dense
SwiGLU in the blocks `ModelConfig.is_dense` names). Blocks are keyed by global index, so a
pipeline stage keeps global names; `embed`, `norm` and `lm_head` are None in stages that do not
own them. With document masking the forward derives the documents from the token ids once (a
stage taking hidden states gets them as `input_ids`). Build on meta, parallelize, `to_empty`, then `init_weights(seed)`: a pure
function of (seed, parameter name, global expert index), the same weights under any layout.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from moetrain.config import RunConfig
from moetrain.moe.layer import MoELayer
from moetrain.nn.attention import Attention
from moetrain.nn.document_mask import DocumentMask
from moetrain.nn.loss import BF16HeadProducts, HeadProducts, chunked_linear_cross_entropy
from moetrain.nn.mlp import SwiGLU
from moetrain.nn.norm import RMSNorm
from moetrain.nn.rope import RotaryEmbedding


class Block(nn.Module):
    def __init__(self, config: RunConfig, layer_idx: int) -> None:
        super().__init__()
        m = config.model
        self.attn_norm = RMSNorm(m.d_model, m.norm_eps)
        self.attn = Attention(
            m.d_model,
            m.num_heads,
            m.kv_heads,
            m.dim_per_head,
            qk_norm=m.qk_norm,
            norm_eps=m.norm_eps,
            rope_theta=m.rope_theta,
            max_positions=config.train.seq_len,
            backend=m.attention_backend,
        )
        self.ffn_norm = RMSNorm(m.d_model, m.norm_eps)
        self.ffn: MoELayer | SwiGLU
        if m.is_dense(layer_idx):
            self.ffn = SwiGLU(m.d_model, m.dense_hidden_size)
        else:
            self.ffn = MoELayer(config.moe, m.d_model, seed=config.train.seed * 1000 + layer_idx)

    def forward(self, x_BSD: torch.Tensor, documents: DocumentMask | None = None) -> torch.Tensor:
        h_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), documents)
        return h_BSD + self.ffn(self.ffn_norm(h_BSD))


class Transformer(nn.Module):
    def __init__(self, config: RunConfig) -> None:
        super().__init__()
        self.config = config
        m = config.model
        self.embed: nn.Embedding | None = nn.Embedding(m.vocab_size, m.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(config, i) for i in range(m.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(m.d_model, m.norm_eps)
        self.lm_head: nn.Linear | None = (
            None if m.tie_embeddings else nn.Linear(m.d_model, m.vocab_size, bias=False)
        )
        # the LM head's products in the loss (nn/loss.py; precision.lm_head)
        self.head_products: HeadProducts = BF16HeadProducts()

    def forward(
        self, tokens_or_hidden: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token ids (B, S) -> final hidden states (B, S, D), normalized if this module owns the
        final norm. A pipeline stage without the embedding takes hidden states instead, and with
        document masking the batch's token ids as `input_ids`."""
        h_BSD = self.embed(tokens_or_hidden) if self.embed is not None else tokens_or_hidden
        documents = self._documents(tokens_or_hidden if input_ids is None else input_ids)
        for block in self.blocks.values():
            h_BSD = block(h_BSD) if documents is None else block(h_BSD, documents)
        return self.norm(h_BSD) if self.norm is not None else h_BSD

    def _documents(self, ids_BS: torch.Tensor) -> DocumentMask | None:
        """The documents of the batch under data.document_masking (block-sparse on CUDA), else
        None."""
        d = self.config.data
        if not d.document_masking:
            return None
        if d.eos_id is None:
            raise ValueError(
                "data.document_masking needs data.eos_id: build the config through "
                "moetrain.data.resolve_eos_id, which takes it from the data"
            )
        if ids_BS.is_floating_point():
            raise ValueError(
                "document masking needs the token ids: pass input_ids to a model (or pipeline "
                "stage) that takes hidden states"
            )
        return DocumentMask.from_tokens(
            ids_BS, d.eos_id, reset_positions=d.reset_positions, block_sparse=ids_BS.is_cuda
        )

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self.embed.weight

    def loss(self, h_BSD: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) of final hidden states, without full logits."""
        D = h_BSD.shape[-1]
        return chunked_linear_cross_entropy(
            h_BSD.reshape(-1, D),
            self.head_weight(),
            targets_BS.reshape(-1),
            products=self.head_products,
        )

    def logits(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return h_BSD @ self.head_weight().T

    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks.values() if isinstance(b.ffn, MoELayer)]

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Buffers that are not in the state dict (RoPE frequencies, MoE statistics) and so are
        not restored by loading a checkpoint: after `to_empty`, call this or `init_weights`."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.init_weights()
            elif isinstance(module, MoELayer):
                module.reset_buffers()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialize every weight; with std = model.init_std and L = model.num_layers:

        - embed.weight: normal(0, std)
        - q/k/v projections, dense and shared-expert gate_up, expert w_up, router gate:
          normal(0, std) truncated at +-3 std
        - attention o_proj, dense w_down, expert w_down: normal(0, std / sqrt(2 L)), truncated at
          +-3 of that std (residual branches shrink with depth)
        - lm_head.weight (untied): normal(0, d_model^-0.5) truncated at +-3 of that std
        - every RMSNorm weight: 1; the router's balancing bias and statistics buffers: 0

        Each tensor (each expert of a grouped tensor) draws from its own generator seeded with
        (seed, its global name, its global expert index).
        """
        seed = self.config.train.seed if seed is None else seed
        m = self.config.model
        std, out_std = m.init_std, m.init_std / math.sqrt(2 * m.num_layers)
        self.init_buffers()
        for name, param in self.named_parameters():
            residual = name.endswith(("o_proj.weight", "w_down.weight", "w_down_eFD"))
            if name.endswith("norm.weight"):  # every RMSNorm
                param.fill_(1.0)
            elif name == "embed.weight":
                _normal(param, std, seed, name, truncate=False)
            elif name == "lm_head.weight":
                _normal(param, m.d_model**-0.5, seed, name)
            elif name.endswith(("w_down_eFD", "w_up_eD2F")):
                owner = self.get_submodule(name.rsplit(".", 1)[0])
                for i in range(param.shape[0]):
                    expert = f"{name}[{owner.expert_offset + i}]"
                    _normal(param[i], out_std if residual else std, seed, expert)
            else:
                _normal(param, out_std if residual else std, seed, name)


def _normal(t: torch.Tensor, std: float, seed: int, name: str, truncate: bool = True) -> None:
    generator = torch.Generator(device=t.device)
    generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if truncate:
        nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=generator)
    else:
        nn.init.normal_(t, std=std, generator=generator)


def build_model(
    config: RunConfig, device: torch.device | str = "cpu", init: bool = True
) -> Transformer:
    """Build on meta, materialize on `device`, initialize (init=False: buffers only, for loading
    a checkpoint). Parallel code builds on meta itself and calls `to_empty` + `init_weights`
    after sharding."""
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    if init:
        model.init_weights()
    else:  # weights come from a checkpoint; buffers outside the state dict must be set here
        model.init_buffers()
    return model
