"""The off-policy-corrected GRPO loss (spec: Top-kおよびTop-pサンプリング, スコアの中央化, 記録されたメトリクス
sampling/*; AsyncGRPOConfig: epsilon, epsilon_high, score_centering, vllm_importance_sampling_clip_min/max,
num_sampler_logprobs, temperature, top_k, top_p, min_p, router_aux_loss_coef).

Per trained token t (M of them in a packed row; each is the prediction made at packed position
token_index[t] of the target token y_t, sampled by vLLM from its processed distribution q_t):

    z_t      = cap(W h[token_index[t]]) / T               [V]    logits with the sampling temperature; cap(x) =
                                                                  c·tanh(x/c) with final_logit_softcapping c
    log π_t  = z_t - logsumexp_{v ∈ S_t} z_t               [V]    normalised over S_t, the candidate set y_t
                                                                  was drawn from (all of V without top-k/top-p)
    r_t      = exp(log π_t(y_t) - log q_t(y_t))            []     ratio to the sampler (no separate π_old)
    keep_t   = clip_min <= r_t <= clip_max                 []     masked importance sampling: others leave the loss
    loss     = (1/n) Σ_t keep_t · -min(r_t A_t, clip(r_t, 1-ε, 1+ε_high) A_t)      n: trained tokens of the step

Normalisation: n counts every trained token of the optimizer step, on all micro-batches and ranks (masked
ones too), so micro-batches of any size weigh by their tokens and accumulating them gives the step's mean.

Score centering, derived (A detached, one position, s_v = ∇θ log π(v), expectations over v ∈ S):
 1. The clipped, masked surrogate of a sampled y has gradient A·w(y)·s_y with the detached coefficient
    w(y) = r(y)·k(y), k(y) = keep and not clipped (A>0 and r>1+ε_high, or A<0 and r<1-ε, clip to zero).
 2. Its expectation under the sampler, E_q[A w s] = E_q[A]·E_q[w s] + Cov_q(A, w s): the first term is
    an update that a constant advantage makes whatever the rewards (drift). With exact weights
    E_q[w s] = Σ π s = 0, but masking and clipping drop tokens: if A>0 clips the tokens that π_θ
    over-weights, the rest pull π_θ toward q; hence "importance weights alone cannot fix it".
 3. Centre each token's score, g(y) = A·w(y)·(s_y - ĉ), so that masked and clipped tokens still get no
    gradient. E_q[g] = 0 for constant A  <=>  ĉ = E_q[w s] / E_q[w]  (the sampler's mean score, weighed
    as the estimator weighs it; it is E_q[s] when w = 1).
 4. Since q(v)·w(v) = π(v)·k(v), ĉ = Σ_v π_v k_v s_v / Σ_v π_v k_v: q enters only through the keep bits.
 5. The sampler reports only its top tokens H (num_sampler_logprobs of them, log q_v, same support S).
    Spread its remaining mass Q_tail = 1 - Σ_H q_v over the tail S\\H in proportion to π_θ: q̂_v =
    Q_tail·π_v/P_tail with P_tail = Σ_{S\\H} π_v, so every tail token has ratio r_tail = P_tail/Q_tail
    and one keep bit k_tail. As Σ_S π s = 0, Σ_{S\\H} π s = -Σ_H π s, hence the closed form
        ĉ = Σ_{v∈H} β_v s_v,   β_v = π_v (k_v - k_tail) / Z,   Z = Σ_H π_v k_v + k_tail·P_tail.
    It is exact when H covers S (P_tail = 0) or when q's tail really is proportional to π_θ.
 6. Surrogate with exactly this gradient (sg = stop-gradient), added to the clipped loss of token t:
        A_t · sg(w_t) · (c_t - sg(c_t)),   c_t = Σ_{v∈H} sg(β_tv) log π_t(v)        [M], value 0
    The top-k terms use the same temperature and the same candidate set S_t as the sampled token (vLLM's
    top log-probs are processed log-probs over S_t too); a top id outside S_t or padded (-1) is dropped.

Worked example (T=1, S=V={0,1,2}, ε=0.2, A=+1, logit space so s_v = e_v - π):
    π = (.45, .30, .25), q = (.30, .30, .40)  ->  r = (1.5, 1, .625); token 0 clips (1.5 > 1.2): k = (0, 1, 1)
    drift E_q[w s] = Σ π k s = -π_0 s_0 = (-.2475, .135, .1125)     lowers token 0, i.e. pulls toward q
    ĉ = drift / (.30 + .25) = (-.45, .245, .205);  g(1) = 1·(s_1 - ĉ) = (0, .455, -.455),
    g(2) = .625·(s_2 - ĉ) = (0, -.341, .341), g(0) = 0;  E_q[g] = .3·g(1) + .4·g(2) = 0.

Candidate sets (top-k/top-p/min-p): vLLM returns processed log-probs, normalised over the set a token was
drawn from, so log π_θ is normalised over the same set (else every ratio is biased low, DeepSeek-V3.2
§3.1). Without sets from the server we normalise over the vocabulary and warn once.

Memory: the [M, V] logits are never built. `token_logprobs` runs chunks of rows, recomputes each chunk's
logits in backward and keeps only a logsumexp per row, so the extra peak is O(chunk × V), not O(M × V).

Metrics are tensors that reduce exactly over micro-batches and ranks: a mean is a [sum, count] pair
(reduce with SUM, then divide), names ending /min and /max are scalars (reduce with MIN and MAX).
`reduce_metrics` and `finalize_metrics` do it for micro-batches; across ranks all_reduce with the same ops.

Departures from the spec and why:
- The paper (Marek & Ryabinin, arXiv 2609.20807) centres the weighted score, w(y)s_y - E_q[w s]; we subtract
  w(y)·ĉ instead (step 3), so that a masked or clipped token contributes exactly nothing, as masked importance
  sampling promises. Both have E_q[g] = 0; ours keeps the clipped objective's trust region per token.
- Clipping applies to the centred term too (through w), and ĉ accounts for it with the token's own A.
- Masked tokens stay in n (the count is known before the forward; ICE-POP style, no renormalisation).
- The LM-head matmul runs in the weight's dtype, the softmax in at least fp32; autocast is not used here.
  The LM-head weight and bias gradients are summed over chunks in fp32 and rounded once at the end (a
  bf16 sum per chunk was off by 0.4-0.8%).
- Final logit softcapping (Gemma 2) is applied here, from the model config the trainer passes: loss.py
  takes hidden states and the LM head, not the model's logits. The temperature divides the capped logits.
"""
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MOE_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass
class TokenLogProbs:
    """log π_θ at M loss terms (k = number of sampler top tokens, 0 without them)."""
    target: torch.Tensor     # [M]    log π_θ(y_t), differentiable
    top: torch.Tensor        # [M, k] log π_θ of the sampler's top tokens (0 where not top_valid), differentiable
    top_valid: torch.Tensor  # [M, k] bool: a real top token inside the candidate set
    tail_mass: torch.Tensor  # [M]    P_tail = π_θ mass of the candidate set outside the valid top tokens
    entropy: torch.Tensor    # [M]    entropy of π_θ over the candidate set


def _chunk_logits(hidden, weight, bias, token_index, candidate_ids, candidate_offsets, temperature, softcap,
                  lo, hi, slope=False):
    """Logits of rows lo..hi, softcapped (softcap·tanh(z / softcap), when softcap) then divided by T, -inf
    outside each row's candidate set; also the set mask (None = vocab) and, if asked, the softcap's
    derivative 1 - tanh² (None without softcap)."""
    h = hidden[token_index[lo:hi]].to(weight.dtype)                        # [c, H]
    z = F.linear(h, weight, bias)                                          # [c, V]
    z = z.to(torch.promote_types(z.dtype, torch.float32))                  # [c, V] softmax in >= fp32
    d = None
    if softcap is not None:
        z = z.div_(softcap).tanh_()                                        # [c, V] tanh(z / softcap)
        d = 1 - z.square() if slope else None                              # [c, V] d capped / d z
        z = z.mul_(softcap)
    z = z.div_(temperature)
    counts = candidate_offsets[lo + 1:hi + 1] - candidate_offsets[lo:hi]   # [c] 0 = whole vocabulary
    if not counts.any():
        return h, z, None, d
    allowed = (counts == 0)[:, None].repeat(1, z.shape[1])                 # [c, V]
    rows = torch.repeat_interleave(torch.arange(hi - lo, device=z.device), counts)  # [Σc]
    allowed[rows, candidate_ids[candidate_offsets[lo]:candidate_offsets[hi]]] = True
    return h, z.masked_fill_(~allowed, float("-inf")), allowed, d


def _mm_fp32(a, b):
    """a @ b accumulated and returned in fp32: a bf16 product is rounded once, where the caller casts."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()                 # CPU matmul has no fp32 output for bf16 inputs


class _ChunkedLogProbs(torch.autograd.Function):
    """(log π [M], top log π [M, k], top_valid, tail mass, entropy) chunk by chunk; saves the inputs and one
    logsumexp per row, and backward recomputes each chunk's logits: no [M, V] tensor lives at any time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, token_index, targets, top_ids, cand_ids, cand_offsets, temperature, softcap,
                chunk):
        M, k, V = targets.numel(), top_ids.shape[1], weight.shape[0]
        acc = torch.promote_types(weight.dtype, torch.float32)
        logp, lse = torch.empty(M, dtype=acc, device=weight.device), torch.empty(M, dtype=acc, device=weight.device)
        top = torch.zeros(M, k, dtype=acc, device=weight.device)
        valid = top_ids >= 0                                                # [M, k]
        entropy, tail = torch.empty_like(logp), torch.empty_like(logp)
        for lo in range(0, M, chunk):
            hi = min(M, lo + chunk)
            _, z, allowed, _ = _chunk_logits(hidden, weight, bias, token_index, cand_ids, cand_offsets, temperature,
                                             softcap, lo, hi)                # [c, V], [c, V] | None
            t, ids = targets[lo:hi, None], top_ids[lo:hi].clamp(min=0)     # [c, 1], [c, k]
            if allowed is not None:
                if not allowed.gather(1, t).all():
                    raise ValueError("a target token lies outside its candidate set: the sampling masks do not match")
                valid[lo:hi] &= allowed.gather(1, ids)
            zmax = z.amax(1, keepdim=True)                                  # [c, 1]
            p = (z - zmax).exp_()                                           # [c, V] unnormalised, 0 outside the set
            total = p.sum(1, keepdim=True)                                  # [c, 1]
            log_sum = total.log()                                           # [c, 1] rounds as log_softmax does:
            lse[lo:hi] = (zmax + log_sum)[:, 0]                             # [c]     (z - max) - log Σ exp(z - max)
            logp[lo:hi] = (z.gather(1, t) - zmax - log_sum)[:, 0]           # [c]
            top[lo:hi] = torch.where(valid[lo:hi], z.gather(1, ids) - zmax - log_sum, 0)  # [c, k]
            p.div_(total)                                                   # [c, V] π_θ over the set
            z.nan_to_num_(neginf=0.0)                                       # [c, V] 0 · -inf would be nan
            entropy[lo:hi] = lse[lo:hi] - (p[:, None, :] @ z[:, :, None])[:, 0, 0]  # [c] H = lse - Σ π z
            head = torch.zeros(hi - lo, V + 1, dtype=torch.bool, device=z.device)  # [c, V+1], column V: pads
            head.scatter_(1, torch.where(valid[lo:hi], ids, V), True)
            tail[lo:hi] = p.masked_fill_(head[:, :V], 0).sum(1)             # [c] summed, no 1 - Σ cancellation
            del z, p, head                                                  # before the next chunk's logits
        ctx.save_for_backward(hidden, weight, bias, token_index, targets, top_ids.clamp(min=0), valid, cand_ids,
                              cand_offsets, lse)
        ctx.temperature, ctx.softcap, ctx.chunk = temperature, softcap, chunk
        ctx.mark_non_differentiable(valid, tail, entropy)
        return logp, top, valid, tail, entropy

    @staticmethod
    def backward(ctx, g_logp, g_top, *_):
        hidden, weight, bias, token_index, targets, top_ids, valid, cand_ids, cand_offsets, lse = ctx.saved_tensors
        T, acc = ctx.temperature, torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None          # [N, H]
        grad_w = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None   # [V, H] >= fp32
        grad_b = torch.zeros_like(bias, dtype=acc) if bias is not None and ctx.needs_input_grad[2] else None
        for lo in range(0, targets.numel(), ctx.chunk):
            hi = min(targets.numel(), lo + ctx.chunk)
            h, z, _, slope = _chunk_logits(hidden, weight, bias, token_index, cand_ids, cand_offsets, T,
                                           ctx.softcap, lo, hi, slope=True)
            gt, gk = g_logp[lo:hi], torch.where(valid[lo:hi], g_top[lo:hi], 0)          # [c], [c, k]
            # d log π(v)/dz = e_v - π over the set; z = cap(Wh)/T, so every logit gradient carries 1/T
            # and, with softcapping, the tanh's slope
            grad_z = z.sub_(lse[lo:hi, None]).exp_().mul_(-(gt + gk.sum(1))[:, None])   # [c, V] in place
            grad_z.scatter_add_(1, targets[lo:hi, None], gt[:, None]).scatter_add_(1, top_ids[lo:hi], gk)
            grad_z = grad_z.div_(T) if slope is None else grad_z.div_(T).mul_(slope)     # [c, V] >= fp32
            if grad_b is not None:
                grad_b += grad_z.sum(0)                                                  # [V]
            grad_z = grad_z.to(weight.dtype)                                             # [c, V]
            if grad_h is not None:
                grad_h.index_add_(0, token_index[lo:hi], (grad_z @ weight).to(hidden.dtype))  # [c, H]
            if grad_w is not None:
                grad_w += _mm_fp32(grad_z.T, h)                                          # [V, H] fp32 sum
            del z, grad_z, slope                                                         # before the next chunk
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None                 # one rounding
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def token_logprobs(hidden, weight, bias, token_index, targets, *, temperature=1.0, top_ids=None,
                   candidate_ids=None, candidate_offsets=None, final_logit_softcapping=None,
                   chunk_size=None) -> TokenLogProbs:
    """log π_θ(targets) at packed positions token_index, from hidden [N, H] and the LM head weight [V, H]
    (+ bias [V]), with logits softcapped (final_logit_softcapping: Gemma 2's softcap·tanh(z / softcap), as
    the model's own forward does) then divided by temperature, normalised over each term's candidate set
    (candidate_ids [C] laid end to end, candidate_offsets [M+1]; an empty set means the vocabulary); also
    for top_ids [M, k] (-1 pads). Extra peak memory is O(chunk_size × V); chunk_size defaults to 2^26 / V
    rows (256 MiB of fp32 logits). The weight and bias gradients accumulate over chunks in fp32."""
    M, dev = targets.numel(), weight.device
    top_ids = top_ids if top_ids is not None else torch.empty(M, 0, dtype=torch.long, device=dev)  # [M, k]
    if candidate_ids is None:
        candidate_ids = torch.empty(0, dtype=torch.long, device=dev)                            # [C]
        candidate_offsets = torch.zeros(M + 1, dtype=torch.long, device=dev)                    # [M+1]
    chunk = chunk_size or max(1, 2**26 // weight.shape[0])
    out = _ChunkedLogProbs.apply(hidden, weight, bias, token_index, targets, top_ids, candidate_ids,
                                 candidate_offsets, float(temperature),
                                 None if final_logit_softcapping is None else float(final_logit_softcapping), chunk)
    return TokenLogProbs(*out)


def _band(ratio, adv, config):
    """(inside the importance-sampling bounds, clipped low, clipped high) for ratios and detached advantages."""
    eps_low, eps_high = config.epsilon, config.epsilon_high or config.epsilon
    inside = (ratio >= config.vllm_importance_sampling_clip_min) & (ratio <= config.vllm_importance_sampling_clip_max)
    return inside, (adv < 0) & (ratio < 1 - eps_low), (adv > 0) & (ratio > 1 + eps_high)


def _centering_term(lp: TokenLogProbs, top_logprobs, adv, config):
    """c_t = Σ_{v∈H} sg(β_tv) log π_t(v): its gradient is ĉ_t of the module docstring, step 5.  [M]"""
    valid = lp.top_valid & torch.isfinite(top_logprobs)                          # [M, k]
    log_q = torch.where(valid, top_logprobs, float("-inf"))                      # [M, k]
    pi = torch.where(valid, lp.top.detach().exp(), 0)                            # [M, k] π_v on H
    inside, low, high = _band((lp.top.detach() - log_q).clamp(-20, 20).exp(), adv[:, None], config)
    k_v = valid & inside & ~low & ~high                                          # [M, k] keep bits on H
    q_tail = (1 - log_q.exp().sum(1)).clamp(min=0)                               # [M] Q_tail
    p_tail = lp.tail_mass                                                        # [M] P_tail
    inside, low, high = _band(p_tail / q_tail, adv, config)                      # r_tail = P_tail / Q_tail
    k_tail = (inside & ~low & ~high & (p_tail > 0)).to(pi.dtype)                 # [M]
    z = (pi * k_v).sum(1) + k_tail * p_tail                                      # [M] Z = E_q̂[w]
    beta = pi * (k_v.to(pi.dtype) - k_tail[:, None]) / z.clamp(min=1e-30)[:, None]  # [M, k]
    return (beta * lp.top).sum(1)                                                # [M]


def policy_loss(lp: TokenLogProbs, sampler_logprobs, advantages, num_tokens, config, top_logprobs=None):
    """(loss, metrics) for one micro-batch. num_tokens: trained tokens of the whole optimizer step over all
    micro-batches and ranks (divide it by the world size when the data-parallel wrapper averages gradients)."""
    adv = advantages.to(lp.target.dtype)                                          # [M] A_t
    log_ratio = lp.target - sampler_logprobs                                      # [M]
    ratio = log_ratio.clamp(-20, 20).exp()                                        # [M] finite; ±20 is past any bound
    eps_low, eps_high = config.epsilon, config.epsilon_high or config.epsilon
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)  # [M]
    keep, low, high = _band(ratio.detach(), adv, config)                          # [M] bool each
    if config.score_centering:
        c = _centering_term(lp, top_logprobs, adv, config)                        # [M]
        w = ratio.detach() * (keep & ~low & ~high)                                # [M] sg(w_t)
        per_token = per_token + adv * w * (c - c.detach())                        # [M] value unchanged
    loss = torch.where(keep, per_token, 0).sum() / num_tokens                     # []

    M, d = lp.target.numel(), log_ratio.detach().abs()                            # [M]
    r = log_ratio.detach().exp()                                                  # [M] unclamped, for metrics

    def pair(x):                                                                  # [M] -> [2] (sum, count)
        return torch.stack([x.sum().to(torch.float64), torch.tensor(M, dtype=torch.float64, device=x.device)])

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
    return loss, metrics


@functools.cache
def _warn_biased_ratios():
    warnings.warn("top_k > 0, top_p < 1 or min_p is set but the samples carry no candidate sets: log π_θ is "
                  "normalised over the whole vocabulary, so every importance ratio is biased low. Start vLLM "
                  "(>= 0.28) with --return-sampling-mask --enable-scale-out.", stacklevel=3)


def compute_loss(hidden, weight, bias, row, config, num_tokens, chunk_size=None, final_logit_softcapping=None):
    """(loss, metrics) of a packed row (any object with PackedRow's tensors: token_index, targets,
    sampler_logprobs, advantages and optional top_ids, top_logprobs, candidate_ids, candidate_offsets), from the
    final hidden states [N, H] and the LM head; num_tokens as in `policy_loss`; final_logit_softcapping: the
    model config's (Gemma 2: 30.0), None for models without it."""
    top_ids, top_logprobs = getattr(row, "top_ids", None), getattr(row, "top_logprobs", None)
    candidate_ids = getattr(row, "candidate_ids", None)
    if (config.top_k > 0 or config.top_p < 1 or config.min_p is not None) and candidate_ids is None:
        _warn_biased_ratios()
    if config.score_centering and top_logprobs is None:
        raise ValueError("AsyncGRPOConfig.score_centering: the samples carry no sampler top log-probs; "
                         "set num_sampler_logprobs >= 1 or score_centering=False")
    lp = token_logprobs(hidden, weight, bias, row.token_index, row.targets, temperature=config.temperature,
                        top_ids=top_ids if config.score_centering else None, candidate_ids=candidate_ids,
                        candidate_offsets=getattr(row, "candidate_offsets", None),
                        final_logit_softcapping=final_logit_softcapping, chunk_size=chunk_size)
    return policy_loss(lp, row.sampler_logprobs, row.advantages, num_tokens, config, top_logprobs)


def reduce_metrics(parts: list[dict]) -> dict:
    """Combine metrics of several micro-batches (or gathered ranks) exactly: SUM, or MIN/MAX by name."""
    def op(name):
        return torch.minimum if name.endswith("/min") else torch.maximum if name.endswith("/max") else torch.add
    return {name: functools.reduce(op(name), [p[name] for p in parts]) for name in parts[0]}


def finalize_metrics(metrics: dict) -> dict[str, float]:
    """Plain floats: a [sum, count] pair becomes sum / count (nan without tokens)."""
    return {name: (v[0] / v[1]).item() if v.dim() else v.item() for name, v in metrics.items()}


def router_aux_loss_coef(model_config, coef: float | None) -> float:
    """The router auxiliary-loss weight: `coef` if set, else the model's declared value; an error on a dense
    model (one whose config declares no experts)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    if not any(getattr(text, field, None) for field in MOE_EXPERT_FIELDS):
        if coef is not None:
            raise ValueError(f"AsyncGRPOConfig.router_aux_loss_coef={coef} is set, but {type(text).__name__} has no "
                             f"experts ({'/'.join(MOE_EXPERT_FIELDS)}): leave it None for a dense model")
        return 0.0
    return float(coef if coef is not None else getattr(text, "router_aux_loss_coef", 0.0) or 0.0)


def add_router_aux_loss(loss, aux_loss, coef: float, weight: float = 1.0):
    """loss + coef × weight × aux_loss; aux_loss comes from a forward with output_router_logits=True, weight is
    this micro-batch's share of the optimizer step (e.g. 1 / gradient_accumulation_steps)."""
    return loss + coef * weight * aux_loss if coef else loss
