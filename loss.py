"""The GRPO loss of one packed row: the clipped surrogate against the sampler and its variants by
name, the reference KL, and the spec's sampling/*, clip_ratio/*, entropy and kl metrics (spec:
Top-kおよびTop-pサンプリング (Top-k and top-p sampling), スコアの中央化 (Score centering);
AsyncGRPOConfig: epsilon, epsilon_high, score_centering, temperature, top_k, top_p, min_p,
vllm_importance_sampling_clip_min/max, num_sampler_logprobs, router_aux_loss_coef; and TRL
GRPOConfig's loss_type, importance_sampling_level, beta).

The objective, per trained token t (M of them in a row; y_t was sampled by vLLM from q_t and is
predicted at packed position token_index[t]; sample i = sample_ids[t] owns it):

    z_t      = cap(W h[token_index[t]]) / T        [V]  cap(x) = c·tanh(x/c): Gemma 2's softcap
    log π_t  = z_t - logsumexp_{v ∈ S_t} z_t       [V]  over S_t, the set y_t was drawn from
    r_t      = exp(log π_t(y_t) - log q_t(y_t))    []   ratio to the sampler (no separate π_old)
    keep_t   = clip_min <= r_t <= clip_max         []   masked importance sampling
    ℓ_t      = -min(r_t A_t, clip(r_t, 1-ε, 1+ε_high) A_t)
             + A_t · sg(w_t) · (c_t - sg(c_t))           score centering (value 0): centering_term
    kl_t     = k3(log π_ref(y_t) - log π_t(y_t))         beta > 0: KL(π ‖ π_ref), over S_t too
    loss     = Σ_t u_t · (keep_t · ℓ_t + β · kl_t) / D

The objective by name (loss_type; TRL GRPOConfig's names and meanings). Its sums run over one
optimizer step, every micro-batch and rank (StepTotals: N trained tokens, S samples, R rows), so a
per-sample quantity is a segment sum over that sample's own loss terms: a shared prompt or a
forked turn of the trie counts once for each sample that owns a term through it.

    loss_type   ℓ_t                                       u_t     D
    dapo        the clipped surrogate (the default)        1       N: a token mean over the step
    grpo        the clipped surrogate                      1/L_i   S: each sample's token mean (L_i
                                                                      its terms), then their mean
    bnpo        the clipped surrogate                      1       M·R: each row's token mean, then
                                                                        their mean (M: its terms)
    dr_grpo     the clipped surrogate                      1       S · max_completion_length
    cispo       -sg(min(r_t, ε_high)) · A_t · log π_t      1       N
    importance_sampling_level="sequence" (GSPO): r_t is sample i's geometric mean ratio
                exp(mean_{t∈i} log r_t), for the clip and the importance-sampling mask alike.

The spec's objective is dapo's: a token mean over the whole step of the clipped surrogate
(DAPO's aggregation; clip-higher with epsilon_high), with masked importance sampling and score
centering on top (the last applies to the token-level clipped surrogate only).

    step                    function           note
    log π_θ, chunked        token_logprobs     never builds [M, V]: O(chunk × V) extra memory
    keep and clip bits      importance_bands   r_t against the IS bounds and against 1 ± ε
    centering term c_t      centering_term     its derivation, and a worked example by hand
    ℓ_t, kl_t and metrics   policy_loss        metrics reduce exactly: reduce_metrics
    u_t / D                 normalized         the table above
    log π at a row's terms  row_logprobs       the policy's and the reference's
    from a packed row       compute_loss       what the trainer calls

Departures from the spec, one line each:
- Centering subtracts w(y)·ĉ, not the paper's E_q[w s]: masked or clipped tokens give nothing.
- Clipping applies to the centred term too (through w); ĉ accounts for it with the token's A.
- Masked tokens stay in N, L_i and M: the counts are known before the forward (ICE-POP style).
- Without the server's candidate sets, log π_θ is over the vocabulary: biased low (warned at start).
- LM-head matmul in the weight's dtype; softmax and head gradients in >= fp32 (bf16: 0.5% off).
- Final logit softcapping is applied here: loss.py takes hidden states, not the model's logits.
- loss_type's means run over the whole step (TRL: a micro-batch's, then averaged over micro-batches
  and ranks: the same when they hold equal counts); grpo averages training sequences (a forked
  multi-turn rollout has several), not rollouts.
- The KL applies to every trained token, importance-masked ones too (TRL adds it after its
  importance weights, a mask's zeros included).
"""
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


MOE_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass
class TokenLogProbs:
    """log π_θ at M loss terms (k = number of sampler top tokens, 0 without them)."""
    target: torch.Tensor     # [M]    log π_θ(y_t), differentiable
    top: torch.Tensor        # [M, k] log π_θ of the sampler's top tokens (0 where not top_valid)
    top_valid: torch.Tensor  # [M, k] bool: a real top token inside the candidate set
    tail_mass: torch.Tensor  # [M]    P_tail = π_θ mass of the candidate set outside the valid tops
    entropy: torch.Tensor    # [M]    entropy of π_θ over the candidate set


@dataclass
class StepTotals:
    """What a loss_type divides by: the optimizer step's counts over every micro-batch and rank,
    known before the first backward (train.py's Feed plans the whole step first)."""
    tokens: int                     # N: trained tokens (loss terms)
    samples: int                    # S: samples
    rows: int                       # R: packed rows, micro-batches × ranks

    @classmethod
    def of(cls, rows) -> "StepTotals":
        """The counts of PackedRows: all of a step's."""
        return cls(sum(r.trained_tokens for r in rows), sum(r.num_samples for r in rows), len(rows))


def _chunk_logits(hidden, weight, bias, token_index, candidate_ids, candidate_offsets, temperature,
                  softcap, lo, hi, slope=False):
    """Logits of rows lo..hi, softcapped (softcap·tanh(z / softcap), when softcap) then divided by
    T, -inf outside each row's candidate set; also the set mask (None = vocab) and, if asked, the
    softcap's derivative 1 - tanh² (None without softcap)."""
    h = hidden[token_index[lo:hi]].to(weight.dtype)                        # [c, H]
    z = F.linear(h, weight, bias)                                          # [c, V]
    z = z.to(torch.promote_types(z.dtype, torch.float32))                  # [c, V] >= fp32
    d = None
    if softcap is not None:
        z = z.div_(softcap).tanh_()                                        # [c, V] tanh(z / c)
        d = 1 - z.square() if slope else None                              # [c, V] d capped / d z
        z = z.mul_(softcap)
    z = z.div_(temperature)
    counts = candidate_offsets[lo + 1:hi + 1] - candidate_offsets[lo:hi]   # [c] 0 = vocabulary
    if not counts.any():
        return h, z, None, d
    allowed = (counts == 0)[:, None].repeat(1, z.shape[1])                 # [c, V]
    rows = torch.repeat_interleave(torch.arange(hi - lo, device=z.device), counts)  # [Σc]
    allowed[rows, candidate_ids[candidate_offsets[lo]:candidate_offsets[hi]]] = True
    return h, z.masked_fill_(~allowed, float("-inf")), allowed, d


def _mm_fp32(a, b):
    """a @ b accumulated and returned in fp32: a bf16 product is rounded once, by the caller."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()                 # CPU matmul has no fp32 output for bf16 inputs


class _ChunkedLogProbs(torch.autograd.Function):
    """(log π [M], top log π [M, k], top_valid, tail mass, entropy) chunk by chunk; saves the inputs
    and one logsumexp per row, and backward recomputes each chunk's logits: no [M, V] tensor lives
    at any time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, token_index, targets, top_ids, cand_ids, cand_offsets,
                temperature, softcap, chunk):
        M, k, V = targets.numel(), top_ids.shape[1], weight.shape[0]
        acc = torch.promote_types(weight.dtype, torch.float32)
        logp = torch.empty(M, dtype=acc, device=weight.device)
        lse = torch.empty(M, dtype=acc, device=weight.device)
        top = torch.zeros(M, k, dtype=acc, device=weight.device)
        valid = top_ids >= 0                                                # [M, k]
        entropy = torch.empty_like(logp)
        tail = torch.empty_like(logp)
        for lo in range(0, M, chunk):
            hi = min(M, lo + chunk)
            _, z, allowed, _ = _chunk_logits(hidden, weight, bias, token_index, cand_ids,
                                             cand_offsets, temperature, softcap, lo, hi)
            # z [c, V], allowed [c, V] | None
            t = targets[lo:hi, None]                                        # [c, 1]
            ids = top_ids[lo:hi].clamp(min=0)                               # [c, k]
            if allowed is not None:
                if not allowed.gather(1, t).all():
                    raise ValueError("a target token lies outside its candidate set: "
                                     "the sampling masks do not match")
                valid[lo:hi] &= allowed.gather(1, ids)
            zmax = z.amax(1, keepdim=True)                                  # [c, 1]
            p = (z - zmax).exp_()                                           # [c, V] 0 outside S
            total = p.sum(1, keepdim=True)                                  # [c, 1]
            # rounds as log_softmax does: (z - max) - log Σ exp(z - max)
            log_sum = total.log()                                           # [c, 1]
            lse[lo:hi] = (zmax + log_sum)[:, 0]                             # [c]
            logp[lo:hi] = (z.gather(1, t) - zmax - log_sum)[:, 0]           # [c]
            top[lo:hi] = torch.where(valid[lo:hi], z.gather(1, ids) - zmax - log_sum, 0)  # [c, k]
            p.div_(total)                                                   # [c, V] π_θ over S
            z.nan_to_num_(neginf=0.0)                                       # [c, V] 0 · -inf is nan
            entropy[lo:hi] = lse[lo:hi] - (p[:, None, :] @ z[:, :, None])[:, 0, 0]  # [c]
            head = torch.zeros(hi - lo, V + 1, dtype=torch.bool, device=z.device)  # [c, V+1]
            head.scatter_(1, torch.where(valid[lo:hi], ids, V), True)     # column V: the pads
            tail[lo:hi] = p.masked_fill_(head[:, :V], 0).sum(1)             # [c] no 1 - Σ
            del z, p, head                                                  # before the next chunk
        ctx.save_for_backward(hidden, weight, bias, token_index, targets, top_ids.clamp(min=0),
                              valid, cand_ids, cand_offsets, lse)
        ctx.temperature = temperature
        ctx.softcap = softcap
        ctx.chunk = chunk
        ctx.mark_non_differentiable(valid, tail, entropy)
        return logp, top, valid, tail, entropy

    @staticmethod
    def backward(ctx, g_logp, g_top, *_):
        (hidden, weight, bias, token_index, targets, top_ids, valid, cand_ids, cand_offsets,
         lse) = ctx.saved_tensors
        T = ctx.temperature
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None       # [N, H]
        grad_w = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None  # [V, H]
        # needs_input_grad is False for an input that is not a tensor, as a bias of None
        grad_b = torch.zeros_like(bias, dtype=acc) if ctx.needs_input_grad[2] else None  # [V]
        for lo in range(0, targets.numel(), ctx.chunk):
            hi = min(targets.numel(), lo + ctx.chunk)
            h, z, _, slope = _chunk_logits(hidden, weight, bias, token_index, cand_ids,
                                           cand_offsets, T, ctx.softcap, lo, hi, slope=True)
            gt = g_logp[lo:hi]                                                         # [c]
            gk = torch.where(valid[lo:hi], g_top[lo:hi], 0)                            # [c, k]
            # d log π(v)/dz = e_v - π over the set; z = cap(Wh)/T, so every logit gradient carries
            # 1/T and, with softcapping, the tanh's slope
            grad_z = z.sub_(lse[lo:hi, None]).exp_().mul_(-(gt + gk.sum(1))[:, None])  # [c, V]
            grad_z.scatter_add_(1, targets[lo:hi, None], gt[:, None])
            grad_z.scatter_add_(1, top_ids[lo:hi], gk)
            grad_z = grad_z.div_(T) if slope is None else grad_z.div_(T).mul_(slope)   # [c, V]
            if grad_b is not None:
                grad_b += grad_z.sum(0)                                                # [V]
            grad_z = grad_z.to(weight.dtype)                                           # [c, V]
            if grad_h is not None:
                grad_h.index_add_(0, token_index[lo:hi], (grad_z @ weight).to(hidden.dtype))
            if grad_w is not None:
                grad_w += _mm_fp32(grad_z.T, h)                                        # [V, H] fp32
            del z, grad_z, slope                                                       # next chunk
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None               # once
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def token_logprobs(hidden, weight, bias, token_index, targets, *, temperature=1.0, top_ids=None,
                   candidate_ids=None, candidate_offsets=None, final_logit_softcapping=None,
                   chunk_size=None) -> TokenLogProbs:
    """log π_θ(targets) at packed positions token_index, from hidden [N, H] and the LM head weight
    [V, H] (+ bias [V]); also for top_ids [M, k] (-1 pads).

    Logits are softcapped (final_logit_softcapping: Gemma 2's softcap·tanh(z / softcap), as the
    model's own forward does), then divided by the temperature, then normalised over each term's
    candidate set (candidate_ids [C] laid end to end, candidate_offsets [M+1]; an empty set means
    the vocabulary). vLLM returns processed log-probs, normalised over the set a token was drawn
    from (top-k/top-p/min-p), so log π_θ must be normalised over the same set, or every ratio is
    biased low (DeepSeek-V3.2 §3.1).

    Memory: the [M, V] logits are never built. Chunks of chunk_size rows (default 2^26 / V: 256 MiB
    of fp32 logits) run one at a time; backward recomputes each chunk's logits from the saved inputs
    and one logsumexp per row. The weight and bias gradients accumulate over chunks in fp32.
    """
    M, dev = targets.numel(), weight.device
    if top_ids is None:
        top_ids = torch.empty(M, 0, dtype=torch.long, device=dev)                    # [M, k]
    if candidate_ids is None:
        candidate_ids = torch.empty(0, dtype=torch.long, device=dev)                 # [C]
        candidate_offsets = torch.zeros(M + 1, dtype=torch.long, device=dev)         # [M+1]
    chunk = chunk_size or max(1, 2**26 // weight.shape[0])
    softcap = None if final_logit_softcapping is None else float(final_logit_softcapping)
    out = _ChunkedLogProbs.apply(hidden, weight, bias, token_index, targets, top_ids, candidate_ids,
                                 candidate_offsets, float(temperature), softcap, chunk)
    return TokenLogProbs(*out)


def clip_range(config) -> tuple[float, float]:
    """The surrogate's ratio clip, (1 - ε, 1 + ε_high); ε_high None: ε."""
    return 1 - config.epsilon, 1 + (config.epsilon_high or config.epsilon)


def importance_bands(ratio, adv, config):
    """(inside the importance-sampling bounds, clipped low, clipped high), bool each, for ratios
    and detached advantages: a token is clipped low if A < 0 and r < 1 - ε, high if A > 0 and
    r > 1 + ε_high (the clip takes its gradient away)."""
    lowest, highest = clip_range(config)
    inside = ((ratio >= config.vllm_importance_sampling_clip_min)
              & (ratio <= config.vllm_importance_sampling_clip_max))
    return inside, (adv < 0) & (ratio < lowest), (adv > 0) & (ratio > highest)


def centering_term(lp: TokenLogProbs, top_logprobs, adv, config):
    """c_t = Σ_{v∈H} sg(β_tv) log π_t(v)  [M]: the term whose gradient is the centre ĉ_t.

    Derivation (A detached, one position, s_v = ∇θ log π(v), expectations over v ∈ S):
     1. The clipped, masked surrogate of a sampled y has gradient A·w(y)·s_y with the detached
        coefficient w(y) = r(y)·k(y), k(y) = kept and not clipped (importance_bands).
     2. Under the sampler, E_q[A w s] = E_q[A]·E_q[w s] + Cov_q(A, w s): the first term is an update
        that a constant advantage makes whatever the rewards (drift). With exact weights
        E_q[w s] = Σ π s = 0, but masking and clipping drop tokens: if A>0 clips the tokens that π_θ
        over-weights, the rest pull π_θ toward q; importance weights alone cannot fix it.
     3. Centre each token's score, g(y) = A·w(y)·(s_y - ĉ), so masked and clipped tokens still get
        no gradient. E_q[g] = 0 for constant A  <=>  ĉ = E_q[w s] / E_q[w].
     4. As q(v)·w(v) = π(v)·k(v), ĉ = Σ_v π_v k_v s_v / Σ_v π_v k_v: q enters only through k.
     5. The sampler reports only its top tokens H (num_sampler_logprobs, log q_v over the same S).
        Spread its remaining mass Q_tail = 1 - Σ_H q_v over the tail S\\H in proportion to π_θ, so
        every tail token has ratio r_tail = P_tail/Q_tail (P_tail = Σ_{S\\H} π_v) and one keep bit
        k_tail. As Σ_S π s = 0, Σ_{S\\H} π s = -Σ_H π s, hence the closed form
            ĉ = Σ_{v∈H} β_v s_v,   β_v = π_v (k_v - k_tail) / Z,   Z = Σ_H π_v k_v + k_tail·P_tail,
        exact when H covers S (P_tail = 0) or when q's tail really is proportional to π_θ.
     6. policy_loss adds A_t·sg(w_t)·(c_t - sg(c_t)) (value 0, gradient A_t·w_t·ĉ_t). The top log π
        use the sampled token's temperature and candidate set S_t (vLLM's top log-probs are
        processed over S_t too); a top id outside S_t or padded (-1) is dropped.

    Worked example (T=1, S=V={0,1,2}, ε=0.2, A=+1, logit space so s_v = e_v - π):
        π = (.45, .30, .25), q = (.30, .30, .40)  ->  r = (1.5, 1, .625); 1.5 > 1.2: k = (0, 1, 1)
        drift E_q[w s] = Σ π k s = -π_0 s_0 = (-.2475, .135, .1125)   lowers token 0: toward q
        ĉ = drift / (.30 + .25) = (-.45, .245, .205);  g(1) = 1·(s_1 - ĉ) = (0, .455, -.455),
        g(2) = .625·(s_2 - ĉ) = (0, -.341, .341), g(0) = 0;  E_q[g] = .3·g(1) + .4·g(2) = 0.
    """
    valid = lp.top_valid & torch.isfinite(top_logprobs)                          # [M, k]
    log_q = torch.where(valid, top_logprobs, float("-inf"))                      # [M, k]
    pi = torch.where(valid, lp.top.detach().exp(), 0)                            # [M, k] π_v on H
    top_ratio = (lp.top.detach() - log_q).clamp(-20, 20).exp()                   # [M, k]
    inside, low, high = importance_bands(top_ratio, adv[:, None], config)
    k_v = valid & inside & ~low & ~high                                          # [M, k] keep bits
    q_tail = (1 - log_q.exp().sum(1)).clamp(min=0)                               # [M] Q_tail
    p_tail = lp.tail_mass                                                        # [M] P_tail
    inside, low, high = importance_bands(p_tail / q_tail, adv, config)           # r_tail
    k_tail = (inside & ~low & ~high & (p_tail > 0)).to(pi.dtype)                 # [M]
    z = (pi * k_v).sum(1) + k_tail * p_tail                                      # [M] Z = E_q̂[w]
    beta = pi * (k_v.to(pi.dtype) - k_tail[:, None]) / z.clamp(min=1e-30)[:, None]  # [M, k]
    return (beta * lp.top).sum(1)                                                # [M]


def policy_loss(lp: TokenLogProbs, sampler_logprobs, advantages, sample_ids, totals: StepTotals,
                config, top_logprobs=None, fresh=None, ref_logprobs=None):
    """(loss, metrics) for one micro-batch: the row's share of the step's loss (module docstring).
    sample_ids [M]: the sample in the row that owns each term; totals: the whole step's counts
    (StepTotals); fresh [M] bool: the tokens sampled by the policy the trainer holds now (staleness
    0), over which mismatch_metrics measures the served policy against the trained; ref_logprobs
    [M]: log π_ref(y_t), given when beta > 0."""
    adv = advantages.to(lp.target.dtype)                                # [M] A_t
    log_ratio = lp.target - sampler_logprobs                            # [M]
    log_weight = log_ratio                                              # [M] token level
    if config.importance_sampling_level == "sequence":                  # GSPO: sample i's mean
        log_weight = sample_mean(log_ratio, sample_ids)                 # [M]
    ratio = log_weight.clamp(-20, 20).exp()                             # [M] ±20 is past any bound
    keep, low, high = importance_bands(ratio.detach(), adv, config)     # [M] bool each
    if config.loss_type == "cispo":                                     # the weight is clipped
        cap = config.epsilon_high or config.epsilon
        per_token = -ratio.detach().clamp(max=cap) * adv * lp.target    # [M]
        low, high = torch.zeros_like(keep), ratio.detach() > cap
    else:
        clipped = ratio.clamp(*clip_range(config))                      # [M]
        per_token = -torch.minimum(ratio * adv, clipped * adv)          # [M]
    if config.score_centering:
        c = centering_term(lp, top_logprobs, adv, config)               # [M]
        w = ratio.detach() * (keep & ~low & ~high)                      # [M] sg(w_t)
        per_token = per_token + adv * w * (c - c.detach())              # [M] value unchanged
    per_token = torch.where(keep, per_token, 0)                         # [M]
    kl = None
    if ref_logprobs is not None:
        kl = k3(ref_logprobs - lp.target)                               # [M] KL(π ‖ π_ref)
        per_token = per_token + config.beta * kl
    loss = normalized(per_token, sample_ids, totals, config)            # []

    M = lp.target.numel()
    d = log_ratio.detach().abs()                                        # [M]
    r = log_ratio.detach().exp()                                        # [M] unclamped, for metrics

    def pair(x):                                                        # [M] -> [2] (sum, count)
        count = torch.tensor(M, dtype=torch.float64, device=x.device)
        return torch.stack([x.sum().to(torch.float64), count])

    metrics = {
        "sampling/importance_sampling_ratio/mean": pair(r),
        "sampling/importance_sampling_ratio/min": r.min() if M else r.new_tensor(float("inf")),
        "sampling/importance_sampling_ratio/max": r.max() if M else r.new_tensor(float("-inf")),
        "sampling/sampling_logp_difference/mean": pair(d),
        "sampling/sampling_logp_difference/max": d.max() if M else d.new_tensor(float("-inf")),
        "sampling/masked_mean": pair(~keep),
        "clip_ratio/low_mean": pair(keep & low),
        "clip_ratio/high_mean": pair(keep & high),
        "entropy": pair(lp.entropy),
    }
    if top_logprobs is not None:
        metrics["sampling/sampler_mass"] = pair(top_logprobs.exp().sum(1))
    if kl is not None:
        metrics["kl"] = pair(kl.detach())
    if fresh is not None:
        metrics |= mismatch_metrics(log_ratio.detach()[fresh])
    return loss, metrics


def sample_mean(x, sample_ids):
    """[M] each term's sample's mean of x [M] (a segment mean over sample_ids, differentiable):
    x = (1, 3, 5), sample_ids = (0, 0, 1) → (2, 2, 5)."""
    counts = torch.bincount(sample_ids)                                 # [samples]
    sums = x.new_zeros(len(counts)).index_add(0, sample_ids, x)         # [samples]
    return (sums / counts)[sample_ids]                                  # [M]


def normalized(per_token, sample_ids, totals: StepTotals, config):
    """Σ_t u_t · per_token_t / D, the row's share of the step's loss by loss_type (the module
    docstring's table). Worked, one row of a step with N = 4 tokens, S = 2 samples, R = 1 row:
    per_token (1, 3, 5, 7), sample_ids (0, 0, 0, 1): dapo 16/4 = 4; grpo (9/3 + 7/1)/2 = 5;
    bnpo 16/(4·1) = 4; dr_grpo with max_completion_length 8: 16/(2·8) = 1."""
    kind = config.loss_type
    if kind == "grpo":                      # each sample's token mean, then the samples' mean
        lengths = torch.bincount(sample_ids)[sample_ids]                # [M] L_i
        return (per_token / lengths).sum() / totals.samples
    if kind == "bnpo":                      # each row's token mean, then the rows' mean
        return per_token.sum() / (max(per_token.numel(), 1) * totals.rows)
    if kind == "dr_grpo":                   # a constant divisor: no length bias
        return per_token.sum() / (totals.samples * config.max_completion_length)
    return per_token.sum() / totals.tokens  # dapo, cispo: a token mean over the step


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """[F] Schulman's k3 per token, (r - 1) - log r with log r = log_ratio: an unbiased estimate of
    KL(q ‖ π) from samples of q, >= 0 each (the first clamp keeps e^x finite; the last, rounding
    near r = 1, which gives -1e-9)."""
    return (log_ratio.clamp(-20, 20).exp() - 1 - log_ratio).clamp(min=0)


def mismatch_metrics(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the served policy q is from the trained one π_θ, over F tokens that q sampled from
    the very weights π_θ holds (staleness 0): with no train/inference mismatch every log r_t =
    log π_θ(y_t) - log q(y_t) is 0. The k3 estimator of KL(q ‖ π_θ) from samples of q is
    E_q[(r - 1) - log r] (Schulman's, unbiased and >= 0 per token). Worked: log r = (0.1, -0.1)
    → k3 = (e^0.1 - 1.1 + e^-0.1 - 0.9) / 2 = 0.0050, logprob_diff_max 0.1, mismatch_tokens 2.

    log_ratio: [F]. Returns [sum, count] for the mean, a scalar max (-inf without tokens) and the
    count (summed over micro-batches and ranks)."""
    F_ = log_ratio.numel()
    count = torch.tensor(F_, dtype=torch.float64, device=log_ratio.device)
    return {"sampling/mismatch_kl": torch.stack([k3(log_ratio).sum().to(torch.float64), count]),
            "sampling/logprob_diff_max": (log_ratio.abs().max() if F_
                                          else log_ratio.new_tensor(float("-inf"))),
            "sampling/mismatch_tokens": count}


def row_logprobs(hidden, weight, bias, row, temperature: float,
                 final_logit_softcapping=None, top_ids=None) -> TokenLogProbs:
    """token_logprobs at a packed row's loss terms, at `temperature`, over the row's candidate
    sets: the policy's (compute_loss), the reference's (beta > 0) and the probe's alike."""
    return token_logprobs(hidden, weight, bias, row.token_index, row.targets,
                          temperature=temperature, top_ids=top_ids,
                          candidate_ids=getattr(row, "candidate_ids", None),
                          candidate_offsets=getattr(row, "candidate_offsets", None),
                          final_logit_softcapping=final_logit_softcapping)


def compute_loss(hidden, weight, bias, row, config, totals: StepTotals,
                 final_logit_softcapping=None, version=None, ref_logprobs=None):
    """(loss, metrics) of a packed row, from the final hidden states [N, H] and the LM head.

    row: any object with PackedRow's tensors (token_index, targets, sampler_logprobs, advantages,
    sample_ids and optional top_ids, top_logprobs, candidate_ids, candidate_offsets,
    model_versions); totals as in `policy_loss`; final_logit_softcapping: the model config's
    (Gemma 2: 30.0), None without it; version: the policy version the trainer holds (its tokens:
    the sampling/mismatch_* ones); ref_logprobs [M] (beta > 0): the reference's row_logprobs.
    """
    top_logprobs = getattr(row, "top_logprobs", None)
    if config.score_centering and top_logprobs is None:
        raise ValueError("AsyncGRPOConfig.score_centering: the samples carry no sampler top "
                         "log-probs; set num_sampler_logprobs >= 1 or score_centering=False")
    top_ids = getattr(row, "top_ids", None) if config.score_centering else None
    lp = row_logprobs(hidden, weight, bias, row, config.temperature, final_logit_softcapping,
                      top_ids)
    versions = getattr(row, "model_versions", None)
    fresh = None if version is None or versions is None else versions == version
    return policy_loss(lp, row.sampler_logprobs, row.advantages, row.sample_ids, totals, config,
                       top_logprobs, fresh, ref_logprobs)


def reduce_metrics(parts: list[dict]) -> dict:
    """Combine metrics of several micro-batches (or gathered ranks) exactly.

    A mean is a [sum, count] pair: reduce with SUM, then divide (finalize_metrics); a min or max
    by name (extreme) is a scalar: reduce with MIN or MAX; other scalars are counts (SUM).
    Across ranks, all_reduce with the same ops.
    """
    ops = {"min": torch.minimum, "max": torch.maximum}
    return {name: functools.reduce(ops.get(extreme(name), torch.add), [p[name] for p in parts])
            for name in parts[0]}


def extreme(name: str) -> str | None:
    """"max" or "min" when the last part of a metric's name has that word (the extreme over rows,
    ranks and a logging window: sample/staleness_max, completions/min_length, .../ratio/max), else
    None. metrics.reduction builds the logging window's rule on it."""
    words = name.rsplit("/", 1)[-1].split("_")
    return "max" if "max" in words else "min" if "min" in words else None


def finalize_metrics(metrics: dict) -> dict[str, float]:
    """Plain floats: a [sum, count] pair becomes sum / count (nan without tokens), and so does
    logprob_diff_max over no fresh token."""
    out = {name: (v[0] / v[1]).item() if v.dim() else v.item() for name, v in metrics.items()}
    if out.get("sampling/mismatch_tokens") == 0:
        out["sampling/logprob_diff_max"] = float("nan")
    return out


def router_aux_loss_coef(model_config, coef: float | None) -> float:
    """The router auxiliary-loss weight: `coef` if set, else the model's declared value; an error on
    a dense model (one whose config declares no experts)."""
    text = model_config.get_text_config()           # a vision-language model's: its decoder's
    if not any(getattr(text, field, None) for field in MOE_EXPERT_FIELDS):
        if coef is not None:
            raise ValueError(f"AsyncGRPOConfig.router_aux_loss_coef={coef} is set, but "
                             f"{type(text).__name__} has no experts "
                             f"({'/'.join(MOE_EXPERT_FIELDS)}): leave it None for a dense model")
        return 0.0
    return float(coef if coef is not None else getattr(text, "router_aux_loss_coef", 0.0) or 0.0)

