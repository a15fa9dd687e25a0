import re

import pytest

from moetrain.config import RunConfig
from moetrain.config.presets import PRESETS, get_preset, tiny

BAD_VALUES = [
    ("model.vocab_size=0", "model.vocab_size"),
    ("model.d_model=-4", "model.d_model"),
    ("model.num_layers=0", "model.num_layers"),
    ("model.num_heads=3", "model.d_model"),
    ("model.num_kv_heads=3", "model.num_kv_heads"),
    ("model.num_dense_layers=5", "model.num_dense_layers"),
    ("model.norm_eps=0", "model.norm_eps"),
    ("model.attention_backend=fast", "model.attention_backend"),
    ("model.qk_norm=maybe", "model.qk_norm"),
    ("model.head_dim=7", "model.head_dim (7) gives heads of 7 features: RoPE rotates pairs"),
    ("model.qk_norm=1", "model.qk_norm"),  # only the booleans of older configs map
    ("model.dense_layers=[2]", "model.dense_layers ([2]) must list layer indices in [0, 2)"),
    ("model.dense_layers=[1,1]", "model.dense_layers ([1, 1]) must list"),
    ("model.dense_layers=[1,0]", "in increasing order"),
    ("model.dense_layers=x", "model.dense_layers"),
    ("moe.n_groups=3", "moe.n_groups (3) must divide moe.num_experts (8)"),
    ("moe.n_groups=8", "moe.n_groups (8) must leave at least 2 experts a group"),
    ("moe.n_groups=0", "moe.n_groups (0) must be > 0"),
    ("moe.topk_groups=2", "moe.topk_groups (2) must be <= moe.n_groups (1)"),
    ("moe.top_k=9", "moe.top_k"),
    ("moe.num_experts=0", "moe.num_experts"),
    ("moe.expert_hidden=abc", "moe.expert_hidden"),
    ("moe.score_func=relu", "moe.score_func"),
    ("moe.routing=greedy", "moe.routing"),
    ("moe.capacity_factor=-1", "moe.capacity_factor"),
    ("moe.lb_loss_weight=-0.1", "moe.lb_loss_weight"),
    ("moe.dispatcher=magic", "moe.dispatcher"),
    ("parallel.ep=3", "parallel.ep"),
    ("parallel.dp=0", "parallel.dp"),
    ("parallel.pp=3", "parallel.pp"),
    ("parallel.pp_schedule=fast", "parallel.pp_schedule"),
    ("train.steps=0", "train.steps"),
    ("train.lr=-1", "train.lr"),
    ("train.beta1=1.0", "train.beta1"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio"),
    ("train.schedule=step", "train.schedule"),
    ("train.global_batch_tokens=100", "train.global_batch_tokens"),
    ("data.val_fraction=0", "data.val_fraction"),
    ("precision.experts=fp4", "precision.experts"),
    ("train.adamw_kernel=cuda", "train.adamw_kernel"),
    ("precision.param_dtype=fp16", "precision.param_dtype"),
    ("train.eval_sequences=0", "train.eval_sequences"),
    ("train.eval_batches=0", "train.eval_batches"),
    ("data.eval_sets=[{name: a/b, path: x}]", "data.eval_sets[0].name"),
    ("data.eval_sets=[{name: a, path: x}, {name: a, path: y}]", "data.eval_sets[1].name"),
    ("data.eval_sets=[{path: x}]", "data.eval_sets[0]"),
]


@pytest.mark.parametrize("override,field", BAD_VALUES)
def test_bad_value_names_the_field(override, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        tiny().with_overrides([override])


def test_dense_layers_and_group_limits_across_fields():
    with pytest.raises(ValueError, match=r"model\.dense_layers \(\[1\]\) cannot be combined"):
        tiny().with_overrides(["model.num_dense_layers=1", "model.dense_layers=[1]"])
    # top-3 needs at least 3 experts in the chosen groups: one group of 2 holds 2
    grouped = ["moe.n_groups=4", "moe.topk_groups=1", "moe.top_k=3"]
    with pytest.raises(ValueError, match=r"moe\.top_k \(3\) must be <= moe\.topk_groups x"):
        tiny().with_overrides(grouped)
    config = tiny().with_overrides([*grouped[:-1], "moe.top_k=2"])
    assert config.moe.group_limited and not tiny().moe.group_limited
    config = tiny().with_overrides(["model.num_layers=4", "model.dense_layers=[1, 3]"])
    assert [config.model.is_dense(i) for i in range(4)] == [False, True, False, True]
    assert config.model.num_dense == 2


def test_boolean_qk_norm_of_older_configs_reads_as_full_or_none(tmp_path):
    """qk_norm was true/false: a run's config.yaml, a YAML and --set still read, as the same
    model (true: the full-projection norm)."""
    for old, new in ((True, "full"), (False, "none")):
        data = tiny().to_dict()
        data["model"]["qk_norm"] = old
        assert RunConfig.from_dict(data).model.qk_norm == new
        assert tiny().with_overrides([f"model.qk_norm={str(old).lower()}"]).model.qk_norm == new
    assert tiny().with_overrides(["model.qk_norm=per_head"]).model.qk_norm == "per_head"


def test_eval_batches_of_older_configs_become_eval_sequences():
    """train.eval_batches (micro-batches per data-parallel rank) is read as eval_batches x
    micro_batch_size sequences, from a run's config.yaml or --set, with a warning."""
    data = tiny().to_dict()
    del data["train"]["eval_sequences"]
    data["train"]["eval_batches"] = 3
    with pytest.warns(FutureWarning, match=r"train.eval_batches \(3\) is replaced .* 24 seq"):
        assert RunConfig.from_dict(data).train.eval_sequences == 24
    with pytest.warns(FutureWarning):
        config = tiny().with_overrides(["train.micro_batch_size=2", "train.eval_batches=5"])
    assert config.train.eval_sequences == 10


def test_triton_adamw_kernel_is_for_the_replicated_optimizer():
    with pytest.raises(ValueError, match=r"train\.adamw_kernel.*sharded"):
        tiny().with_overrides(["train.optimizer=sharded", "train.adamw_kernel=triton"])
    tiny().with_overrides(["train.optimizer=sharded", "train.adamw_kernel=auto"])  # fine


def test_a_removed_field_set_true_says_why_and_false_is_accepted():
    """An older run's config.yaml (false) still loads; true names the field and why it went."""
    from moetrain.config import layer

    why = r"precision\.fp8_expert_weight_grad \(True\) was removed: .*slower"
    with pytest.raises(ValueError, match=why):
        tiny().with_overrides(["precision.fp8_expert_weight_grad=true"])
    with pytest.raises(ValueError, match=why):
        layer(tiny(), {"precision": {"fp8_expert_weight_grad": True}})
    assert layer(tiny(), {"precision": {"fp8_expert_weight_grad": False}}) == tiny()


def test_no_sync_needs_a_capacity_factor():
    """NoSync is capacity mode: without a factor its fixed blocks would need the worst case."""
    message = r"moe\.dispatcher \('no_sync'\) needs moe\.capacity_factor.*all_to_all"
    with pytest.raises(ValueError, match=message):
        tiny().with_overrides(["moe.dispatcher=no_sync"])
    config = tiny().with_overrides(["moe.dispatcher=no_sync", "moe.capacity_factor=1.25"])
    assert config.moe.capacity_factor == 1.25
    tiny().with_overrides(["moe.dispatcher=all_to_all"])  # dropless: fine


def test_top_k_message():
    with pytest.raises(ValueError, match=r"moe\.top_k \(9\) must be <= moe\.num_experts \(8\)"):
        tiny().with_overrides(["moe.top_k=9"])


def test_unknown_keys_and_sections():
    with pytest.raises(ValueError, match="moe.bogus"):
        tiny().with_overrides(["moe.bogus=1"])
    with pytest.raises(ValueError, match="unknown config section"):
        RunConfig.from_dict({"modle": {}})
    with pytest.raises(ValueError, match="section.field=value"):
        tiny().with_overrides(["moe.top_k"])


def test_yaml_round_trip(tmp_path):
    cfg = tiny().with_overrides(["train.lr=1e-3", "moe.capacity_factor=1.25", "name=x"])
    cfg.save_yaml(tmp_path / "c.yaml")
    assert RunConfig.load_yaml(tmp_path / "c.yaml") == cfg
    assert cfg.train.lr == 1e-3 and cfg.name == "x"


def test_presets_build_and_unknown_preset():
    for name in PRESETS:
        assert get_preset(name).moe.top_k <= get_preset(name).moe.num_experts
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("huge")


def test_ep_must_divide_dp():
    with pytest.raises(ValueError, match=r"parallel\.ep \(2\) must divide parallel\.dp \(3\)"):
        tiny().with_overrides(["parallel.ep=2", "parallel.dp=3"])


def test_layout_checks():
    cfg = tiny().with_overrides(["parallel.ep=2"])
    assert cfg.dp_size(4) == 4
    with pytest.raises(ValueError, match="parallel.ep"):
        cfg.dp_size(1)
    with pytest.raises(ValueError, match="parallel.pp"):
        tiny().with_overrides(["parallel.pp=2"]).dp_size(3)


def test_cuda_graph_on_where_it_cannot_run_is_an_error(tmp_path):
    from moetrain.train.trainer import Trainer

    config = tiny().with_overrides(["data.random_tokens=true", "train.steps=1"])
    assert (
        Trainer(config, tmp_path / "a", progress=False).step_graph is None
    )  # None on CPU: not graphed
    with pytest.raises(ValueError, match=r"train\.cuda_graph \(true\).*CUDA"):
        Trainer(config.with_overrides(["train.cuda_graph=true"]), tmp_path / "b", progress=False)


@pytest.mark.parametrize("field, value", [("model.d_model", 60), ("moe.expert_hidden", 100)])
def test_expert_gemm_widths_are_checked_at_start_up(field, value):
    """torch._grouped_mm needs 16-byte rows; a width it cannot run is a config error, not a
    silent per-expert loop at every step."""
    with pytest.raises(ValueError, match=f"{field}.*multiple of 8"):
        tiny().with_overrides([f"{field}={value}", "model.num_heads=2"])


def test_document_masking_rules_and_the_eos_id_from_the_data(tmp_cache):
    from moetrain.data import resolve_eos_id

    masking = ["data.document_masking=true"]
    for overrides, message in (
        (["data.reset_positions=true"], r"data\.reset_positions.*document_masking=true"),
        (["data.eos_id=3"], r"data\.eos_id \(3\) is read by document masking only"),
        ([*masking, "data.random_tokens=true"], r"data\.document_masking.*needs data\.eos_id"),
        ([*masking, "data.eos_id=320"], r"data\.eos_id \(320\) must be < model\.vocab_size"),
        ([*masking, "data.eos_id=-1"], r"data\.eos_id \(-1\) must be >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            tiny().with_overrides(overrides)
    random = tiny().with_overrides([*masking, "data.random_tokens=true", "data.eos_id=5"])
    assert resolve_eos_id(random) == random  # benchmarks: the id as given
    assert resolve_eos_id(tiny()) == tiny()  # off: nothing resolved, nothing read
    resolved = resolve_eos_id(tiny().with_overrides(masking))  # the embedded byte corpus
    assert resolved.data.eos_id == 256
    assert resolve_eos_id(resolved) == resolved
    with pytest.raises(ValueError, match=r"data\.eos_id \(5\) differs from the EOS id.*\(256\)"):
        resolve_eos_id(tiny().with_overrides([*masking, "data.eos_id=5"]))
