"""Every config field declares, where it is defined, whether a resume may change it and what each
export format can represent; a field that declares nothing is frozen and exports its default
value only, so a new field can never slip through a resume or an export unchecked."""

import dataclasses

import pytest

from moetrain.config import SECTION_TYPES, MoEConfig
from moetrain.config.fields import ANY, FORMATS, frozen, missing_declarations, resumable
from moetrain.config.presets import tiny
from moetrain.tools.convert import hf
from moetrain.train.resume_config import check_resumable


def test_every_field_of_every_section_declares_its_resume_and_export_rules():
    for section, section_type in SECTION_TYPES.items():
        assert missing_declarations(section_type) == [], section


def test_missing_declarations_names_each_undeclared_field():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Section:
        declared: int = frozen(1, olmoe=ANY)
        plain: int = 2
        no_format: int = frozen(3)
        setting: int = resumable(4, in_model=False)

    assert FORMATS == ("olmoe", "qwen3_moe", "mixtral")  # the messages below name them
    assert missing_declarations(Section) == [
        "declared (no export rule for qwen3_moe, mixtral)",
        "plain (no frozen/resumable)",
        "no_format (no export rule for olmoe, qwen3_moe, mixtral)",
    ]
    with pytest.raises(TypeError, match="unknown export format"):
        frozen(0, olmo=ANY)


def test_a_new_routing_field_without_rules_is_frozen_and_exports_only_its_default():
    """The two silent paths of a new field: resumed with another value, or exported as if it
    were not there (a new routing option exported as plain top-k)."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class RoutingMoE(MoEConfig):
        num_groups: int = 1  # a new routing option, declared nothing

    base = tiny()
    saved = dataclasses.replace(base, moe=RoutingMoE(**dataclasses.asdict(base.moe)))
    changed = dataclasses.replace(saved, moe=dataclasses.replace(saved.moe, num_groups=2))
    hf.check_expressible(saved)  # its default value exports
    with pytest.raises(ValueError, match=r"moe\.num_groups cannot change on --resume \(1 in x"):
        check_resumable(saved, changed, "x.yaml")
    with pytest.raises(ValueError, match=r"OlmoeForCausalLM: moe\.num_groups \(2\): only 1 is"):
        hf.check_expressible(changed)
