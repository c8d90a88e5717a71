"""The Gated DeltaNet custom op: `torch.ops.draftgraph.gated_delta_net` (conv + gated delta rule over a flat
batch of token runs, with per-request state kept across steps and rolled back on rejection for free).

Contract (stable: the Triton kernels implement exactly this; reference.py is the oracle)
-----------------------------------------------------------------------------------------
Inputs, for T tokens of B requests (the flat layout of every forward; Hk/HV k/v heads, Dk/Dv head dims,
C = conv_dim = 2*Hk*Dk + HV*Dv, W = conv kernel):
- x [T, C] model dtype: in_proj's [q | k | v] before the conv.
- g [T, HV] float32: log decay (<= 0), -exp(A_log) * softplus(a + dt_bias); beta [T, HV] float32: sigmoid(b).
- conv_weight [C, W]: depthwise causal conv taps (tap W-1 multiplies the current token).
- conv_states [R, Lc, C] model dtype, MUTATED: per request row, a ring of conv INPUTS by position: the input
  of position p sits at column p % Lc.
- ssm_states [R, L, HV, Dk, Dv] float32, MUTATED: per request row, a ring of recurrent states by position:
  the state after position p sits at entry p % L. (Layout [HV, Dk, Dv] as transformers: o = S^T q.)
- req_rows [B] int: each request's row of the rings. Row R-1 is scratch (no request owns it): the reference
  routes its dropped writes there; a kernel may simply skip them.
- query_start_loc [B+1] int32, token_req [T] int32, token_kv_len [T] int32: the attention metadata's. A token
  with token_kv_len 0 is padding (read nothing, write nothing); otherwise its position is token_kv_len - 1.
  Request b's tokens are rows query_start_loc[b] .. +n_b - 1 at consecutive positions p0_b .. p0_b + n_b - 1.
Output [T, HV, Dv] in x's dtype: o_t = S_t^T q_t after token t's update (q, k l2-normalised, q * Dk^-0.5,
k head j // (HV/Hk) serving v head j); zeros for padding tokens.

Per request run:
1. conv input at position p - d: the run's own row if p - d >= p0, else conv_states[row, (p - d) % Lc] if
   p - d >= 0, else 0; then SiLU.
2. initial state: zeros if p0 == 0, else ssm_states[row, (p0 - 1) % L].
3. writes: the conv inputs of the run's last min(n, Lc) positions to conv_states[row, p % Lc]; the state
   after each of its last min(n, L) positions to ssm_states[row, p % L]. Reads of step 1-2 happen before.

Why this rolls back for free. A verify of 1 + K tokens at positions n..n+K writes the state after every one
of them; the engine then accepts a drafts and its next forward of that request starts at position n+a+1,
so step 2 reads entry (n+a) % L: the state after the last accepted token, with no copy, no selection pass,
no host sync and no hook in the step. Nothing else reads a stale entry as long as L covers the positions a
request writes between the one a later forward starts from and that forward: L = K + 1 for a target
(verify writes n..n+K, the next read is n+a), K + 2 for a draft model (its first step writes n..n+K+1 and
its K - 1 later steps up to n+a+K; the next round reads n+a), and Lc = L + W - 2 for the conv inputs (the
W - 1 inputs before the next start). runtime/state_cache.py sizes the rings and maps requests to rows. The
memory price: L full states per request and layer instead of one (as vLLM's per-position slots).

Implementations (ops/backends.py LINEAR_ATTENTION_BACKENDS): "reference" (reference.py) and "triton"
(triton_gdn.py: a conv kernel and a recurrent kernel; chunked.py: fla-core's chunked kernel for long runs'
heads outside graph captures).
"""

from __future__ import annotations

import torch

from draftgraph.ops.backends import check_linear_attention
from draftgraph.ops.linear_attention.reference import gated_delta_net_reference
from draftgraph.ops.registry import custom_op


@custom_op("draftgraph::gated_delta_net", mutates_args=("conv_states", "ssm_states"))
def gated_delta_net(
    x: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    req_rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_req: torch.Tensor,
    token_kv_len: torch.Tensor,
    impl: str,
) -> torch.Tensor:
    """See the module docstring. `impl`: an implementation of ops/backends.py's LINEAR_ATTENTION_BACKENDS."""
    check_linear_attention(impl, x.device.type)
    args = (x, g, beta, conv_weight, conv_states, ssm_states, req_rows, query_start_loc, token_req, token_kv_len)
    if impl == "triton":
        from draftgraph.ops.linear_attention.triton_gdn import gated_delta_net_triton

        return gated_delta_net_triton(*args)
    return gated_delta_net_reference(*args)


@gated_delta_net.register_fake
def _(x, g, beta, conv_weight, conv_states, ssm_states, req_rows, query_start_loc, token_req, token_kv_len, impl):
    return x.new_empty(x.shape[0], ssm_states.shape[2], ssm_states.shape[4])
