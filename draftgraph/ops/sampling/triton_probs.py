"""Top-k / top-p probabilities in Triton: the sort-free algorithm of sampler.py (same keys, same cuts, same
kept set, ties included), with each 32-step threshold search replaced by a radix select.

Every row is split over S programs (grid (N, S), S from host-known sizes so a few rows still fill the GPU);
program s covers columns [s*chunk, (s+1)*chunk). The keys are the int32 order-preserving keys of the
temperature-scaled float32 logits, recomputed from the logits in every pass (read, not stored), taken in
offset binary u = key + 2^31 (unsigned order = float order). A threshold is the largest u with
W(keys >= u) >= target, chosen digit by digit from the top (PASSES digits of BITS bits): pass p histograms
the digit p of the keys whose upper digits equal the prefix chosen so far, each program writing its own
[BINS] slice of a scratch [N, PASSES, S, BINS] (no atomics: float sums stay deterministic). The next kernel's
programs each make pick p from those slices and the state after pick p - 1 (`_pick`: the largest digit whose
cumulated weight from the top still reaches the target; split 0 stores the new state, a [N, slots, 2] int32
scratch, for the kernel after), so one kernel per pass and no host sync. Kernels per call: PASSES for top-k
(counts, `tl.histogram`), PASSES for top-p (masses, a one-hot sum; unnormalised exp(x - max), the tokens tied
at the top-k cut added as r_k of them at the cut's bin since only the first r_k by index are kept; blocks
with no key at or above the top-k cut are skipped), one that writes. Pass 0 of top-k also stores each split's
max and first argmax; top-k passes do nothing for rows whose k is off, top-p passes 1.. nothing for rows
with top_p 1, and greedy rows only take the max. Float divisions are div_rn (IEEE, as torch's).

The writing kernel knows everything in closed form: the ties at a cut are kept lowest index first (their
rank = ties in earlier splits, from the last pass's histogram, + a running cumsum), exactly r_k at the top-k
cut and, at the top-p cut, the first j where j is the largest rank with rank 1 or mass_above + (rank - 1) *
tie_prob < top_p (found by bisection: the rule is monotone in the rank); the kept mass is mass_above +
j * exp(x_tie - max). Float sums run in another order than the torch-ops version, so as there a token whose
mass-before lies within float rounding of top_p may fall on the other side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops import triton_math
from draftgraph.ops.backends import device_sm_count, triton_interpreting
from draftgraph.ops.launch import launch

BITS = 4  # radix digit: 32 / BITS passes per cut
BLOCK = 1024  # columns per step of the count and write passes
MASS_TILE = 4096  # elements of the mass passes' [columns, bins] one-hot sum per step: 256 columns at 16 bins
MIN_CHUNK = 2048  # columns per program at least
PROGRAMS_PER_SM = 2


def choose_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Programs per row: about PROGRAMS_PER_SM per SM over all rows, at least MIN_CHUNK columns each."""
    if device.type != "cuda":
        return 1
    sms = device_sm_count(device)
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, rows), triton.cdiv(vocab, MIN_CHUNK)))


@triton.jit
def _keys(logits_ptr, row, stride, cols, inb, temp):
    """Scaled float32 logits and their offset-binary keys (uint32; -0.0 as +0.0)."""
    x = tl.load(logits_ptr + row * stride + cols, mask=inb, other=0.0).to(tl.float32)
    x = tl.math.div_rn(x, temp)
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return x, (key ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _float_of(u):
    """The float32 whose key is u (inverse of `_keys`)."""
    key = (u ^ 0x80000000).to(tl.int32, bitcast=True)
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _tie_mass(t_k, r_k, m, ACCURATE: tl.constexpr):
    """The unnormalised mass of the r_k tokens kept at the top-k cut (all equal to the cut's float)."""
    return tl.where(r_k > 0, r_k.to(tl.float32) * triton_math.exp(_float_of(t_k) - m, ACCURATE), 0.0)


@triton.jit
def _row_params(temp_ptr, topk_ptr, topp_ptr, row, V):
    t = tl.load(temp_ptr + row)
    greedy = t <= 0
    k = tl.load(topk_ptr + row)
    k = tl.where((k > 0) & (k < V), k, V)
    return greedy, tl.where(greedy, 1.0, t), k, tl.load(topp_ptr + row)


@triton.jit
def _histogram_of(ptr, row, q, S, PASSES: tl.constexpr, BINS: tl.constexpr, S_BLOCK: tl.constexpr):
    """[BINS] sum over the S splits of pass q's slices."""
    sp = tl.arange(0, S_BLOCK)[:, None]
    offs = ((row * PASSES + q) * S + sp) * BINS + tl.arange(0, BINS)[None, :]
    return tl.sum(tl.load(ptr + offs, mask=sp < S, other=0), axis=0)


@triton.jit
def _pick(h, above, target, total, MASS: tl.constexpr, BINS: tl.constexpr):
    """The largest digit d with above + W(digit >= d) >= target (0 when none); above grows by W(digit > d)."""
    bins = tl.arange(0, BINS)
    suffix = tl.sum(tl.where(bins[None, :] >= bins[:, None], h[None, :], 0), axis=1)  # [BINS] W(digit >= d)
    if MASS:
        ok = tl.math.div_rn(above + suffix, total) >= target
    else:
        ok = above + suffix >= target
    d = tl.max(tl.where(ok, bins, 0), axis=0)
    return d, above + tl.sum(tl.where(bins > d, h, 0), axis=0)


@triton.jit
def _state(st_ptr, row, q, SLOTS: tl.constexpr, MASS: tl.constexpr):
    """(prefix of q digits, weight above it) after q picks: slot q of [N, SLOTS, 2] int32 (mass as float bits)."""
    if q == 0:
        prefix = tl.zeros((), tl.uint32)
        if MASS:
            above = tl.zeros((), tl.float32)
        else:
            above = tl.zeros((), tl.int32)
    else:
        prefix = tl.load(st_ptr + (row * SLOTS + q) * 2).to(tl.uint32, bitcast=True)
        above = tl.load(st_ptr + (row * SLOTS + q) * 2 + 1)
        if MASS:
            above = above.to(tl.float32, bitcast=True)
    return prefix, above


@triton.jit
def _store_state(st_ptr, row, q, prefix, above, SLOTS: tl.constexpr):
    tl.store(st_ptr + (row * SLOTS + q) * 2, prefix.to(tl.int32, bitcast=True))
    tl.store(st_ptr + (row * SLOTS + q) * 2 + 1, above.to(tl.int32, bitcast=True))


@triton.jit
def _next_top_k(hk_ptr, kst_ptr, row, S, k, Q, BITS: tl.constexpr, PASSES: tl.constexpr,
                S_BLOCK: tl.constexpr):  # fmt: skip
    """The top-k cut's (prefix, count above) after Q + 1 picks, from the state after Q and pass Q's counts."""
    prefix, above = _state(kst_ptr, row, Q, PASSES + 1, False)
    h = _histogram_of(hk_ptr, row, Q, S, PASSES, 1 << BITS, S_BLOCK)
    d, above = _pick(h, above, k, 1.0, False, 1 << BITS)
    return (prefix << BITS) | d.to(tl.uint32), above


@triton.jit
def _next_top_p(hp_ptr, pst_ptr, row, S, top_p, total, tie_u, tie_mass, Q, BITS: tl.constexpr,
                PASSES: tl.constexpr, S_BLOCK: tl.constexpr):  # fmt: skip
    """The top-p cut's (prefix, unnormalised mass above) after Q + 1 picks; the top-k cut's kept ties
    (tie_mass in all) counted in the bin of tie_u."""
    BINS: tl.constexpr = 1 << BITS
    bins = tl.arange(0, BINS)
    prefix, above = _state(pst_ptr, row, Q, PASSES, True)
    h = _histogram_of(hp_ptr, row, Q, S, PASSES, BINS, S_BLOCK)
    tie_bin = bins == ((tie_u >> _shift(32 - BITS * (Q + 1))) & (BINS - 1)).to(tl.int32)
    if Q > 0:
        tie_bin = tie_bin & ((tie_u >> _shift(32 - BITS * Q)) == prefix)
    d, above = _pick(h + tl.where(tie_bin, tie_mass, 0.0), above, top_p, total, True, BINS)
    return (prefix << BITS) | d.to(tl.uint32), above


@triton.jit
def _shift(n):
    """A shift amount as uint32: uint32 keys shift logically whether n is a constant or a run-time pass."""
    return tl.cast(n, tl.uint32)


@triton.jit
def _matches(u, prefix, PASS, BITS: tl.constexpr):
    """Keys whose upper PASS digits equal prefix (every key at pass 0; the shift by 32 it would take there
    is clamped, and its result not used)."""
    return (PASS == 0) | ((u >> _shift(tl.minimum(32 - BITS * PASS, 31))) == prefix)


@triton.jit(do_not_specialize=["S", "PASS"])  # PASS at run time: one compiled kernel serves every pass
def _top_k_pass(logits_ptr, stride, temp_ptr, topk_ptr, topp_ptr, hk_ptr, kst_ptr, mx_ptr, ix_ptr, V, S, chunk,
                PASS, BITS: tl.constexpr, PASSES: tl.constexpr, S_BLOCK: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    """Pass PASS of the top-k cut: counts of digit PASS among keys matching the prefix; pass 0 also the max."""
    row, split = tl.program_id(0), tl.program_id(1)
    greedy, temp, k, top_p = _row_params(temp_ptr, topk_ptr, topp_ptr, row, V)
    work = (k < V) & ~greedy
    if (PASS == 0) | work:
        prefix = tl.zeros((), tl.uint32)
        if (PASS > 0) & work:
            prefix, above = _next_top_k(hk_ptr, kst_ptr, row, S, k, PASS - 1, BITS, PASSES, S_BLOCK)
            if split == 0:
                _store_state(kst_ptr, row, PASS, prefix, above, PASSES + 1)
        hist = tl.zeros((1 << BITS,), tl.int32)
        best = tl.full((), float("-inf"), tl.float32)
        best_i = tl.zeros((), tl.int32)
        for start in range(split * chunk, tl.minimum(split * chunk + chunk, V), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inb = cols < V
            x, u = _keys(logits_ptr, row, stride, cols, inb, temp)
            if work:
                digit = ((u >> _shift(32 - BITS * (PASS + 1))) & ((1 << BITS) - 1)).to(tl.int32)
                hist += tl.histogram(digit, 1 << BITS, mask=inb & _matches(u, prefix, PASS, BITS))
            if PASS == 0:
                bm, bi = tl.max(tl.where(inb, x, float("-inf")), axis=0, return_indices=True)
                better = bm > best  # strict: the earlier block wins ties (lowest index, as torch.argmax)
                best_i = tl.where(better, start + bi, best_i)
                best = tl.where(better, bm, best)
        if work:
            tl.store(hk_ptr + ((row * PASSES + PASS) * S + split) * (1 << BITS) + tl.arange(0, 1 << BITS), hist)
        if PASS == 0:
            tl.store(mx_ptr + row * S + split, best)
            tl.store(ix_ptr + row * S + split, best_i)


@triton.jit
def _row_state(temp_ptr, topk_ptr, topp_ptr, hk_ptr, kst_ptr, mx_ptr, row, V, S, FIRST,
               BITS: tl.constexpr, PASSES: tl.constexpr, S_BLOCK: tl.constexpr):  # fmt: skip
    """What every top-p / write program needs: parameters, the max, the top-k cut (the last pick made by the
    FIRST top-p pass, which stores it; the later kernels load it) and how many ties at it are kept."""
    greedy, temp, k, top_p = _row_params(temp_ptr, topk_ptr, topp_ptr, row, V)
    sp = tl.arange(0, S_BLOCK)
    m = tl.max(tl.load(mx_ptr + row * S + sp, mask=sp < S, other=float("-inf")), axis=0)
    all_k = k >= V
    if FIRST:
        t_k, above_k = _next_top_k(hk_ptr, kst_ptr, row, S, k, PASSES - 1, BITS, PASSES, S_BLOCK)
        if (tl.program_id(1) == 0) & ~all_k & ~greedy:
            _store_state(kst_ptr, row, PASSES, t_k, above_k, PASSES + 1)
    else:
        t_k, above_k = _state(kst_ptr, row, PASSES, PASSES + 1, False)
    t_k = tl.where(all_k, tl.zeros((), tl.uint32), t_k)  # every key >= 0: nothing excluded, no ties to add
    r_k = tl.where(all_k, 0, k - above_k)
    return greedy, temp, k, top_p, m, all_k, t_k, r_k


@triton.jit(do_not_specialize=["S", "PASS"])
def _top_p_pass(logits_ptr, stride, temp_ptr, topk_ptr, topp_ptr, hk_ptr, kst_ptr, hp_ptr, pst_ptr, hc_ptr, mx_ptr,
                V, S, chunk,
                PASS, BITS: tl.constexpr, PASSES: tl.constexpr, S_BLOCK: tl.constexpr,
                BLOCK: tl.constexpr, ACCURATE: tl.constexpr):  # fmt: skip
    """Pass PASS of the top-p cut: unnormalised masses (exp(x - max), keys above the top-k cut) of digit PASS
    among keys matching the prefix; pass 0 runs for every sampled row (its total is the top-k softmax sum)."""
    BINS: tl.constexpr = 1 << BITS
    row, split = tl.program_id(0), tl.program_id(1)
    greedy, temp, k, top_p, m, all_k, t_k, r_k = _row_state(
        temp_ptr, topk_ptr, topp_ptr, hk_ptr, kst_ptr, mx_ptr, row, V, S, PASS == 0, BITS, PASSES, S_BLOCK
    )
    run = ~greedy
    if PASS > 0:
        run = run & (top_p < 1.0)
    if run:
        tie_mass = _tie_mass(t_k, r_k, m, ACCURATE)
        prefix = tl.zeros((), tl.uint32)
        if PASS > 0:
            total = tl.sum(_histogram_of(hp_ptr, row, 0, S, PASSES, BINS, S_BLOCK), axis=0) + tie_mass
            prefix, above = _next_top_p(hp_ptr, pst_ptr, row, S, top_p, total, t_k, tie_mass, PASS - 1, BITS,
                                        PASSES, S_BLOCK)  # fmt: skip
            if split == 0:
                _store_state(pst_ptr, row, PASS, prefix, above, PASSES)
        bins = tl.arange(0, BINS)
        acc = tl.zeros((BLOCK, BINS), tl.float32)
        counts = tl.zeros((BINS,), tl.int32)
        for start in range(split * chunk, tl.minimum(split * chunk + chunk, V), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inb = cols < V
            x, u = _keys(logits_ptr, row, stride, cols, inb, temp)
            # keys below the top-k cut have no mass, and the top-p cut is at or above it (or nothing is kept)
            live = inb & _matches(u, prefix, PASS, BITS) & (u >= t_k)
            if tl.max(live.to(tl.int32), axis=0) > 0:  # else skip the block (most, with a small top-k)
                digit = ((u >> _shift(32 - BITS * (PASS + 1))) & (BINS - 1)).to(tl.int32)
                w = tl.where(live & (all_k | (u > t_k)), triton_math.exp(x - m, ACCURATE), 0.0)
                acc += tl.where(digit[:, None] == bins[None, :], w[:, None], 0.0)
                if PASS == PASSES - 1:  # the tie counts at the top-p cut, for the ranks
                    counts += tl.histogram(digit, BINS, mask=live)
        base = ((row * PASSES + PASS) * S + split) * BINS
        tl.store(hp_ptr + base + bins, tl.sum(acc, axis=0))
        if PASS == PASSES - 1:
            tl.store(hc_ptr + (row * S + split) * BINS + bins, counts)


@triton.jit
def _ties_before(ptr, row, q, split, d, S, PASSES: tl.constexpr, BINS: tl.constexpr, S_BLOCK: tl.constexpr):
    """Keys in bin d of pass q's count slices: (in splits before this one, in all splits)."""
    sp = tl.arange(0, S_BLOCK)
    c = tl.load(ptr + ((row * PASSES + q) * S + sp) * BINS + d, mask=sp < S, other=0)
    return tl.sum(tl.where(sp < split, c, 0), axis=0), tl.sum(c, axis=0)


@triton.jit
def _tie_quota(n_in, above, tie_prob, top_p):
    """Ties kept at the top-p cut: the largest rank r <= n_in with r == 1 or above + (r - 1) * tie_prob < top_p
    (the rule is monotone in r: bisection); 0 when there are none."""
    lo = tl.minimum(n_in, 1)
    hi = n_in
    for _ in range(32):
        mid = (lo + hi + 1) // 2
        ok = above + (mid - 1).to(tl.float32) * tie_prob < top_p
        lo = tl.where(ok & (mid <= hi), mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit(do_not_specialize=["S"])
def _write(logits_ptr, stride, temp_ptr, topk_ptr, topp_ptr, hk_ptr, kst_ptr, hp_ptr, pst_ptr, hc_ptr, mx_ptr,
           ix_ptr, out_ptr, V, S, chunk, BITS: tl.constexpr, PASSES: tl.constexpr, S_BLOCK: tl.constexpr,
           BLOCK: tl.constexpr, ACCURATE: tl.constexpr):  # fmt: skip
    """The probabilities: exp(x - max) / kept mass on the kept tokens, 0 elsewhere (NaN rows when nothing is
    kept, as the softmax of all -inf); greedy rows one-hot at the first argmax."""
    BINS: tl.constexpr = 1 << BITS
    row, split = tl.program_id(0), tl.program_id(1)
    greedy, temp, k, top_p, m, all_k, t_k, r_k = _row_state(
        temp_ptr, topk_ptr, topp_ptr, hk_ptr, kst_ptr, mx_ptr, row, V, S, False, BITS, PASSES, S_BLOCK
    )
    lo, hi = split * chunk, tl.minimum(split * chunk + chunk, V)
    if greedy:
        sp = tl.arange(0, S_BLOCK)
        mxs = tl.load(mx_ptr + row * S + sp, mask=sp < S, other=float("-inf"))
        first = tl.min(tl.where((mxs == m) & (sp < S), tl.load(ix_ptr + row * S + sp, mask=sp < S, other=0), V))
        for start in range(lo, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(out_ptr + row * V + cols, tl.where(cols == first, 1.0, 0.0), mask=cols < hi)
    else:
        tie_mass = _tie_mass(t_k, r_k, m, ACCURATE)
        total = tl.sum(_histogram_of(hp_ptr, row, 0, S, PASSES, BINS, S_BLOCK), axis=0) + tie_mass
        d_k = (t_k & (BINS - 1)).to(tl.int32)
        run_k, _ = _ties_before(hk_ptr, row, PASSES - 1, split, d_k, S, PASSES, BINS, S_BLOCK)
        kept = total
        t_p = tl.zeros((), tl.uint32)
        run_p = tl.zeros((), tl.int32)
        j = tl.zeros((), tl.int32)
        cut_p = top_p < 1.0
        if cut_p:
            t_p, above_p = _next_top_p(hp_ptr, pst_ptr, row, S, top_p, total, t_k, tie_mass, PASSES - 1, BITS,
                                       PASSES, S_BLOCK)  # fmt: skip
            d_p = (t_p & (BINS - 1)).to(tl.int32)
            run_p, n_tp = _ties_before(hc_ptr, row, 0, split, d_p, S, 1, BINS, S_BLOCK)
            n_in = tl.where(all_k | (t_p > t_k), n_tp, tl.where(t_p == t_k, r_k.to(tl.int32), 0))
            e_tp = tl.where(n_in > 0, triton_math.exp(_float_of(t_p) - m, ACCURATE), 0.0)
            j = _tie_quota(n_in, tl.math.div_rn(above_p, total), tl.math.div_rn(e_tp, total), top_p)
            kept = above_p + j.to(tl.float32) * e_tp
        for start in range(lo, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inb = cols < hi
            x, u = _keys(logits_ptr, row, stride, cols, inb, temp)
            tie_k = inb & (u == t_k)
            rank_k = run_k + tl.cumsum(tie_k.to(tl.int32), axis=0)
            run_k += tl.sum(tie_k.to(tl.int32), axis=0)
            keep = all_k | (u > t_k) | (tie_k & (rank_k <= r_k))
            if cut_p:
                tie_p = inb & (u == t_p)
                rank_p = run_p + tl.cumsum(tie_p.to(tl.int32), axis=0)
                run_p += tl.sum(tie_p.to(tl.int32), axis=0)
                keep = keep & ((u > t_p) | (tie_p & (rank_p <= j)))
            p = tl.where(keep, tl.math.div_rn(triton_math.exp(x - m, ACCURATE), tl.where(kept > 0, kept, 1.0)), 0.0)
            tl.store(out_ptr + row * V + cols, tl.where(kept > 0, p, float("nan")), mask=inb)


def probabilities_triton(logits, temperature, top_k, top_p, splits=None, blocks=None, bits=BITS):
    """`sampler.probabilities_torch_ops` in 2 * 32 / bits + 1 kernels: probabilities [N, V] float32. splits,
    blocks (columns per step of the count / write passes and of the mass passes) and bits (radix digit: 2, 4
    or 8) are for tests and benchmarks."""
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    s = splits or choose_splits(n, vocab, logits.device)
    block, block_mass = blocks or (BLOCK, min(BLOCK, MASS_TILE >> bits))
    chunk = triton.cdiv(triton.cdiv(vocab, s), block) * block  # a whole number of steps of either size
    s = triton.cdiv(vocab, chunk)
    passes, bins, dev = 32 // bits, 1 << bits, logits.device
    hk = torch.empty(n, passes, s, bins, dtype=torch.int32, device=dev)
    kst = torch.empty(n, passes + 1, 2, dtype=torch.int32, device=dev)  # (prefix, above) after each pick
    pst = torch.empty(n, passes, 2, dtype=torch.int32, device=dev)
    hp = torch.empty(n, passes, s, bins, dtype=torch.float32, device=dev)
    hc = torch.empty(n, s, bins, dtype=torch.int32, device=dev)
    mx = torch.empty(n, s, dtype=torch.float32, device=dev)
    ix = torch.empty(n, s, dtype=torch.int32, device=dev)
    out = torch.empty(n, vocab, dtype=torch.float32, device=dev)
    params = (temperature.to(torch.float32), top_k.to(torch.int64), top_p.to(torch.float32))
    grid, accurate = (n, s), not triton_interpreting()
    # S_BLOCK from the vocabulary (the most splits choose_splits gives), not from this call's S, and S not
    # specialised: the 2 * PASSES + 1 kernels compile once for every row count (S varies with the rows)
    s_block = triton.next_power_of_2(max(s, triton.cdiv(vocab, MIN_CHUNK)))
    sizes = dict(V=vocab, S=s, chunk=chunk, BITS=bits, PASSES=passes, S_BLOCK=s_block)
    for p in range(passes):
        launch(_top_k_pass, grid)(logits, logits.stride(0), *params, hk, kst, mx, ix, PASS=p, BLOCK=block, **sizes)
    for p in range(passes):
        launch(_top_p_pass, grid)(logits, logits.stride(0), *params, hk, kst, hp, pst, hc, mx, PASS=p,
                                  BLOCK=block_mass, ACCURATE=accurate, **sizes)  # fmt: skip
    # enable_fp_fusion off: the tie rule's product and sum rounded apart, as torch's separate kernels do
    launch(_write, grid)(logits, logits.stride(0), *params, hk, kst, hp, pst, hc, mx, ix, out, BLOCK=block,
                         ACCURATE=accurate, enable_fp_fusion=False, **sizes)  # fmt: skip
    return out
