"""The model-family registry (models/families/): each family claims the configs of its model types, an unknown
model_type is refused with the supported list, a config whose parts disagree with its family is refused, and
no code outside the registry (and the config itself) dispatches on which optional parts a config carries."""

import ast
from pathlib import Path

import pytest
import torch
import transformers

import draftgraph
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import MODEL_TYPES, ModelConfig
from draftgraph.models.deepseek import DeepseekLayer
from draftgraph.models.deepseek_v32 import SparseMLAttention
from draftgraph.models.families import (
    AttentionForm,
    MTPHead,
    families,
    family_for_type,
    family_named,
    family_of,
    supported_model_types,
)
from draftgraph.models.layers import DecoderLayer
from draftgraph.models.qwen3_5 import Qwen3_5Layer
from draftgraph.runtime.kv_cache import KVCacheSpec
from tests.helpers import tiny_deepseek_config, tiny_hf_config
from tests.test_qwen3_5 import MOE, SMALL

ROOT = Path(draftgraph.__file__).parent


def v32_config():
    keys = transformers.DeepseekV32Config.__annotations__
    kw = {k: v for k, v in tiny_deepseek_config().to_dict().items() if k in keys}
    kw.update(index_topk=8, index_n_heads=4, index_head_dim=16, mlp_layer_types=None)
    kw.pop("head_dim", None)
    return transformers.DeepseekV32Config(**kw)


# model_type -> a tiny transformers config of it (what ModelConfig.from_hf reads).
HF_CONFIGS = {
    "llama": lambda: tiny_hf_config("llama"),
    "qwen2": lambda: tiny_hf_config("qwen2"),
    "qwen3": lambda: tiny_hf_config("qwen3"),
    "mistral": lambda: tiny_hf_config("mistral"),
    "deepseek_v3": tiny_deepseek_config,
    "deepseek_v32": v32_config,
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**SMALL, intermediate_size=96),
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(**SMALL, **MOE),
}
LAYERS = {"llama": DecoderLayer, "deepseek_v3": DeepseekLayer, "deepseek_v32": DeepseekLayer, "qwen3_5": Qwen3_5Layer}


def test_the_registry_claims_every_supported_model_type_once():
    claimed = [t for family in families() for t in family.model_types]
    assert sorted(claimed) == sorted(set(claimed)) == sorted(MODEL_TYPES) == list(supported_model_types())
    assert sorted(HF_CONFIGS) == sorted(claimed)  # this test builds a config of each
    assert [f.name for f in families()] == ["llama", "deepseek_v3", "deepseek_v32", "qwen3_5"]


@pytest.mark.parametrize("family", [f.name for f in families()])
def test_each_family_claims_the_configs_of_its_model_types(family):
    fam = family_named(family)
    for model_type in fam.model_types:
        cfg = ModelConfig.from_hf(HF_CONFIGS[model_type]())
        assert cfg.model_type == model_type
        assert family_of(cfg) is fam
        with torch.device("meta"):
            model = CausalLM(cfg)
        assert {type(layer) for layer in model.layers} == {LAYERS[family]}
        assert model.norm.zero_centered == (family == "qwen3_5")
        linear = KVCacheSpec.for_model(cfg, cfg.num_layers, 4, 16).linear_layers
        assert linear == ((0, 2, 3) if family == "qwen3_5" else ())  # SMALL's linear-attention layers


def test_the_families_declare_attention_form_and_drafter_heads():
    assert {f.name: f.attention for f in families()} == {
        "llama": AttentionForm.PAGED_GQA,
        "deepseek_v3": AttentionForm.MLA,
        "deepseek_v32": AttentionForm.SPARSE_MLA,
        "qwen3_5": AttentionForm.HYBRID,
    }
    assert {f.name: f.mtp for f in families()} == {
        "llama": MTPHead.OWN_CONFIG,
        "deepseek_v3": MTPHead.TARGET_LAYER,
        "deepseek_v32": MTPHead.TARGET_LAYER,
        "qwen3_5": MTPHead.QWEN3_5,
    }
    with torch.device("meta"):
        v32 = CausalLM(ModelConfig.from_hf(v32_config()))
    assert all(type(layer.attn) is SparseMLAttention for layer in v32.layers)


def test_the_multimodal_qwen3_5_wrapper_is_claimed_for_its_text_model():
    text = transformers.Qwen3_5MoeTextConfig(**SMALL, **MOE)
    wrapper = transformers.Qwen3_5MoeConfig(text_config=text.to_dict()).to_dict()
    assert family_of(ModelConfig.from_hf(wrapper)) is family_named("qwen3_5")


def test_an_unknown_model_type_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported; supported: \['deepseek_v3'.*'qwen3'"):
        family_for_type("gpt2")
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported; supported:.*'llama'"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="model family 'gpt' is not registered; registered: .*'llama'"):
        family_named("gpt")


def test_a_config_whose_parts_disagree_with_its_family_is_refused():
    v32 = ModelConfig.from_hf(v32_config())
    with pytest.raises(ValueError, match="deepseek_v32 family, whose configs carry `indexer`, but this .* has none"):
        family_of(v32.replace(indexer=None))
    dense = v32.replace(model_type="deepseek_v3", indexer=None)  # V3 on V3.2's weights (test_deepseek_v32)
    assert family_of(dense) is family_named("deepseek_v3")
    llama = ModelConfig.from_hf(tiny_hf_config("llama"))
    with pytest.raises(ValueError, match="llama family, whose configs have no `mla`, but this ModelConfig has one"):
        family_of(llama.replace(mla=v32.mla))


PARTS = ("mla", "hybrid", "indexer")
ALLOWED = ("models/families/", "models/config.py")  # the registry and the config itself


def part_dispatches(source: str) -> list[int]:
    """Lines of `<x>.mla / .hybrid / .indexer is (not) None` comparisons: a test of which family a config is."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        has_part = any(isinstance(o, ast.Attribute) and o.attr in PARTS for o in operands)
        has_none = any(isinstance(o, ast.Constant) and o.value is None for o in operands)
        if has_part and has_none and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            lines.append(node.lineno)
    return lines


def test_no_code_outside_the_registry_dispatches_on_config_parts():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(ROOT.rglob("*.py"))
        if not str(path.relative_to(ROOT)).startswith(ALLOWED)
        for line in part_dispatches(path.read_text())
    ]
    # 0: every family dispatch asks family_of(cfg) (there were 31 in 9 files before the registry).
    assert found == [], "ask models.families.family_of(cfg) instead:\n" + "\n".join(found)


def test_the_scan_sees_a_part_dispatch():
    src = "def f(cfg):\n    if cfg.hybrid is not None:\n        pass\n    return 1 if t.cfg.mla is None else 2\n"
    assert part_dispatches(src) == [2, 4]
    assert part_dispatches("x = cfg.hybrid.linear if cfg.moe is not None else None\n") == []
