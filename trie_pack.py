"""Prefix-trie rows, the planner and the packed DFS layout (spec: ツリーパッキング, バッチ番号の構成, token_budget).

A row is what one DP rank forwards in one micro-batch. It is a prefix trie, not a concatenation:
tokens that several samples share are forwarded once, and attention shows each sample only its own
history. Two rollouts of one prompt, as in the spec:

    1. rollouts      r0: p1 p2 p3 a1 a2                                   10 raw tokens
                     r1: p1 p2 p3 b1 b2

    2. trie          S0 [p1 p2] ─┬─ S1 [p3 a1 a2]    nodes are keyed on (token, next token), so the fork
                                 └─ S2 [p3 b1 b2]    happens one token early and every node predicts
                                                     exactly one token; a last token is keyed (token, None)

    3. pack()        idx            0  1 | 2  3  4 | 5  6  7               8 unique tokens
                     input_ids     p1 p2 | p3 a1 a2 | p3 b1 b2
                     position_ids   0  1 |  2  3  4 |  2  3  4             depth = position in every sample
                     cu_seqlens_q   0     2          5          8          segments (unary chains)
                     subtree_end    7  7 |  4  4  4 |  7  7  7             kv j visible to query i iff
                                                                           j <= i <= subtree_end[j]
    4. K/V paths     S0  kv_index 0 1                 cu_seqlens_k 0 2 7 12
                     S1  kv_index 0 1 2 3 4           (root-to-segment path; the segment's own tokens last,
                     S2  kv_index 0 1 5 6 7            so a bottom-right causal mask is tree attention)

    5. loss terms    token_index  2 3 | 5 6           targets a1 a2 | b1 b2  (one per trained token)
                     sample_ids   0 0 | 1 1           a shared position serves every sample training
                                                      through it: idx 1 (p2) predicts p3 for both

How it is built. A sample that joins a row shares the longest prefix of nodes already there and
brings the rest as one new *chain* of nodes, hung under the last shared node. In DFS pre-order a
chain's nodes are contiguous, followed by the chains hung under it (deepest attach point first),
so pack() lays the row out chain by chain with numpy slices: Python works per chain and per
segment, numpy per token. Matching is vectorised too: node t of a sample is named by a 64-bit hash
of its tokens 0..t+1 (the (token, next) keys of its path), all computed by one cumulative sum, and
looked up in the row's sorted array of names (np.searchsorted); the last hit is then checked against
the stored tokens, so a hash collision can only cost sharing, never correctness.

Planner (`Planner`; state is real: the open rows). With token_budget > 0 a sample goes to the
least-loaded row already holding its group_id that fits; if those are full, to the least-loaded
fitting row when some rank's row is still empty or when that row's attention cost stays within the
busiest row's; otherwise the micro-batch closes (all rows are then non-empty, since an empty row
fits any sample that is not oversize). A sample of a group not yet in the micro-batch goes to the
least-loaded row that fits. With token_budget <= 0, per_device_train_batch_size × world_size samples
form a micro-batch, whole groups balanced across rows by attention cost (largest first).

Departures from the spec:
  * flush() (end of stream) moves samples from the fullest rows into empty ones so that every rank
    still gets a row; fewer pending samples than ranks cannot make a micro-batch (an empty rank would
    desync collectives) and are discarded with a warning.
  * masked_token_frac counts forwarded positions that carry no loss term (the spec words it as
    completion_mask == 0 tokens; positions are what the forward pays for, shifted by one).
  * A trained first token (completion_mask[0] == 1) has no position predicting it: add() refuses it.
  * batch/row_fill_frac is not reported in fixed-count mode, where no token_budget exists.
"""
import bisect
import logging
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

_END = np.uint64(2**64 - 1)         # the "next token" of a sample's last token
_BASE = np.uint64(0x9E3779B97F4A7C15)
_powers = np.ones(1, np.uint64)     # _BASE ** i mod 2**64, grown on demand


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64, elementwise on uint64 (wraps mod 2**64); the increment keeps mix(0) != 0."""
    x = x + _BASE
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_last_keys: tuple = (None, None)   # (input_ids, keys): the planner probes several rows with one sample


def node_keys(input_ids: np.ndarray) -> np.ndarray:
    """[L] uint64 names of a sample's trie nodes: key t hashes input_ids[:t+1] and the next token (or END)."""
    global _powers, _last_keys
    if _last_keys[0] is input_ids:
        return _last_keys[1]
    n = len(input_ids) + 1
    if len(_powers) < n:
        m = max(n, 2 * len(_powers))
        _powers = np.ones(m, np.uint64)
        _powers[1:] = np.cumprod(np.full(m - 1, _BASE, np.uint64))
    ext = np.empty(n, np.uint64)                           # [L+1] tokens, then END
    ext[:-1] = input_ids
    ext[-1] = _END
    keys = np.cumsum(_mix(ext) * _powers[:n], dtype=np.uint64)[1:]
    _last_keys = (input_ids, keys)
    return keys


def _trained(sample) -> int:
    return int(np.count_nonzero(sample.completion_mask[1:]))


@dataclass
class PackedRow:
    """One row laid out for the forward (N unique tokens, S segments, K gathered K/V, M loss terms)."""
    input_ids: torch.Tensor          # [N] int64   unique tokens in DFS pre-order
    position_ids: torch.Tensor       # [N] int64   depth in the trie
    subtree_end: torch.Tensor        # [N] int64   last DFS index of each token's subtree
    cu_seqlens_q: torch.Tensor       # [S+1] int32 segment boundaries in input_ids
    kv_index: torch.Tensor           # [K] int64   each segment's root-to-segment path, laid end to end
    cu_seqlens_k: torch.Tensor       # [S+1] int32 path boundaries in kv_index
    max_seqlen_q: int
    max_seqlen_k: int
    token_index: torch.Tensor        # [M] int64   packed position that predicts each trained token
    targets: torch.Tensor            # [M] int64
    sampler_logprobs: torch.Tensor   # [M] float32
    advantages: torch.Tensor         # [M] float32
    sample_ids: torch.Tensor         # [M] int64   index of the sample in the row
    top_ids: torch.Tensor | None            # [M, k] int64   (-1 pads)
    top_logprobs: torch.Tensor | None       # [M, k] float32 (-inf pads)
    candidate_ids: torch.Tensor | None      # [C] int64      candidate sets laid end to end
    candidate_offsets: torch.Tensor | None  # [M+1] int64    (an empty set = the whole vocabulary)
    num_samples: int
    raw_tokens: int                  # Σ sample lengths
    unique_tokens: int               # N
    trained_tokens: int              # M
    masked_tokens: int               # positions with no loss term
    attention_cost: int              # Σ (depth + 1) over tokens: attention score pairs


class TreeRow:
    """A prefix trie of samples; one DP rank's forward in one micro-batch.

    Node ids are dense in insertion order. Chain c holds the novel nodes of the sample that created it:
    ids chain_node0[c] .. + len - 1 at depths chain_start[c] .. ; it hangs under node chain_parent[c].
    """

    def __init__(self):
        self.samples: list = []
        self.group_ids: set[int] = set()
        self.unique_tokens = 0
        self.raw_tokens = 0
        self.trained_tokens = 0
        self.attention_cost = 0
        self._keys = np.zeros(0, np.uint64)    # [nodes] node keys, sorted
        self._key_node = np.zeros(0, np.int64) # [nodes] node id of each sorted key
        self._chain_sample: list[int] = []     # sample that created the chain
        self._chain_start: list[int] = []      # depth of its first node
        self._chain_node0: list[int] = []      # id of its first node
        self._chain_parent: list[tuple[int, int] | None] = []   # (chain, position in it) of the parent node
        self._children: dict[int, list[tuple[int, int]]] = {}   # chain -> [(position, child chain)]
        self._sample_chain: list[int] = []     # chain whose path prefix is the sample's path
        self._probe: tuple = (None, 0, None, None)   # (sample, shared, parent, node keys) of the last match

    def _exists(self, ids: np.ndarray, node: int, t: int) -> tuple[int, int] | None:
        """(chain, position) of `node` if it is this sample's node at depth t, checked token by token."""
        c = bisect.bisect_right(self._chain_node0, node) - 1
        i = node - self._chain_node0[c]
        if self._chain_start[c] + i != t:
            return None
        other = self.samples[self._chain_sample[c]].input_ids
        nxt = ids[t + 1] if t + 1 < len(ids) else -1
        other_nxt = other[t + 1] if t + 1 < len(other) else -1
        return (c, i) if nxt == other_nxt and np.array_equal(ids[:t + 1], other[:t + 1]) else None

    def _lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n] whether each key names a node of the row (by hash only), and that node's id."""
        where = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
        return self._keys[where] == keys, self._key_node[where]

    def _match(self, sample) -> tuple[int, tuple[int, int] | None]:
        """Shared node count and the (chain, position) of the last shared node.

        Shared nodes are a prefix of the sample, so the hash lookup probes every 64th key, then the
        64 keys of the first block that misses; the last hit is then checked token by token.
        """
        if self._probe[0] is sample:
            return self._probe[1], self._probe[2]
        ids, keys = sample.input_ids, node_keys(sample.input_ids)
        shared, parent = 0, None
        if len(self._keys):
            hit, _ = self._lookup(keys[63::64])
            lo = 64 * (len(hit) if hit.all() else int(np.argmin(hit)))
            hit, nodes = self._lookup(keys[lo: lo + 64])
            shared = lo + (len(hit) if hit.all() else int(np.argmin(hit)))
            if shared:
                parent = self._exists(ids, int(self._lookup(keys[shared - 1: shared])[1][0]), shared - 1)
            if shared and parent is None:    # a hash collision: binary search, checking every probe
                lo, hi = 0, shared - 1
                while lo < hi:               # invariant: nodes 0..lo-1 are shared, lo..hi maybe
                    mid = (lo + hi + 1) // 2
                    hit, nodes = self._lookup(keys[mid - 1: mid])
                    found = self._exists(ids, int(nodes[0]), mid - 1) if hit[0] else None
                    if found is None:
                        hi = mid - 1
                    else:
                        lo, parent = mid, found
                shared = lo
        self._probe = (sample, shared, parent, keys)
        return shared, parent

    def fits(self, sample, token_budget: int) -> bool:
        """Both the row's unique tokens and its loss terms stay within token_budget with this sample."""
        shared, _ = self._match(sample)
        novel = len(sample.input_ids) - shared
        return (self.unique_tokens + novel <= token_budget
                and self.trained_tokens + _trained(sample) <= token_budget)

    def added_cost(self, sample) -> int:
        """Attention cost this sample would add: Σ (depth + 1) over its novel nodes."""
        shared, _ = self._match(sample)
        n = len(sample.input_ids)
        return (n * (n + 1) - shared * (shared + 1)) // 2

    def add(self, sample) -> None:
        if sample.completion_mask[0]:
            raise ValueError("RolloutSample.completion_mask[0] is set: the first token has no position predicting it")
        shared, parent = self._match(sample)
        ids = sample.input_ids
        s, n, novel = len(self.samples), len(ids), len(ids) - shared
        self.attention_cost += self.added_cost(sample)
        self.samples.append(sample)
        self.group_ids.add(sample.group_id)
        self.raw_tokens += n
        self.trained_tokens += _trained(sample)
        if novel:
            c = len(self._chain_sample)
            node0 = self.unique_tokens                # node ids are dense
            order = np.argsort(self._probe[3][shared:])               # [novel] merge the new keys in
            new = self._probe[3][shared:][order]
            at = np.searchsorted(self._keys, new)
            self._keys = np.insert(self._keys, at, new)
            self._key_node = np.insert(self._key_node, at, node0 + order)
            self._chain_sample.append(s)
            self._chain_start.append(shared)
            self._chain_node0.append(node0)
            self._chain_parent.append(parent)
            if parent is not None:
                self._children.setdefault(parent[0], []).append((parent[1], c))
            self._sample_chain.append(c)
            self.unique_tokens += novel
        else:                                # a duplicate: it ends on an existing leaf
            self._sample_chain.append(parent[0])
        self._probe = (None, 0, None, None)

    def pack(self) -> PackedRow:
        """The DFS layout of the row and its loss terms (see the module docstring)."""
        if not self.samples:
            raise ValueError("pack() of an empty TreeRow")
        nch = len(self._chain_sample)
        lens = [len(self.samples[self._chain_sample[c]].input_ids) - self._chain_start[c] for c in range(nch)]
        kids = {c: [k for _, k in sorted(v, key=lambda pk: -pk[0])] for c, v in self._children.items()}
        order, stack = [], [c for c in range(nch) if self._chain_parent[c] is None][::-1]
        while stack:                         # pre-order over chains: deepest attach point first
            c = stack.pop()
            order.append(c)
            stack.extend(kids.get(c, [])[::-1])
        size = list(lens)                    # tokens in a chain's subtree
        for c in reversed(order):
            if self._chain_parent[c] is not None:
                size[self._chain_parent[c][0]] += size[c]
        off, o = [0] * nch, 0
        for c in order:
            off[c], o = o, o + lens[c]

        ids_parts, pos_parts, end_parts, path = [], [], [], [None] * nch
        seg_len, kv_parts = [], []
        for c in order:
            start, n, ids = self._chain_start[c], lens[c], self.samples[self._chain_sample[c]].input_ids
            ids_parts.append(ids[start:])
            pos_parts.append(np.arange(start, start + n))
            below = np.zeros(n + 1, np.int64)          # [n+1] subtree tokens hung at each position
            cuts = []
            for pos, k in sorted(self._children.get(c, [])):
                below[pos] += size[k]
                if not cuts or cuts[-1] != pos:
                    cuts.append(pos)
            end_parts.append(off[c] + n - 1 + np.cumsum(below[::-1])[::-1][:n])
            parent = self._chain_parent[c]
            own = np.arange(off[c], off[c] + n)
            path[c] = own if parent is None else np.concatenate([path[parent[0]][:start], own])
            prev = -1
            for e in cuts + [n - 1]:                   # a segment ends at a branch or the chain's end
                seg_len.append(e - prev)
                kv_parts.append(path[c][:start + e + 1])
                prev = e
        cu_q = np.concatenate([[0], np.cumsum(seg_len)]).astype(np.int32)
        kv_len = [len(p) for p in kv_parts]
        cu_k = np.concatenate([[0], np.cumsum(kv_len)]).astype(np.int32)
        input_ids = np.concatenate(ids_parts).astype(np.int64)

        tix, tgt, slp, adv, sid, tops, toplp, cand, ccount = [], [], [], [], [], [], [], [], []
        has_top = self.samples[0].top_ids is not None
        has_cand = self.samples[0].candidate_counts is not None
        for s, smp in enumerate(self.samples):
            if (smp.top_ids is not None) != has_top or (smp.candidate_counts is not None) != has_cand:
                raise ValueError("samples in one row disagree on whether top_ids / candidate sets are present")
            p = np.flatnonzero(smp.completion_mask[1:]) + 1    # [m] trained positions
            tix.append(path[self._sample_chain[s]][p - 1])
            tgt.append(smp.input_ids[p])
            slp.append(smp.sampler_logprobs[p])
            adv.append(np.full(len(p), smp.advantage, np.float32))
            sid.append(np.full(len(p), s, np.int64))
            if has_top:
                tops.append(smp.top_ids[p])
                toplp.append(smp.top_logprobs[p])
            if has_cand:
                counts = np.asarray(smp.candidate_counts, np.int64)
                first = np.cumsum(counts) - counts             # [L] where each position's set starts
                c = counts[p]
                cand.append(smp.candidate_ids[np.repeat(first[p] - np.cumsum(c) + c, c) + np.arange(c.sum())])
                ccount.append(c)
        token_index = np.concatenate(tix).astype(np.int64)
        t64 = lambda parts, dt: torch.from_numpy(np.ascontiguousarray(np.concatenate(parts), dtype=dt))
        return PackedRow(
            input_ids=torch.from_numpy(input_ids),
            position_ids=t64(pos_parts, np.int64),
            subtree_end=t64(end_parts, np.int64),
            cu_seqlens_q=torch.from_numpy(cu_q),
            kv_index=t64(kv_parts, np.int64),
            cu_seqlens_k=torch.from_numpy(cu_k),
            max_seqlen_q=int(max(seg_len)),
            max_seqlen_k=int(max(kv_len)),
            token_index=torch.from_numpy(token_index),
            targets=t64(tgt, np.int64),
            sampler_logprobs=t64(slp, np.float32),
            advantages=t64(adv, np.float32),
            sample_ids=t64(sid, np.int64),
            top_ids=t64(tops, np.int64) if has_top else None,
            top_logprobs=t64(toplp, np.float32) if has_top else None,
            candidate_ids=t64(cand, np.int64) if has_cand else None,
            candidate_offsets=torch.from_numpy(np.concatenate([[0], np.cumsum(np.concatenate(ccount))]).astype(np.int64))
            if has_cand else None,
            num_samples=len(self.samples),
            raw_tokens=self.raw_tokens,
            unique_tokens=len(input_ids),
            trained_tokens=len(token_index),
            masked_tokens=len(input_ids) - int(np.bincount(token_index, minlength=len(input_ids)).astype(bool).sum()),
            attention_cost=self.attention_cost,
        )


def build_row(samples: list) -> TreeRow:
    """A row holding `samples`, added in order."""
    row = TreeRow()
    for s in samples:
        row.add(s)
    return row


class Planner:
    """Streams samples into micro-batches of exactly world_size non-empty rows (one per DP rank).

        planner = Planner(world_size, token_budget, per_device_train_batch_size)
        for sample in stream:
            rows = planner.add(sample)       # list[TreeRow] when a micro-batch closes, else None
            ...
        rows = planner.flush()               # the last micro-batch at end of stream, or None

    token_budget > 0 bounds unique tokens and loss terms per row (the trainer passes the server's
    max_model_len when the config says None); token_budget <= 0 packs per_device_train_batch_size ×
    world_size samples per micro-batch instead.
    """

    def __init__(self, world_size: int, token_budget: int, per_device_train_batch_size: int):
        self.world_size = world_size
        self.token_budget = token_budget
        self.samples_per_microbatch = per_device_train_batch_size * world_size
        self.rows = [TreeRow() for _ in range(world_size)]
        self.pending: list = []              # fixed-count mode: samples of the open micro-batch
        self.dropped_oversize_total = 0

    def add(self, sample) -> list[TreeRow] | None:
        if self.token_budget <= 0:
            self.pending.append(sample)
            if len(self.pending) < self.samples_per_microbatch:
                return None
            closed, self.pending = self.pending, []
            return self._balanced(closed)
        if len(sample.input_ids) > self.token_budget or _trained(sample) > self.token_budget:
            self.dropped_oversize_total += 1
            log.warning("dropping a sample of %d tokens (%d trained): over token_budget=%d",
                        len(sample.input_ids), _trained(sample), self.token_budget)
            return None
        row, closed = self._place(sample), None
        if row is None:
            closed, self.rows = self.rows, [TreeRow() for _ in range(self.world_size)]
            row = self.rows[0]
        row.add(sample)
        return closed

    def _place(self, sample) -> TreeRow | None:
        budget, cost = self.token_budget, lambda r: r.attention_cost
        home = [r for r in self.rows if sample.group_id in r.group_ids]
        fitting = [r for r in home if r.fits(sample, budget)]
        if fitting:
            return min(fitting, key=cost)
        fitting = [r for r in self.rows if r not in home and r.fits(sample, budget)]
        if not fitting:
            return None
        best = min(fitting, key=cost)
        if not home or not best.samples:
            return best
        busiest = max(r.attention_cost for r in self.rows)
        return best if best.attention_cost + best.added_cost(sample) <= busiest else None

    def _balanced(self, samples: list) -> list[TreeRow]:
        """Whole groups to the least-loaded row, costliest group first; groups split until each rank has one."""
        groups: dict[int, list] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        parts = list(groups.values())
        while len(parts) < self.world_size:
            big = max(parts, key=len)
            parts.remove(big)
            parts += [big[: len(big) // 2], big[len(big) // 2:]]
        rows = [TreeRow() for _ in range(self.world_size)]
        for part in sorted(parts, key=lambda p: -build_row(p).attention_cost):
            row = min(rows, key=lambda r: r.attention_cost)
            for s in part:
                row.add(s)
        return rows

    def flush(self) -> list[TreeRow] | None:
        """The open micro-batch with every rank's row non-empty, or None if there are fewer samples than ranks."""
        if self.token_budget <= 0:
            samples, self.pending = self.pending, []
        else:
            samples = [s for r in self.rows for s in r.samples]
        rows, self.rows = self.rows, [TreeRow() for _ in range(self.world_size)]
        if len(samples) < self.world_size:
            if samples:
                log.warning("end of stream: %d samples cannot fill %d ranks; discarded", len(samples), self.world_size)
            return None
        if self.token_budget <= 0:
            return self._balanced(samples)
        for i, row in enumerate(rows):       # an empty rank takes the last sample of the costliest row
            if not row.samples:
                j = max((j for j, r in enumerate(rows) if len(r.samples) > 1), key=lambda j: rows[j].attention_cost)
                moved = rows[j].samples[-1]
                rows[j] = build_row(rows[j].samples[:-1])
                rows[i] = build_row([moved])
        return rows

    def held(self) -> list:
        """Samples in the open micro-batch, not yet handed to the trainer."""
        return list(self.pending) if self.token_budget <= 0 else [s for r in self.rows for s in r.samples]

    def drop(self, stale) -> int:
        """Remove the held samples for which stale(sample) is true (rows are rebuilt); returns how many."""
        keep = [s for s in self.held() if not stale(s)]
        dropped = len(self.held()) - len(keep)
        if dropped and self.token_budget <= 0:
            self.pending = keep
        elif dropped:
            self.rows = [build_row([s for s in r.samples if not stale(s)]) for r in self.rows]
        return dropped

    def metrics(self, packed: list[PackedRow]) -> dict[str, float]:
        """Spec batch/* metrics of one micro-batch (row metrics are means over its rows)."""
        tokens = np.array([p.unique_tokens for p in packed], np.float64)
        costs = np.array([p.attention_cost for p in packed], np.float64)
        out = {
            "batch/samples_per_row": float(np.mean([p.num_samples for p in packed])),
            "batch/row_tokens_mean": float(tokens.mean()),
            "batch/row_tokens_max": float(tokens.max()),
            "batch/row_imbalance": float(costs.max() / costs.mean()),
            "batch/packing_ratio": sum(p.raw_tokens for p in packed) / tokens.sum(),
            "batch/pad_frac": float(1 - tokens.sum() / (len(packed) * tokens.max())),
            "batch/masked_token_frac": sum(p.masked_tokens for p in packed) / tokens.sum(),
            "batch/dropped_oversize_total": float(self.dropped_oversize_total),
        }
        if self.token_budget > 0:
            out["batch/row_fill_frac"] = float(tokens.mean() / self.token_budget)
        return out
