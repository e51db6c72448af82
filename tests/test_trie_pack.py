"""trie_pack.py (ツリーパッキング (tree packing), バッチ番号の構成 (batch composition)): the
packed layout reproduces every sample, matches are explicit, the planner keeps its invariants,
metrics add up."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rollout.samples import RolloutSample
import trie_pack
from trie_pack import Planner, TreeRow, build_row

pytestmark = pytest.mark.fast    # the fast tier: no server, no child process (conftest)

SETTINGS = settings(max_examples=60, deadline=None)


def sample(ids, mask, group=0, adv=1.0, extras=False, rng=None, version=0):
    ids, mask = np.asarray(ids, np.int64), np.asarray(mask, np.int8)
    n = len(ids)
    logprobs = np.where(mask > 0, -np.arange(n) / 10, 0).astype(np.float32)
    s = RolloutSample(ids, mask, logprobs, adv, group, version)
    if extras:   # top-k and ragged candidate sets, distinct per position so misalignment shows
        s.top_ids = np.arange(n * 2).reshape(n, 2) + 1000 * group
        s.top_logprobs = -np.arange(n * 2, dtype=np.float32).reshape(n, 2)
        s.candidate_counts = (rng.integers(0, 3, n) * mask).astype(np.int32)
        s.candidate_ids = rng.integers(0, 50, int(s.candidate_counts.sum())).astype(np.int32)
    return s


def stream(seed: int, n_groups: int, vocab: int, extras: bool) -> list:
    """Groups of rollouts of one prompt; some fork (a second sample re-using part of the first)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, rng.integers(0, 4))          # shared across prompts sometimes
    out = []
    for g in range(n_groups):
        prompt = np.concatenate([system, rng.integers(0, vocab, rng.integers(1, 8))])
        for _ in range(rng.integers(1, 5)):
            comp = rng.integers(0, vocab, rng.integers(1, 8))
            ids = np.concatenate([prompt, comp])
            mask = np.r_[np.zeros(len(prompt)), rng.integers(0, 2, len(comp))]
            out.append(sample(ids, mask, g, float(rng.normal()), extras, rng))
            if rng.random() < 0.3:                               # multi-turn fork
                cut = rng.integers(1, len(ids) + 1)
                tail = rng.integers(0, vocab, rng.integers(1, 6))
                ids2 = np.concatenate([ids[:cut], tail])
                mask2 = np.r_[mask[:cut], np.ones(len(tail))]
                mask2[0] = 0
                out.append(sample(ids2, mask2, g, float(rng.normal()), extras, rng))
    interleave = rng.random() < 0.5                              # arrival may interleave groups
    order = rng.permutation(len(out)) if interleave else np.arange(len(out))
    return [out[i] for i in order]


def trained(s) -> int:
    return int(np.count_nonzero(s.completion_mask[1:]))


def visible(p, i):
    """Packed indices query i attends to, from the ancestry form."""
    j = np.arange(i + 1)
    return j[p.subtree_end.numpy()[: i + 1] >= i]


def check_row(row: TreeRow, maximal: bool = True):
    p = row.pack()
    ids, pos = p.input_ids.numpy(), p.position_ids.numpy()
    cu_q, cu_k, kv = p.cu_seqlens_q.numpy(), p.cu_seqlens_k.numpy(), p.kv_index.numpy()
    assert cu_q[-1] == len(ids) == p.unique_tokens == row.unique_tokens
    assert row.unique_tokens <= p.raw_tokens == row.raw_tokens
    assert p.attention_cost == row.attention_cost == int((pos + 1).sum())
    # maximal sharing: one packed token per distinct (prefix, next token) node
    nodes = {(tuple(s.input_ids[: t + 1]), s.input_ids[t + 1] if t + 1 < len(s.input_ids) else None)
             for s in row.samples for t in range(len(s.input_ids))}
    assert len(nodes) == len(ids) if maximal else len(nodes) <= len(ids)
    paths = []
    for s in range(len(cu_q) - 1):
        path = kv[cu_k[s]: cu_k[s + 1]]
        q = np.arange(cu_q[s], cu_q[s + 1])
        assert np.array_equal(path[len(path) - len(q):], q)         # the segment's own tokens last
        assert np.array_equal(pos[path], np.arange(len(path)))       # position_ids = depth
        for r, i in enumerate(q):                                    # kv_index == ancestry form
            assert np.array_equal(visible(p, i), path[: len(path) - len(q) + r + 1])
        paths.append(path)
    assert p.max_seqlen_q == max(np.diff(cu_q)) and p.max_seqlen_k == max(np.diff(cu_k))
    for smp in row.samples:              # every sample = the segments on its path, end to end
        assert any(len(path) == len(smp.input_ids) and np.array_equal(ids[path], smp.input_ids)
                   and p.subtree_end[path[-1]] == path[-1] for path in paths)
    sid, tix = p.sample_ids.numpy(), p.token_index.numpy()
    cand_off = p.candidate_offsets.numpy() if p.candidate_offsets is not None else None
    for s, smp in enumerate(row.samples):
        t = np.flatnonzero(smp.completion_mask[1:]) + 1
        m = np.flatnonzero(sid == s)
        assert np.array_equal(p.targets.numpy()[m], smp.input_ids[t])
        assert np.array_equal(p.sampler_logprobs.numpy()[m], smp.sampler_logprobs[t])
        assert np.all(p.advantages.numpy()[m] == np.float32(smp.advantage))
        for k, tt in zip(m, t):          # the predicting position sees exactly the sample's history
            assert np.array_equal(ids[visible(p, tix[k])], smp.input_ids[:tt])
        if smp.top_ids is not None:
            assert np.array_equal(p.top_ids.numpy()[m], smp.top_ids[t])
            assert np.array_equal(p.top_logprobs.numpy()[m], smp.top_logprobs[t])
            first = np.cumsum(smp.candidate_counts) - smp.candidate_counts
            for k, tt in zip(m, t):
                want = smp.candidate_ids[first[tt]: first[tt] + smp.candidate_counts[tt]]
                assert np.array_equal(p.candidate_ids.numpy()[cand_off[k]: cand_off[k + 1]], want)
    assert p.trained_tokens == len(tix) == row.trained_tokens == sum(map(trained, row.samples))
    # completion_mask == 0 tokens: fewer than the positions predicting nothing (a trained token
    # may share its predicting node with another's), more than untrained ones per loss term
    assert len(ids) - p.trained_tokens <= p.masked_tokens <= len(ids) - len(np.unique(tix))
    return p


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n_groups=st.integers(1, 4),
       vocab=st.sampled_from([2, 3, 50]), extras=st.booleans())
def test_packed_row_reproduces_every_sample(seed, n_groups, vocab, extras):
    check_row(build_row(stream(seed, n_groups, vocab, extras)))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_hash_collisions_cost_sharing_never_correctness(seed):
    """Node names squeezed into 3 values: nearly every lookup collides; each match is checked."""
    real = trie_pack.node_keys
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trie_pack, "node_keys", lambda ids: real(ids) % np.uint64(3))
        check_row(build_row(stream(seed, 3, 3, False)), maximal=False)


def test_spec_example_layout_and_metrics():
    r0 = sample([1, 2, 3, 10, 11], [0, 0, 1, 1, 1])
    r1 = sample([1, 2, 3, 20, 21], [0, 0, 1, 1, 1])
    row = TreeRow()
    for s in (r0, r1):
        match = row.match(s)
        assert row.fits(match, 8)
        row.add(s, match)
    late = sample([1, 2, 3, 30], [0, 0, 0, 1])
    match = row.match(late)
    assert (match.shared, match.novel) == (2, 2)
    assert not row.fits(match, 8)                                # 8 unique + 2 novel > 8
    assert row.added_cost(match) == 3 + 4                        # depths 2 and 3, plus one each
    p = check_row(row)
    assert p.input_ids.tolist() == [1, 2, 3, 10, 11, 3, 20, 21]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert p.cu_seqlens_q.tolist() == [0, 2, 5, 8]
    assert p.kv_index.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6, 7]
    assert p.cu_seqlens_k.tolist() == [0, 2, 7, 12]
    assert p.subtree_end.tolist() == [7, 7, 4, 4, 4, 7, 7, 7]
    assert p.token_index.tolist() == [1, 2, 3, 1, 5, 6]
    assert p.attention_cost == 27 and p.masked_tokens == 2      # p1 p2: completion_mask 0

    other = build_row([sample([5, 6, 7, 8], [0, 0, 1, 1], group=1)])
    planner = Planner(world_size=2, token_budget=16, per_device_train_batch_size=1)
    m = planner.metrics([p, other.pack()])
    assert m == pytest.approx({
        "batch/samples_per_row": 1.5, "batch/row_tokens_mean": 6.0, "batch/row_tokens_max": 8.0,
        "batch/row_fill_frac": 6 / 16, "batch/row_imbalance": 27 / ((27 + 10) / 2),
        "batch/packing_ratio": 14 / 12, "batch/pad_frac": 1 - 12 / 16,
        "batch/masked_token_frac": (2 + 2) / 12})


def test_a_match_is_for_its_row_as_it_was():
    """add() takes a match only from the row it was made on, before the row grew since."""
    a, b = sample([1, 2, 3, 4], [0, 0, 1, 1]), sample([1, 2, 5], [0, 0, 1])
    row, other = TreeRow(), TreeRow()
    match_b = row.match(b)
    row.add(a)
    with pytest.raises(ValueError, match="before it grew"):
        row.add(b, match_b)
    with pytest.raises(ValueError, match="another row"):
        other.add(b, row.match(b))
    duplicate = sample(a.input_ids, a.completion_mask)
    match = row.match(duplicate)
    assert match.novel == 0 and row.added_cost(match) == 0
    row.add(duplicate, match)
    row.add(b, row.match(b))
    assert row.pack().input_ids.tolist() == [1, 2, 3, 4, 2, 5]  # [1] [2 3 4] + [2 5]


def test_duplicates_share_everything_and_prefix_samples_fork_at_their_end():
    a = sample([1, 2, 3, 4], [0, 0, 1, 1])
    p = check_row(build_row([a, sample(a.input_ids, a.completion_mask, adv=-1.0),
                             sample([1, 2, 3], [0, 0, 1])]))
    assert p.unique_tokens == 5 and p.trained_tokens == 5      # [1 2] [3 4] + [3]: forks early


def test_a_trained_first_token_is_refused():
    with pytest.raises(ValueError, match="first token"):
        TreeRow().add(sample([1, 2], [1, 1]))


def run_planner(samples, world_size, budget, per_device=2):
    planner = Planner(world_size, budget, per_device)
    kept = [s for s in samples if not planner.oversize(s)]      # the trainer drops the rest
    batches = [b for b in map(planner.add, kept) if b is not None]
    tail = planner.flush()
    return planner, batches + ([tail] if tail else [])


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), world_size=st.integers(1, 4), budget=st.integers(6, 60))
def test_planner_invariants(seed, world_size, budget):
    samples = stream(seed, 8, 3, False)
    planner, batches = run_planner(samples, world_size, budget)
    seen = []
    for rows in batches:
        assert len(rows) == world_size and all(r.samples for r in rows)
        for r in rows:
            assert r.unique_tokens <= budget and r.trained_tokens <= budget
            seen += [id(s) for s in r.samples]
    oversize = [s for s in samples if len(s.input_ids) > budget or trained(s) > budget]
    assert [id(s) for s in samples if planner.oversize(s)] == list(map(id, oversize))
    assert len(seen) == len(set(seen))                           # nothing duplicated
    lost = len(samples) - len(oversize) - len(seen)              # a tail too small for every rank
    assert 0 <= lost < world_size


def test_planner_keeps_groups_together_and_splits_a_full_group():
    a = [sample([1, 2, 3, 10 + i, 20 + i], [0, 0, 0, 1, 1], group=0) for i in range(6)]
    b = [sample([4, 5, 6, 30 + i, 40 + i], [0, 0, 0, 1, 1], group=1) for i in range(6)]
    planner = Planner(world_size=2, token_budget=100, per_device_train_batch_size=1)
    assert all(planner.add(s) is None for pair in zip(a, b) for s in pair)
    rows = planner.flush()
    assert [{s.group_id for s in r.samples} for r in rows] == [{0}, {1}]
    # group 0 overflows its row (budget 14: 2 + 3·k unique tokens) into the empty row of rank 1
    planner = Planner(world_size=2, token_budget=14, per_device_train_batch_size=1)
    assert [planner.add(s) for s in a[:5]] == [None] * 5
    assert [len(r.samples) for r in planner.rows] == [4, 1]
    closed = planner.add(sample([7] * 11, [0] * 11, group=2))   # fits no row: the batch closes
    assert [len(r.samples) for r in closed] == [4, 1]
    assert [len(r.samples) for r in planner.rows] == [1, 0]
    # group 0 fills row 0 (budget 20, cost 75); row 1 holds group 1 (cost 15). A group-0 sample
    # may join row 1 only while row 1 stays within the busiest row's cost
    short = sample([1, 2, 3, 60, 61], [0, 0, 0, 1, 1])                   # 15 + 15 <= 75: joins
    long = sample([1, 2, 3] + list(range(50, 59)), [0, 0, 0] + [1] * 9) # 15 + 78 > 75: closes
    for extra, closes in ((short, False), (long, True)):
        planner = Planner(world_size=2, token_budget=20, per_device_train_batch_size=1)
        assert all(planner.add(s) is None for s in a + b[:1])
        assert [r.attention_cost for r in planner.rows] == [75, 15]
        closed = planner.add(extra)
        assert (closed is not None) == closes
        assert [len(r.samples) for r in closed or planner.rows] == [6, 1 if closes else 2]


def test_oversize_refused_and_flush_fills_every_rank():
    planner = Planner(world_size=3, token_budget=10, per_device_train_batch_size=1)
    big = sample(np.arange(11), np.r_[0, np.ones(10)])
    assert planner.oversize(big) and not planner.oversize(sample(np.arange(10), np.zeros(10)))
    with pytest.raises(ValueError, match="over token_budget=10"):
        planner.add(big)
    assert not planner.held()
    for i in range(3):                   # one group, one row: flush spreads it over the three ranks
        planner.add(sample([1, 2, 3 + i], [0, 1, 1]))
    assert [len(r.samples) for r in planner.rows] == [3, 0, 0]
    rows = planner.flush()
    assert [len(r.samples) for r in rows] == [1, 1, 1]
    planner.add(sample([1, 2], [0, 1]))
    assert planner.flush() is None       # one sample cannot feed three ranks


@pytest.mark.parametrize("budget", [64, 0])
def test_held_and_drop(budget):
    """held() lists the open micro-batch; drop(stale) removes those samples and repacks the rest."""
    planner = Planner(world_size=2, token_budget=budget, per_device_train_batch_size=4)
    samples = [sample([1, 2, 3 + i % 3, 9], [0, 0, 1, 1], group=i % 2, version=i % 2)
               for i in range(6)]
    assert all(planner.add(s) is None for s in samples)
    assert sorted(map(id, planner.held())) == sorted(map(id, samples))
    assert planner.drop(lambda s: s.model_version == 0) == 3
    assert sorted(map(id, planner.held())) == sorted(id(s) for s in samples[1::2])
    assert planner.drop(lambda s: False) == 0
    rows = planner.flush()
    assert sorted(id(s) for r in rows for s in r.samples) == sorted(id(s) for s in samples[1::2])
    for row in rows:
        check_row(row)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), world_size=st.integers(1, 4), per_device=st.integers(1, 4))
def test_fixed_count_mode(seed, world_size, per_device):
    samples = stream(seed, 10, 50, False)
    planner, batches = run_planner(samples, world_size, 0, per_device)
    per_batch = world_size * per_device
    full = len(samples) // per_batch
    assert all(sum(len(r.samples) for r in rows) == per_batch for rows in batches[:full])
    tail = len(samples) % per_batch
    lost = tail if tail < world_size else 0
    assert sum(len(r.samples) for rows in batches for r in rows) == len(samples) - lost
    for rows in batches:
        assert len(rows) == world_size and all(r.samples for r in rows)
        groups = [{s.group_id for s in r.samples} for r in rows]
        if len(set().union(*groups)) >= world_size:             # enough groups: none is split
            assert sum(len(g) for g in groups) == len(set().union(*groups))
        m = planner.metrics([r.pack() for r in rows])
        assert m["batch/packing_ratio"] >= 1 and m["batch/row_imbalance"] >= 1
        assert "batch/row_fill_frac" not in m
