import tempfile, torch, draftgraph as dg, logging
from draftgraph.models.llama import CausalLM
from draftgraph.compiler.artifacts import build_artifacts
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged
import sys
logging.basicConfig(level=logging.WARNING)
backend = sys.argv[1]
kind = sys.argv[2]
t = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
d = make_drafter(kind, t)
cfg = dg.CompileConfig(mode="FULL_AND_PIECEWISE", num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=64, compile_backend=backend, progress=False, capture_sizes=(1, 4, 16, 64))
eng = dg.compile_model(t, d, cfg)
prompts, params, arrivals = ragged(16)
ref = [o.token_ids for o in eng.generate(prompts, params, arrivals)]
out = tempfile.mkdtemp()
import shutil; shutil.rmtree(out)
m = build_artifacts(eng, out)
print(open(out + "/summary.txt").read())
eng2 = dg.compile_model(t, d, cfg, artifacts=out, strict_artifacts=True)
print(eng2.warm_up_report)
got = [o.token_ids for o in eng2.generate(prompts, params, arrivals)]
print("equal", got == ref, eng2.compiled.counters.traces, eng2.compiled.counters.inductor_compiles, eng2.stats()["dispatch"])
