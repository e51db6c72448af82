"""loss.py: chunked log-probs against full logits, the clipped and masked objective, score
centering, candidate-set renormalisation, step-wide normalisation, metrics and the MoE router
loss."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import loss
import toy
from train import AsyncGRPOConfig

pytestmark = pytest.mark.fast    # the fast tier: no server, no child process (conftest)

V, H = 105, 16


def config(**kw):
    return AsyncGRPOConfig(**kw)


def tot(tokens, samples=1, rows=1):
    """The step's counts: what the default objective (dapo) divides by is the tokens."""
    return loss.StepTotals(tokens, samples, rows)


def naive(hidden, weight, bias, token_index, targets, T=1.0, top_ids=None, sets=None):
    """Full [M, V] logits: log-softmax over each term's set (None/empty = vocabulary), gathered."""
    z = F.linear(hidden[token_index], weight, bias) / T                          # [M, V]
    if sets is not None:
        allowed = torch.tensor([[not s or v in s for v in range(weight.shape[0])] for s in sets])
        z = z.masked_fill(~allowed, float("-inf"))
    logp = z.log_softmax(-1)                                                     # [M, V]
    top = logp.gather(1, top_ids.clamp(min=0)) if top_ids is not None else None
    return logp, logp.gather(1, targets[:, None])[:, 0], top


def packed_sets(sets):
    ids = torch.tensor([v for s in sets for v in s], dtype=torch.long)
    offsets = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    return ids, offsets


def leaves(n=10, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=dtype).mul_(0.25).requires_grad_()
    bias = torch.randn(V, generator=g, dtype=dtype).requires_grad_()
    return hidden, weight, bias


def test_chunked_logprobs_equal_full_logits_values_and_gradients():
    hidden, weight, bias = leaves()
    token_index = torch.tensor([0, 1, 1, 3, 4, 4, 4, 7, 8, 9])           # shared positions repeat
    targets = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    top_ids = torch.randint(0, V, (10, 4), generator=torch.Generator().manual_seed(1))
    top_ids[:, 0] = targets                                              # the target is a top token
    top_ids[2, 3] = -1                                                   # a pad
    sets = [[], list(range(0, 40)), [], list(range(5, 30)) + [90], [], [9, 10, 11, 50], [], [],
            list(range(10, 60)), []]
    top_ids[3, 2] = 95                                                   # a top id outside its set
    cand_ids, cand_offsets = packed_sets(sets)
    T = 0.7
    lp = loss.token_logprobs(hidden, weight, bias, token_index, targets, temperature=T,
                             top_ids=top_ids, candidate_ids=cand_ids,
                             candidate_offsets=cand_offsets, chunk_size=3)
    full, ref_t, ref_top = naive(hidden, weight, bias, token_index, targets, T, top_ids, sets)
    valid = (top_ids >= 0) & torch.isfinite(ref_top)
    assert torch.equal(lp.top_valid, valid) and not valid[2, 3] and not valid[3, 2]
    assert (lp.target - ref_t).abs().max() <= 1e-6
    assert (lp.top - torch.where(valid, ref_top, 0)).abs().max() <= 1e-6
    p = full.exp()
    assert (lp.entropy - -(p * full.nan_to_num(neginf=0)).sum(1)).abs().max() <= 1e-5
    head = torch.zeros(10, V, dtype=torch.bool).scatter_(1, top_ids.clamp(min=0), valid)
    assert (lp.tail_mass - (p * ~head).sum(1)).abs().max() <= 1e-6

    g = torch.Generator().manual_seed(2)
    u_t, u_top = torch.randn(10, generator=g), torch.randn(10, 4, generator=g)
    objective = (lp.target * u_t).sum() + (lp.top * u_top).sum()
    grads = torch.autograd.grad(objective, (hidden, weight, bias))
    ref_sum = (ref_t * u_t).sum() + (torch.where(valid, ref_top, 0) * u_top).sum()
    ref = torch.autograd.grad(ref_sum, (hidden, weight, bias))
    for a, b in zip(grads, ref):
        assert (a - b).abs().max() <= 1e-6


def test_candidate_set_renormalisation_is_log_softmax_over_masked_logits():
    hidden, weight, _ = leaves(3)
    sets = [[3, 4, 5], list(range(20, 70)), []]
    targets = torch.tensor([4, 21, 99])
    ids, offsets = packed_sets(sets)
    lp = loss.token_logprobs(hidden, weight, None, torch.arange(3), targets, candidate_ids=ids,
                             candidate_offsets=offsets)
    z = F.linear(hidden, weight)                                                 # [3, V]
    for t in range(3):
        s = torch.tensor(sets[t] or range(V))
        assert abs(lp.target[t] - (z[t, targets[t]] - z[t, s].logsumexp(0))) <= 1e-6
    vocab = loss.token_logprobs(hidden, weight, None, torch.arange(3), targets).target
    assert (vocab[:2] < lp.target[:2] - 0.1).all()                       # smaller set, larger log π
    with pytest.raises(ValueError, match="outside its candidate set"):
        loss.token_logprobs(hidden, weight, None, torch.arange(3), torch.tensor([9, 21, 99]),
                            candidate_ids=ids, candidate_offsets=offsets)


def test_temperature_divides_logits_in_target_and_top_terms():
    hidden, weight, bias = leaves(4)
    targets, top_ids = torch.tensor([1, 2, 3, 4]), torch.tensor([[7, 8]] * 4)
    for T in (0.5, 2.0):
        lp = loss.token_logprobs(hidden, weight, bias, torch.arange(4), targets, temperature=T,
                                 top_ids=top_ids)
        _, ref_t, ref_top = naive(hidden, weight, bias, torch.arange(4), targets, T, top_ids)
        _, t1, top1 = naive(hidden, weight, bias, torch.arange(4), targets, 1.0, top_ids)
        assert (lp.target - ref_t).abs().max() <= 1e-6 and (lp.top - ref_top).abs().max() <= 1e-6
        assert (lp.target - t1).abs().max() > 1e-2 and (lp.top - top1).abs().max() > 1e-2


def test_backward_holds_no_chunk_logits():
    hidden, weight, bias = leaves(64)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = loss.token_logprobs(hidden, weight, bias, torch.arange(64), torch.arange(64) % V,
                                 chunk_size=8, top_ids=torch.zeros(64, 2, dtype=torch.long))
    inputs = {hidden.data_ptr(), weight.data_ptr(), bias.data_ptr()}
    extra = sum(t.numel() for t in saved if t.data_ptr() not in inputs)
    assert extra < 64 * 16                                               # O(M·k); M·V is 6720
    lp.target.sum().backward()


def stats_lp(logp, top=None, valid=None, tail=None):
    """A TokenLogProbs made by hand, to test the objective alone."""
    M = logp.numel()
    return loss.TokenLogProbs(
        target=logp, top=top if top is not None else torch.zeros(M, 0),
        top_valid=valid if valid is not None else torch.zeros(M, 0, dtype=torch.bool),
        tail_mass=tail if tail is not None else torch.zeros(M), entropy=torch.zeros(M))


def test_ratio_metrics_on_a_hand_computed_example():
    ratios = torch.tensor([2.0, 0.25, 1.0, 8.0, 0.6, 1.1])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0])
    sampler = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.7])
    logp = (sampler + ratios.log()).requires_grad_()
    lp = stats_lp(logp)
    lp.entropy = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    top_lp = torch.tensor([[0.5, 0.2], [0.9, 0.0], [0.3, 0.3], [1.0, 0.0], [0.25, 0.25],
                           [0.1, 0.2]]).log()                            # 0.0: -inf pads
    _, m = loss.policy_loss(lp, sampler, adv, torch.zeros(6, dtype=torch.long), tot(6),
                            config(score_centering=False), top_lp)
    f = loss.finalize_metrics(m)
    assert f["sampling/importance_sampling_ratio/mean"] == pytest.approx(12.95 / 6)
    assert f["sampling/importance_sampling_ratio/min"] == pytest.approx(0.25)
    assert f["sampling/importance_sampling_ratio/max"] == pytest.approx(8.0)
    diffs = [math.log(2), math.log(4), 0, math.log(8), -math.log(0.6), math.log(1.1)]
    assert f["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(diffs) / 6, rel=1e-6)
    assert f["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(8), rel=1e-6)
    assert f["sampling/masked_mean"] == pytest.approx(2 / 6)             # 0.25 < 0.5 and 8 > 5
    assert f["clip_ratio/high_mean"] == pytest.approx(1 / 6)                   # r=2, A>0
    assert f["clip_ratio/low_mean"] == pytest.approx(1 / 6)              # r=0.6, A<0 (0.25: masked)
    assert f["entropy"] == pytest.approx(3.5)
    assert f["sampling/sampler_mass"] == pytest.approx((0.7 + 0.9 + 0.6 + 1.0 + 0.5 + 0.3) / 6)


def test_an_empty_row_gives_zero_loss_zero_gradients_and_neutral_metrics():
    hidden, weight, bias = leaves(3)
    row = row_for(hidden, weight, torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0),
                  torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    out, m = loss.compute_loss(hidden, weight, bias, row, config(), totals=tot(7))
    out.backward()                                                       # every rank runs backward
    assert out.item() == 0 and hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0
    f = loss.finalize_metrics(m)
    assert math.isnan(f["entropy"]) and f["sampling/importance_sampling_ratio/min"] == math.inf


@pytest.mark.parametrize("r, adv, clipped, value", [
    (1.5, 1.0, True, -1.28),    # A>0 above the band: clipped, -(1+ε_high)A
    (0.6, 1.0, False, -0.6),    # A>0 below: -rA, still pushed up
    (0.6, -1.0, True, 0.8),     # A<0 below: clipped, -(1-ε)A
    (1.5, -1.0, False, 1.5),    # A<0 above: -rA, still pushed down
    (1.25, 1.0, False, -1.25),  # inside ε_high = 0.28 (outside ε = 0.2): not clipped
])
def test_clipped_surrogate_value_and_gradient(r, adv, clipped, value):
    logp = torch.tensor([math.log(r) - 1.0], requires_grad=True)
    out, _ = loss.policy_loss(stats_lp(logp), torch.tensor([-1.0]), torch.tensor([adv]),
                              torch.zeros(1, dtype=torch.long), tot(1),
                              config(score_centering=False, epsilon_high=0.28))
    out.backward()
    assert out.item() == pytest.approx(value, rel=1e-6)
    # d(-rA)/dlog π = -rA
    assert logp.grad.item() == pytest.approx(0.0 if clipped else -adv * r, rel=1e-6)


def row_for(hidden, weight, targets, sampler_lp, adv, top_ids=None, top_lp=None, token_index=None):
    n = targets.numel()
    if token_index is None:
        token_index = torch.arange(n)
    return SimpleNamespace(token_index=token_index, targets=targets, sampler_logprobs=sampler_lp,
                           advantages=adv, top_ids=top_ids, top_logprobs=top_lp,
                           sample_ids=torch.zeros(n, dtype=torch.long))


def test_masked_tokens_contribute_zero_gradient():
    hidden, weight, bias = leaves(5)
    targets = torch.tensor([3, 4, 5, 6, 7])
    lp = loss.token_logprobs(hidden, weight, bias, torch.arange(5), targets).target.detach()
    # ratios 1, 6, .9, .4, 1.1
    sampler = lp - torch.tensor([0.0, math.log(6.0), 0.1, math.log(0.4), -0.1])
    top_ids = torch.stack([targets, targets + 1], 1)
    top_lp = torch.full((5, 2), -3.0)
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0, 1.0])
    row = row_for(hidden, weight, targets, sampler, adv, top_ids, top_lp)
    out, m = loss.compute_loss(hidden, weight, bias, row, config(), totals=tot(5))
    out.backward()
    assert (hidden.grad[[1, 3]] == 0).all() and (hidden.grad[[0, 2, 4]].abs().sum(1) > 0).all()
    assert loss.finalize_metrics(m)["sampling/masked_mean"] == pytest.approx(0.4)


def per_token_gradient(hidden, weight, y, log_q, adv, cfg, top_ids):
    """g(y) = -∇(loss of one sampled token y at position 0), flattened over (hidden, weight)."""
    row = row_for(hidden, weight, torch.tensor([y]), log_q[y:y + 1],
                  torch.tensor([adv], dtype=hidden.dtype), top_ids[None], log_q[top_ids][None])
    out, _ = loss.compute_loss(hidden, weight, None, row, cfg, totals=tot(1))
    return -torch.cat([g.flatten() for g in torch.autograd.grad(out, (hidden, weight))])


def toy_position():
    """Hidden state and (tied) LM head of the toy model at one position, as float64 leaves."""
    tok = toy.build_tokenizer()
    model = toy.build_model(len(tok)).double()
    ids = torch.tensor([tok.encode("<|im_start|>user\n3+4=<|im_end|>\n")])
    with torch.no_grad():
        h = model.model(ids).last_hidden_state[0, -1:]                           # [1, H]
    return h.clone().requires_grad_(), model.lm_head.weight.detach().clone().requires_grad_()


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_score_centering_has_zero_mean_under_the_sampler(adv):
    hidden, weight = toy_position()
    Vt = weight.shape[0]
    g = torch.Generator().manual_seed(3)
    log_pi = (hidden @ weight.T)[0].detach().log_softmax(0)                      # [V]
    noise = 1.2 * torch.randn(Vt, generator=g, dtype=log_pi.dtype)
    log_q = (log_pi + noise).log_softmax(0)                              # a far-off sampler
    r = (log_pi - log_q).exp()
    eps = 0.2
    clipped = (r > 1 + eps) if adv > 0 else (r < 1 - eps)
    assert ((r < 0.5) | (r > 5)).sum() >= 3 and (clipped & (r >= 0.5) & (r <= 5)).sum() >= 3
    q = log_q.exp()
    all_ids = torch.arange(Vt)                                           # top-k: all of V
    for centering, zero in ((True, True), (False, False)):
        cfg = config(score_centering=centering, num_sampler_logprobs=Vt)
        drift = sum(q[y] * per_token_gradient(hidden, weight, y, log_q, adv, cfg, all_ids)
                    for y in range(Vt))
        assert (drift.abs().max() <= 1e-6) == zero, drift.abs().max()


@pytest.mark.parametrize("r_tail, adv",
                         [(0.95, 1.0), (3.0, 1.0), (3.0, -1.0), (6.0, -1.0), (0.7, -1.0)])
def test_score_centering_tail_closed_form(r_tail, adv):
    """Top-50 of 105 tokens; the sampler's tail is proportional to π_θ, as the estimator assumes,
    and its ratio r_tail is kept, clipped (A>0 at 3, A<0 at .7) or masked (6): E_q[g] = 0 over all
    tokens still."""
    hidden, weight = toy_position()
    g = torch.Generator().manual_seed(4)
    log_pi = (hidden @ weight.T)[0].detach().log_softmax(0)                      # [V]
    pi = log_pi.exp()
    head = pi.argsort(descending=True)[:50]
    tail = torch.ones_like(pi, dtype=torch.bool).index_fill_(0, head, False)
    q = torch.empty_like(pi)
    q[tail] = pi[tail] / r_tail                                          # ratio r_tail on the tail
    w = pi[head] * (2.0 * torch.rand(50, generator=g, dtype=pi.dtype)).exp()
    assert q[tail].sum() < 0.9
    q[head] = w / w.sum() * (1 - q[tail].sum())
    log_q = q.log()
    cfg = config(num_sampler_logprobs=50)
    drift = sum(q[y] * per_token_gradient(hidden, weight, y, log_q, adv, cfg, head)
                for y in range(len(q)))
    assert drift.abs().max() <= 1e-6


def test_score_centering_changes_gradient_not_loss_and_off_is_the_clipped_objective():
    hidden, weight, bias = leaves(6, seed=5)
    targets = torch.tensor([1, 2, 3, 4, 5, 6])
    lp = loss.token_logprobs(hidden, weight, bias, torch.arange(6), targets).target.detach()
    sampler = lp - torch.tensor([0.3, -0.3, 0.1, 0.5, -0.05, 0.0])
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5, 1.0])
    top_ids = torch.arange(8).repeat(6, 1)
    top_lp = torch.full((6, 8), math.log(0.05))
    results = {}
    for centering in (True, False):
        row = row_for(hidden, weight, targets, sampler, adv, top_ids, top_lp)
        cfg = config(score_centering=centering)
        out, _ = loss.compute_loss(hidden, weight, bias, row, cfg, totals=tot(6))
        results[centering] = out.item(), torch.autograd.grad(out, hidden)[0]
    r = (lp - sampler).exp()
    expected = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv).sum() / 6
    assert results[True][0] == pytest.approx(expected.item(), rel=1e-6) == results[False][0]
    assert (results[True][1] - results[False][1]).abs().max() > 1e-3
    lp = loss.token_logprobs(hidden, weight, bias, torch.arange(6), targets).target
    r = (lp - sampler).exp()
    plain_loss = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv).sum() / 6
    plain = torch.autograd.grad(plain_loss, hidden)[0]
    assert (results[False][1] - plain).abs().max() <= 1e-7


def test_loss_is_a_token_mean_over_the_step_whatever_the_micro_batches():
    hidden, weight, bias = leaves(12, seed=6)
    g = torch.Generator().manual_seed(7)
    targets = torch.randint(0, V, (12,), generator=g)
    lp = loss.token_logprobs(hidden, weight, bias, torch.arange(12), targets).target.detach()
    sampler = lp + 0.4 * torch.randn(12, generator=g)
    adv = torch.randn(12, generator=g)
    top_ids = torch.randint(0, V, (12, 4), generator=g)
    top_lp = torch.randn(12, 4, generator=g) - 4
    grads, metrics = [], []
    for bounds in ([0, 12], [0, 5, 12], [0, 2, 5, 8, 12]):
        for p in (hidden, weight, bias):
            p.grad = None
        parts = []
        for lo, hi in zip(bounds, bounds[1:]):
            s = slice(lo, hi)
            row = row_for(hidden, weight, targets[s], sampler[s], adv[s], top_ids[s], top_lp[s],
                          torch.arange(lo, hi))
            out, m = loss.compute_loss(hidden, weight, bias, row, config(), totals=tot(12))
            out.backward()
            parts.append(m)
        grads.append(torch.cat([hidden.grad.flatten(), weight.grad.flatten(), bias.grad]))
        metrics.append(loss.finalize_metrics(loss.reduce_metrics(parts)))
    for other, m in zip(grads[1:], metrics[1:]):
        assert (other - grads[0]).abs().max() <= 1e-6
        assert m == pytest.approx(metrics[0], rel=1e-6)


def test_score_centering_without_sampler_top_logprobs_is_refused_naming_the_fix():
    hidden, weight, _ = leaves(2)
    row = row_for(hidden, weight, torch.tensor([1, 2]), torch.tensor([-4.0, -4.0]), torch.ones(2))
    with pytest.raises(ValueError, match="score_centering"):
        loss.compute_loss(hidden, weight, None, row, config(), tot(2))


def test_router_aux_loss_on_a_tiny_moe_and_error_on_a_dense_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    assert loss.router_aux_loss_coef(cfg, None) == 0.02
    assert loss.router_aux_loss_coef(cfg, 0.5) == 0.5
    out = model(torch.tensor([[1, 2, 3, 4, 5]]), output_router_logits=True)
    (0.25 * out.aux_loss).backward()                # train_step's coef × aux / (rows × world)
    gates = [p.grad for n, p in model.named_parameters() if "gate" in n and "proj" not in n]
    assert gates and all(g is not None and g.abs().sum() > 0 for g in gates)
    dense = toy.build_model(V).config
    assert loss.router_aux_loss_coef(dense, None) == 0.0
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        loss.router_aux_loss_coef(dense, 0.01)


def test_final_logit_softcapping_matches_the_models_own_logits_values_and_gradients():
    """Gemma 2 softcaps its logits after the head, softcap·tanh(z / softcap); token_logprobs with
    the config's final_logit_softcapping equals log_softmax of the model's own logits / T, in value
    and in gradient."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    m = Gemma2ForCausalLM(Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=16,
                                       final_logit_softcapping=0.5,
                                       attn_implementation="eager")).float()
    ids, T = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(1)), 0.7
    token_index, targets = torch.arange(11), ids[0, 1:]
    out = m(input_ids=ids, output_hidden_states=True)
    ref = (out.logits[0, :-1] / T).log_softmax(-1).gather(1, targets[:, None])[:, 0]        # [11]
    hidden = out.hidden_states[-1][0]                                    # [12, H] after norm
    head = m.lm_head.weight
    lp = loss.token_logprobs(hidden, head, None, token_index, targets, temperature=T,
                             final_logit_softcapping=m.config.final_logit_softcapping,
                             chunk_size=4).target
    uncapped = loss.token_logprobs(hidden, head, None, token_index, targets, temperature=T).target
    assert (lp - ref).abs().max() <= 1e-6 and (uncapped - ref).abs().max() > 1e-2
    u = torch.randn(11, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((lp * u).sum(), m.parameters(), retain_graph=True)
    want = torch.autograd.grad((ref * u).sum(), m.parameters())
    for a, b in zip(got, want):
        assert (a - b).norm() <= 1e-5 * b.norm() + 1e-9


def test_softcapped_chunked_logprobs_with_candidate_sets_and_top_tokens_equal_full_logits():
    hidden, weight, bias = leaves(6)
    token_index, targets = torch.tensor([0, 1, 1, 3, 4, 5]), torch.tensor([5, 6, 7, 8, 9, 10])
    top_ids = torch.tensor([[5, 1], [6, 2], [7, -1], [8, 4], [9, 50], [10, 3]])
    sets = [[], list(range(0, 40)), [], list(range(5, 30)), [], [9, 10, 11, 50]]
    cand_ids, cand_offsets = packed_sets(sets)
    cap, T = 1.5, 0.8
    lp = loss.token_logprobs(hidden, weight, bias, token_index, targets, temperature=T,
                             top_ids=top_ids, candidate_ids=cand_ids,
                             candidate_offsets=cand_offsets, final_logit_softcapping=cap,
                             chunk_size=4)
    z = cap * torch.tanh(F.linear(hidden[token_index], weight, bias) / cap) / T       # [M, V]
    allowed = torch.tensor([[not s or v in s for v in range(V)] for s in sets])
    full = z.masked_fill(~allowed, float("-inf")).log_softmax(-1)
    ref_t, ref_top = full.gather(1, targets[:, None])[:, 0], full.gather(1, top_ids.clamp(min=0))
    valid = lp.top_valid
    assert (lp.target - ref_t).abs().max() <= 1e-6
    assert (lp.top - torch.where(valid, ref_top, 0)).abs().max() <= 1e-6
    u_t, u_top = torch.randn(6), torch.randn(6, 2)
    objective = (lp.target * u_t).sum() + (lp.top * u_top).sum()
    got = torch.autograd.grad(objective, (hidden, weight, bias))
    want = torch.autograd.grad((ref_t * u_t).sum() + (torch.where(valid, ref_top, 0) * u_top).sum(),
                               (hidden, weight, bias))
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5


def test_bf16_head_gradients_accumulate_in_fp32_as_one_matmul_would():
    """64 chunks of bf16 LM-head gradients: summed in bf16 they were ~1% off; summed in fp32 and
    rounded once, the error is that of a single bf16 matmul (both against an fp64 reference on the
    same bf16 inputs)."""
    g = torch.Generator().manual_seed(0)
    M, Vb, Hb = 1024, 256, 32
    hidden = torch.randn(M, Hb, generator=g).bfloat16()
    bias = torch.randn(Vb, generator=g).bfloat16()
    weight = (torch.randn(Vb, Hb, generator=g) / Hb**0.5).bfloat16()
    targets, u = torch.randint(0, Vb, (M,), generator=g), torch.randn(M, generator=g)

    def head_grads(h, w, b, chunk=None):
        h, w, b = (x.clone().requires_grad_() for x in (h, w, b))
        if chunk:
            lp = loss.token_logprobs(h, w, b, torch.arange(M), targets, chunk_size=chunk).target
        else:
            lp = F.linear(h, w, b).float().log_softmax(-1).gather(1, targets[:, None])[:, 0]
        return torch.autograd.grad((lp * u).sum(), (w, b))

    ref = head_grads(hidden.double(), weight.double(), bias.double())

    def err(got):
        return [((a.double() - r).norm() / r.norm()).item() for a, r in zip(got, ref)]
    single = err(head_grads(hidden, weight, bias))
    chunked = err(head_grads(hidden, weight, bias, chunk=16))
    assert all(c.dtype == torch.bfloat16 for c in head_grads(hidden, weight, bias, chunk=16))
    assert chunked[0] <= 1.01 * single[0] and chunked[1] <= 1.01 * single[1], (chunked, single)
    assert single[0] < 4e-3                                              # bf16: 2^-8 relative


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_head_gradients_on_cuda_are_as_exact_as_one_matmul():
    g = torch.Generator().manual_seed(0)
    M, Vb, Hb = 4096, 4096, 256
    hidden = torch.randn(M, Hb, generator=g).bfloat16().cuda()
    weight = (torch.randn(Vb, Hb, generator=g) / Hb**0.5).bfloat16().cuda()
    targets, u = torch.randint(0, Vb, (M,), generator=g).cuda(), torch.randn(M, generator=g).cuda()

    def head_grad(h, w, chunk=None):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        if chunk:
            lp = loss.token_logprobs(h, w, None, torch.arange(M, device="cuda"), targets,
                                     chunk_size=chunk).target
        else:
            lp = F.linear(h, w).float().log_softmax(-1).gather(1, targets[:, None])[:, 0]
        return torch.autograd.grad((lp * u).sum(), w)[0]

    ref = head_grad(hidden.double(), weight.double())

    def err(got):
        return ((got.double() - ref).norm() / ref.norm()).item()
    single = err(head_grad(hidden, weight))
    chunked = err(head_grad(hidden, weight, chunk=64))
    assert chunked <= 1.05 * single, (chunked, single)


def test_mismatch_metrics_replay_the_worked_example():
    """mismatch_metrics' docstring: log r = (0.1, -0.1) gives k3 0.0050, max 0.1, 2 tokens; no
    token gives nan after finalize (not a fake 0)."""
    from loss import finalize_metrics, mismatch_metrics
    out = finalize_metrics(mismatch_metrics(torch.tensor([0.1, -0.1])))
    expected = ((math.exp(0.1) - 1.1) + (math.exp(-0.1) - 0.9)) / 2
    assert out["sampling/mismatch_kl"] == pytest.approx(expected, rel=1e-4)   # fp32 exp
    assert round(out["sampling/mismatch_kl"], 4) == 0.0050
    assert out["sampling/logprob_diff_max"] == pytest.approx(0.1)
    assert out["sampling/mismatch_tokens"] == 2
    none = finalize_metrics(mismatch_metrics(torch.zeros(0)))
    assert none["sampling/mismatch_tokens"] == 0
    assert math.isnan(none["sampling/mismatch_kl"])
    assert math.isnan(none["sampling/logprob_diff_max"])


def test_only_the_tokens_of_the_trainers_version_count_for_the_mismatch():
    """compute_loss with version v: the tokens whose model_versions is v (staleness 0) are the
    mismatch's; a stale token with a large log-ratio does not move it."""
    from types import SimpleNamespace

    from config import AsyncGRPOConfig
    from loss import compute_loss, finalize_metrics
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 8), torch.randn(16, 8)
    targets = torch.tensor([1, 2, 3])
    exact = torch.log_softmax(hidden @ weight.T, -1)[torch.arange(3), targets]
    row = SimpleNamespace(token_index=torch.arange(3), targets=targets,
                          sampler_logprobs=exact - torch.tensor([0.0, 0.0, 2.0]),
                          advantages=torch.ones(3), model_versions=torch.tensor([5, 5, 4]),
                          sample_ids=torch.zeros(3, dtype=torch.long))
    config = AsyncGRPOConfig(score_centering=False)
    _, metrics = compute_loss(hidden, weight, None, row, config, tot(3), version=5)
    out = finalize_metrics(metrics)
    assert out["sampling/mismatch_tokens"] == 2
    assert out["sampling/mismatch_kl"] <= 1e-6 and out["sampling/logprob_diff_max"] <= 1e-6
    _, metrics = compute_loss(hidden, weight, None, row, config, tot(3), version=4)
    assert finalize_metrics(metrics)["sampling/logprob_diff_max"] == pytest.approx(2.0, abs=1e-5)


# ── the objective by name: loss_type and importance_sampling_level on a trie row ──────────────


def forked_row(split: bool = False):
    """Three samples of two rollouts packed as one prefix trie (or, `split`, two rows): rollout A's
    two training sequences (a forked turn: the template re-rendered 11 as 12 before the tool
    result 13) and rollout B, all sharing the prompt 1 2 3. Returns (rows, per sample: its terms'
    log-ratios, advantage, sampler log-probs)."""
    import numpy as np

    from rollout.samples import RolloutSample
    from trie_pack import build_row
    seqs = {"A0": ([1, 2, 3, 10, 11], [0, 0, 0, 1, 1], 1.0),
            "A1": ([1, 2, 3, 10, 12, 13, 20, 21], [0, 0, 0, 0, 0, 0, 1, 1], 1.0),
            "B": ([1, 2, 3, 30, 31, 32], [0, 0, 0, 1, 1, 1], -0.5)}
    samples = []
    for g, (ids, mask, adv) in enumerate(seqs.values()):
        sampler = np.where(np.array(mask) == 1, -1.0 - 0.1 * np.arange(len(ids)), 0.0)
        samples.append(RolloutSample(np.array(ids), np.array(mask, dtype=np.int8),
                                     sampler.astype(np.float32), adv, g // 2, 0))
    parts = [samples[:2], samples[2:]] if split else [samples]
    return [build_row(p).pack() for p in parts], samples


# log π - log q of each sample's terms, in its token order: clipped and unclipped tokens on
# both sides of 1 ± ε, none outside the importance-sampling bounds [0.5, 5]
LOG_RATIOS = {0: [0.1, -0.3], 1: [0.35, 0.05], 2: [-0.1, 0.25, 0.0]}


def trl_reference(kind, level, logp, sampler, adv, mask, cfg, ref=None):
    """TRL GRPOTrainer's definitions (read from its _compute_loss) on padded [B, T] tensors, one
    row per sample: loss value, for comparison with the packed trie's."""
    log_ratio = (logp - sampler) * mask
    if level == "sequence":
        log_w = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1))[:, None]     # [B, 1]
    else:
        log_w = log_ratio
    coef_1 = log_w.exp()
    A = adv[:, None]
    if kind == "cispo":
        per_token = -coef_1.clamp(max=cfg.epsilon_high).detach() * A * logp
    else:
        coef_2 = coef_1.clamp(1 - cfg.epsilon, 1 + (cfg.epsilon_high or cfg.epsilon))
        per_token = -torch.minimum(coef_1 * A, coef_2 * A)
    if ref is not None:
        per_token = per_token + cfg.beta * ((ref - logp).exp() - (ref - logp) - 1)
    if kind == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if kind == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if kind == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * cfg.max_completion_length)
    return (per_token * mask).sum() / mask.sum()                     # dapo, cispo: all tokens


def padded(values_by_sample):
    """[B, T] tensor and mask from per-sample lists (in sample order)."""
    T = max(len(v) for v in values_by_sample)
    out = torch.zeros(len(values_by_sample), T, dtype=torch.float64)
    mask = torch.zeros_like(out)
    for i, v in enumerate(values_by_sample):
        out[i, :len(v)] = torch.as_tensor(v, dtype=torch.float64)
        mask[i, :len(v)] = 1
    return out, mask


@pytest.mark.parametrize("kind, level", [("dapo", "token"), ("grpo", "token"), ("bnpo", "token"),
                                         ("dr_grpo", "token"), ("cispo", "token"),
                                         ("dapo", "sequence"), ("grpo", "sequence")])
def test_each_loss_type_on_a_trie_row_with_a_shared_prefix_and_a_fork_is_trls_definition(kind,
                                                                                          level):
    """The packed row (prompt shared by three samples, a forked turn) gives TRL's loss value and
    the same gradient for each sample's log-probs as TRL's padded [B, T] computation."""
    (row,), samples = forked_row()
    assert row.unique_tokens < row.raw_tokens                        # the prompt is shared
    ids = row.sample_ids.tolist()
    assert ids.count(0) == ids.count(1) == 2 and ids.count(2) == 3
    cfg = config(loss_type=kind, importance_sampling_level=level, score_centering=False,
                 epsilon_high=5.0 if kind == "cispo" else 0.28, max_completion_length=6)
    # the packed terms' log π, by sample and in token order, from LOG_RATIOS and the sampler's
    by_sample = {i: [] for i in range(3)}
    for t, i in enumerate(ids):
        by_sample[i].append(t)
    logp = torch.zeros(len(ids), dtype=torch.float64)
    for i, terms in by_sample.items():
        for k, t in enumerate(terms):
            logp[t] = row.sampler_logprobs[t] + LOG_RATIOS[i][k]
    logp.requires_grad_()
    out, m = loss.policy_loss(stats_lp(logp), row.sampler_logprobs.double(),
                              row.advantages.double(), row.sample_ids, loss.StepTotals.of([row]),
                              cfg)
    (grad,) = torch.autograd.grad(out, logp)
    # TRL: padded per sample
    lp_pad, mask = padded([[logp[t].item() for t in by_sample[i]] for i in range(3)])
    lp_pad.requires_grad_()
    sampler, _ = padded([[row.sampler_logprobs[t] for t in by_sample[i]] for i in range(3)])
    adv = torch.tensor([samples[i].advantage for i in range(3)], dtype=torch.float64)
    expected = trl_reference(kind, level, lp_pad, sampler, adv, mask, cfg)
    (grad_pad,) = torch.autograd.grad(expected, lp_pad)
    assert out.item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-15)
    for i, terms in by_sample.items():
        assert grad[terms].tolist() == pytest.approx(grad_pad[i, :len(terms)].tolist(), rel=1e-9)
    assert loss.finalize_metrics(m)["sampling/masked_mean"] == 0     # all inside [0.5, 5]


def test_the_loss_types_by_hand_on_the_forked_row():
    """normalized's worked example's rules on the forked row, each number by hand: dapo 7 tokens,
    grpo 3 samples' means, bnpo one row of 7, dr_grpo 3 × max_completion_length 6."""
    (row,), _ = forked_row()
    ids = row.sample_ids
    per_token = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], dtype=torch.float64)
    terms = {i: per_token[ids == i].sum().item() for i in range(3)}        # each sample's sum
    n = {i: int((ids == i).sum()) for i in range(3)}                       # 2, 2, 3
    totals = loss.StepTotals.of([row])
    assert (totals.tokens, totals.samples, totals.rows) == (7, 3, 1)
    got = {k: loss.normalized(per_token, ids, totals, config(loss_type=k, max_completion_length=6,
                                                               score_centering=False,
                                                               epsilon_high=5.0)).item()
           for k in ("dapo", "grpo", "bnpo", "dr_grpo", "cispo")}
    assert got["dapo"] == got["cispo"] == pytest.approx(28 / 7)
    assert got["grpo"] == pytest.approx(sum(terms[i] / n[i] for i in range(3)) / 3)
    assert got["bnpo"] == pytest.approx(28 / (7 * 1))
    assert got["dr_grpo"] == pytest.approx(28 / (3 * 6))
    # the docstring's worked example
    small = torch.tensor([1.0, 3.0, 5.0, 7.0])
    small_ids = torch.tensor([0, 0, 0, 1])
    worked = {k: loss.normalized(small, small_ids, loss.StepTotals(4, 2, 1),
                                 config(loss_type=k, max_completion_length=8,
                                        score_centering=False, epsilon_high=5.0)).item()
              for k in ("dapo", "grpo", "bnpo", "dr_grpo")}
    assert worked == {"dapo": 4.0, "grpo": 5.0, "bnpo": 4.0, "dr_grpo": 1.0}
    assert loss.sample_mean(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1])).tolist() == [
        2.0, 2.0, 5.0]


@pytest.mark.parametrize("kind, level", [("dapo", "token"), ("grpo", "token"),
                                         ("dr_grpo", "token"), ("cispo", "token"),
                                         ("dapo", "sequence")])
def test_a_step_split_over_two_rows_trains_as_one_row(kind, level):
    """Micro-batches do not change any loss_type but bnpo (a mean per row by definition): the
    forked row split in two (its rollouts apart) gives the same loss and gradient in sum, with the
    real forward through the model: per-sample quantities are taken per sample, not per row."""
    import numpy as np

    import tree_attention
    one, _ = forked_row()
    two, _ = forked_row(split=True)
    model = toy.build_model(len(toy.build_tokenizer()))
    tree_attention.install(model, "sdpa")
    cfg = config(loss_type=kind, importance_sampling_level=level, score_centering=False,
                 epsilon_high=5.0 if kind == "cispo" else 0.28)
    results = []
    for rows in (one, two):
        model.zero_grad()
        totals, total = loss.StepTotals.of(rows), 0.0
        for row in rows:
            hidden = tree_attention.forward_row(model, row, model.model).last_hidden_state[0]
            out, _ = loss.compute_loss(hidden, model.lm_head.weight, None, row, cfg, totals)
            out.backward()
            total += out.item()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((total, grads))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    np.testing.assert_allclose(results[0][1].numpy(), results[1][1].numpy(), atol=1e-6)


def test_the_reference_kl_is_trls_estimator_over_the_candidate_set():
    """beta > 0 adds β·(e^(ref - log π) - (ref - log π) - 1) per token, logged as `kl` (its
    mean); the reference's log-probs come from row_logprobs over the same candidate sets as the
    policy's, and beta 0's loss has no kl."""
    (row,), _ = forked_row()
    g = torch.Generator().manual_seed(3)
    logp = (row.sampler_logprobs.double() + 0.1 * torch.randn(7, generator=g,
                                                               dtype=torch.float64))
    logp.requires_grad_()
    ref = row.sampler_logprobs.double() + 0.2 * torch.randn(7, generator=g, dtype=torch.float64)
    cfg = config(beta=0.04, score_centering=False, epsilon_high=0.28)
    out, m = loss.policy_loss(stats_lp(logp), row.sampler_logprobs.double(),
                              row.advantages.double(), row.sample_ids, loss.StepTotals.of([row]),
                              cfg, ref_logprobs=ref)
    plain, m0 = loss.policy_loss(stats_lp(logp), row.sampler_logprobs.double(),
                                 row.advantages.double(), row.sample_ids,
                                 loss.StepTotals.of([row]), config(score_centering=False,
                                                                   epsilon_high=0.28))
    x = ref - logp.detach()
    kl = x.exp() - x - 1
    assert (out - plain).item() == pytest.approx(0.04 * kl.sum().item() / 7, rel=1e-10)
    assert loss.finalize_metrics(m)["kl"] == pytest.approx(kl.mean().item(), rel=1e-10)
    assert "kl" not in m0
    # row_logprobs normalises over each term's candidate set, as the policy's log-probs
    hidden, weight, _ = leaves(3)
    sets = [[1, 2, 3], [], [4, 5, 6, 7]]
    ids, offsets = packed_sets(sets)
    sub = SimpleNamespace(token_index=torch.arange(3), targets=torch.tensor([2, 9, 5]),
                          candidate_ids=ids, candidate_offsets=offsets)
    got = loss.row_logprobs(hidden, weight, None, sub, 0.7).target
    _, want, _ = naive(hidden, weight, None, torch.arange(3), sub.targets, T=0.7, sets=sets)
    assert torch.allclose(got, want, atol=1e-5)


def test_k3_is_never_negative_where_rounding_near_ratio_one_would_make_it_so():
    """(r - 1) - log r at log-ratios 1e-8 and -1e-4 rounds below 0 in fp32 (e^1e-8 is 1.0 there): k3
    clamps each token at 0, so the logged parity figures are never negative; a real gap keeps its
    value."""
    x = torch.tensor([1e-8, -1e-4, 0.0, 0.5])
    raw = x.exp() - 1 - x
    assert (raw[:2] < 0).all()                                   # what the clamp is for
    got = loss.k3(x)
    assert (got >= 0).all() and got[:3].abs().max() == 0
    assert got[3].item() == pytest.approx(math.exp(0.5) - 1.5, rel=1e-6)
