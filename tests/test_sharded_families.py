"""Sharded checkpoint reads for every family: each tensor-parallel rank reads only its share
(models/parallel/sharded_read.py, the cuts of models/parallel/shard_cut.py).

Tiny float32 checkpoints saved with save_pretrained (several safetensors files under an index): DeepSeek-V3
with its MTP layer stored after the decoder (hub layout, its own LM head), DeepSeek-V3.2 (the indexer,
replicated), Qwen3.5 dense and MoE with their `mtp.*` heads (the MoE head's experts fused: [gate | up] rows),
and an EAGLE-3 head beside a Llama target. For every rank of tp = 2, and of tp = 3 on 6-head variants (q|k|v
parts of unequal sizes), in one process (loading runs no collective): the model (target or drafter) built
from the partial read equals the one built from the whole checkpoint sliced in memory, tensor for tensor
(torch.equal). Every read goes through a recording safe_open, checked against an oracle written here (SPLIT,
the names the design splits): a split tensor is never read whole and its bytes read are exactly 1/tp of it,
a replicated one is read whole once, fused tensors are read as one range per part, and what the loaded model
does not hold (the MTP layer for the target, the target's layers for its MTP head) is not read at all.
One end-to-end run: a TP = 2 gloo engine (DeepSeek-V3, its MTP head from the same checkpoint) gives the
one-process engine's greedy tokens and accepted drafts.
"""

import json
import re

import pytest
import torch
import transformers
from safetensors.torch import save_file

import draftgraph as dg
from draftgraph.models.builtin import module_from_state_dict
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.drafters.loader import load_drafter
from draftgraph.models.drafters.qwen3_5_mtp import random_mtp_weights
from draftgraph.models.weights import read_checkpoint, read_target_config
from draftgraph.ops.collectives.op import ParallelGroup
from tests.helpers import tiny_deepseek_model, tiny_hf_model
from tests.test_deepseek_v32 import tiny_v32_model
from tests.test_qwen3_5 import MOE, SMALL
from tests.test_sharded_load import recorded_reads
from tests.test_tensor_parallel import SHAPE, spawn
from tests.test_tp_deepseek import mtp_weights
from tests.test_tp_drafters import head_weights

# The oracle: stored names every rank holds a 1/tp share of (all others are replicated: norms, routers, q_a /
# kv_a, the V3.2 indexer, row-parallel biases, fc / eh_proj, d2t / t2d).
SPLIT = re.compile(
    r"(\.|^)(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj|gate_proj|up_proj|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a"
    r"|conv1d)\.(weight|bias)$|(\.|^)(o_proj|down_proj|out_proj)\.weight$|(^|\.)(embed_tokens|lm_head|head)\.weight$"
    r"|experts\.(gate_up_proj|down_proj)$|\.(A_log|dt_bias)$"
)
PARTS = {"gate_up_proj": 2, "in_proj_qkv.weight": 3, "conv1d.weight": 3}  # fused: one read per part
ODD_DEEPSEEK = dict(num_attention_heads=6, num_key_value_heads=6, intermediate_size=96, moe_intermediate_size=48)
ODD_QWEN = dict(num_attention_heads=6, num_key_value_heads=3, linear_num_key_heads=3, linear_num_value_heads=6,
                linear_value_head_dim=12)  # fmt: skip  # q | k | v rows of 48 | 48 | 72


def _save(hf, path, extra=None, config=None) -> str:
    """save_pretrained in several files; `extra` tensors (a head stored beside the model) in one more file."""
    hf.save_pretrained(path, max_shard_size="100KB")
    index = path / "model.safetensors.index.json"
    assert index.exists()  # several files under an index
    if extra:
        save_file({k: v.contiguous() for k, v in extra.items()}, path / "extra.safetensors")
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(extra, "extra.safetensors"))
        index.write_text(json.dumps(data))
    if config:
        cfg = json.loads((path / "config.json").read_text()) | config
        (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _qwen3_5(moe: bool, odd: bool):
    torch.manual_seed(0)
    kw = SMALL | (ODD_QWEN if odd else {})
    if moe:
        kw |= MOE | ({"shared_expert_intermediate_size": 48} if odd else {})
        return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kw)).eval()
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw, intermediate_size=96)).eval()


def _deepseek_mtp(full: CausalLM) -> dict:
    """The MTP layer in the hub layout, with its own LM head (cut by vocabulary rows when split)."""
    w = mtp_weights(full)
    w[f"model.layers.{full.cfg.num_layers}.shared_head.head.weight"] = full.head_weight.detach().clone()
    return w


def _checkpoint(tmp_path, name: str):
    """(path, target's whole config, the drafter's kind and upstream weights in memory, or None)."""
    path = tmp_path / name
    if name == "v32":
        return _save(tiny_v32_model(), path), None
    if name.startswith("v3"):
        hf = tiny_deepseek_model(**(ODD_DEEPSEEK if name.endswith("odd") else {}))
        head = _deepseek_mtp(CausalLM.from_hf(hf))
        return _save(hf, path, head, {"num_nextn_predict_layers": 1}), ("mtp", head)
    if name.startswith("qwen"):
        hf = _qwen3_5("moe" in name, name.endswith("odd"))
        head = random_mtp_weights(CausalLM.from_hf(hf).cfg, torch.Generator().manual_seed(3))
        return _save(hf, path, head), ("mtp", head)
    hf = tiny_hf_model("llama", **SHAPE)  # a Llama target (its own save), the EAGLE-3 head in a directory
    _save(hf, path)
    head = head_weights("eagle3", CausalLM.from_hf(hf))
    (path / "eagle3").mkdir()
    save_file({k: v.contiguous() for k, v in head.items()}, path / "eagle3" / "model.safetensors")
    (path / "eagle3" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(path), ("eagle3", head)


def _check_reads(log, whole: dict, read: set, w: int):
    """Exactly the names `read` were read: split ones as 1/w of their bytes (one range per fused part),
    the others whole, once."""
    got_bytes, slices, whole_reads = {}, {}, {}
    for name, n, full in log:
        got_bytes[name] = got_bytes.get(name, 0) + n
        counter = whole_reads if full else slices
        counter[name] = counter.get(name, 0) + 1
    assert got_bytes.keys() == read, sorted(got_bytes.keys() ^ read)[:5]
    split = {n for n in read if SPLIT.search(n)}
    assert split and split != read  # both kinds present
    for name in read:
        parts = next((p for s, p in PARTS.items() if name.endswith(s)), 1)
        if name in split:
            assert (got_bytes[name], slices[name], name in whole_reads) == (whole[name].nbytes // w, parts, False)
        else:
            assert (got_bytes[name], whole_reads[name], name in slices) == (whole[name].nbytes, 1, False), name
    return sum(got_bytes.values()), sum(t.nbytes for t in whole.values())


def _same(got: torch.nn.Module, want: torch.nn.Module):
    g, w = got.state_dict(), want.state_dict()
    assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w), [
        k for k in w if not torch.equal(g[k], w[k])
    ]


CASES = [("v3", 2), ("v3_odd", 3), ("v32", 2), ("qwen", 2), ("qwen_moe", 2), ("qwen_moe_odd", 3), ("llama", 2)]


@pytest.mark.parametrize("name,w", CASES, ids=[f"{n}-tp{w}" for n, w in CASES])
def test_each_rank_reads_only_its_share(tmp_path, name, w):
    path, drafter = _checkpoint(tmp_path, name)
    cfg = ModelConfig.from_hf(read_target_config(path))
    whole = read_checkpoint(path)
    not_target = (f"model.layers.{cfg.num_layers}.", "mtp.")  # the MTP heads stored beside the targets
    for rank in range(w):
        tp = ParallelGroup(rank, w, "unused")
        log = []
        with recorded_reads(log, lambda n: SPLIT.search(n) is not None):
            got = CausalLM.from_pretrained(path, tp=tp)
        target = CausalLM.from_state_dict(cfg, whole, tp=tp)  # the whole checkpoint, sliced in memory
        _same(got, target)
        read, total = _check_reads(log, whole, {k for k in whole if not k.startswith(not_target)}, w)
        assert read < total
        if drafter is None:
            continue
        kind, head = drafter
        src = f"{path}/eagle3" if kind == "eagle3" else path
        aux = (0, 1, cfg.num_layers - 1) if kind == "eagle3" else None
        log = []
        with recorded_reads(log, lambda n: SPLIT.search(n) is not None):
            got = load_drafter(src, target, kind=kind, tp=tp, aux_layers=aux)
        _same(got, load_drafter(module_from_state_dict(head), target, kind=kind, tp=tp, aux_layers=aux))
        _check_reads(log, whole if kind != "eagle3" else read_checkpoint(src), set(head), w)  # its keys only


def _deepseek_engine(tp: ParallelGroup, path: str):
    spec = dg.CompileConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=32, num_speculative_tokens=2)
    params = dg.SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[1, 5, 9, 3, 2], [7, 7], [11, 12, 13, 14, 15, 16, 17]]
    full = CausalLM.from_pretrained(path)
    one = dg.compile_model(full, load_drafter(path, full, kind="mtp"), spec)
    want = [o.token_ids for o in one.generate(prompts, params)]
    shard = CausalLM.from_pretrained(path, tp=tp)  # every rank reads its share of the target, then of the head
    eng = dg.compile_model(shard, load_drafter(path, shard, kind="mtp", tp=tp), spec)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert eng.stats()["accepted_tokens"] == one.stats()["accepted_tokens"] > 0  # the same drafts


def test_tp2_engine_loaded_in_shares_equals_one_process(tmp_path):
    path, _ = _checkpoint(tmp_path, "v3")
    spawn(_deepseek_engine, 2, tmp_path, path)


@pytest.mark.parametrize("name", ["v3", "v32", "qwen_moe_odd", "llama"])
def test_reads_through_the_device_loader_equal_the_plain_read(tmp_path, monkeypatch, name):
    """What a GPU read does (models/mapped_read.DeviceLoader: each share copied in chunks, a fused tensor's parts
    concatenated at the destination), made on the CPU with a buffer of a few rows: every family's target share and
    its drafter (DeepSeek's MTP layer, V3.2, Qwen3.5-MoE's `mtp.*` head with unequal q / k / v parts, EAGLE-3) equal
    the plain read, tensor for tensor."""
    from draftgraph.models.mapped_read import DeviceLoader
    from draftgraph.models.parallel import sharded_read

    path, drafter = _checkpoint(tmp_path, name)
    cfg = ModelConfig.from_hf(read_target_config(path))
    w = 3 if name.endswith("odd") else 2
    tp = ParallelGroup(w - 1, w, "unused")
    plain = CausalLM.from_pretrained(path, tp=tp)
    loaders, real = [], sharded_read._Reader

    class Staged(real):
        def __init__(self, loader):
            super().__init__(DeviceLoader(torch.device("cpu"), stage_bytes=512, pin=False))
            loaders.append(self.loader)

    monkeypatch.setattr(sharded_read, "_Reader", Staged)
    _same(CausalLM.from_pretrained(path, tp=tp), plain)
    if drafter is not None:
        kind, _ = drafter
        src = f"{path}/eagle3" if kind == "eagle3" else path
        aux = (0, 1, cfg.num_layers - 1) if kind == "eagle3" else None
        got = load_drafter(src, plain, kind=kind, tp=tp, aux_layers=aux)
        monkeypatch.setattr(sharded_read, "_Reader", real)  # the plain read of the drafter
        _same(got, load_drafter(src, plain, kind=kind, tp=tp, aux_layers=aux))
    assert loaders and all(loader.copied_bytes > 0 for loader in loaders)
