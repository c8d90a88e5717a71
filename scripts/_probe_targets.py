import torch, draftgraph as dg
from draftgraph.models.llama import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
t = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
targets, argtypes = set(), set()
def walk(a):
    if isinstance(a, (list, tuple)):
        for x in a: walk(x)
    elif isinstance(a, dict):
        for x in a.values(): walk(x)
    else: argtypes.add(type(a).__name__)
for kind in ["eagle", "eagle3", "draft_model", "mtp"]:
    eng = dg.compile_model(t, make_drafter(kind, t), dg.CompileConfig(mode="FULL_AND_PIECEWISE", num_speculative_tokens=3, compile_backend="eager", progress=False, max_num_seqs=4, max_num_batched_tokens=32))
    for b in [eng.compiled.target.backend, eng.compiled.drafter.backend, eng.compiled.loop_backend]:
        for rec in b.records:
            for m in [rec["split"].module] + [p.graph for p in rec["split"].pieces]:
                for n in m.graph.nodes:
                    if n.op == "call_function": targets.add((type(n.target).__name__, getattr(n.target, "__module__", None), getattr(n.target, "__qualname__", None) or str(n.target)))
                    walk(n.args); walk(n.kwargs)
for x in sorted(targets, key=str): print(x)
print(argtypes)
