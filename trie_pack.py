"""Tree packing: prefix-trie rows, the planner and the packed DFS layout (spec: ツリーパッキング
(Tree packing), バッチ番号の構成 (Batch composition); AsyncGRPOConfig: token_budget,
per_device_train_batch_size).

A row is what one DP rank forwards in one micro-batch. It is a prefix trie, not a concatenation:
tokens that several samples share are forwarded once, and attention shows each sample only its
own history. Two rollouts of one prompt, as in the spec:

    1. rollouts    r0: p1 p2 p3 a1 a2                        10 raw tokens
                   r1: p1 p2 p3 b1 b2

    2. trie        S0 [p1 p2] ─┬─ S1 [p3 a1 a2]   nodes are keyed on (token, next token), so
                               └─ S2 [p3 b1 b2]   the fork comes one token early and every node
                                                  predicts one token; a last token: (token, None)

    3. layout      idx           0  1 | 2  3  4 | 5  6  7    8 unique tokens
                   input_ids    p1 p2 | p3 a1 a2 | p3 b1 b2
                   position_ids  0  1 |  2  3  4 |  2  3  4    depth = position in every sample
                   cu_seqlens_q  0     2          5          8 segments (unary chains)
                   subtree_end   7  7 |  4  4  4 |  7  7  7    kv j visible to query i
                                                               iff j <= i <= subtree_end[j]
    4. K/V paths   S0  kv_index 0 1             cu_seqlens_k 0 2 7 12
                   S1  kv_index 0 1 2 3 4       root-to-segment paths, the segment's own tokens
                   S2  kv_index 0 1 5 6 7       last: a bottom-right causal mask is tree attention

    5. loss terms  token_index  2 3 | 5 6       targets a1 a2 | b1 b2 (one per trained token)
                   sample_ids   0 0 | 1 1       a shared position serves every sample training
                                                through it: idx 1 (p2) predicts p3 for both

    row = build_row([r0, r1])     # TreeRow: match → fits / added_cost → add, sample by sample
    packed = row.pack()           # PackedRow: the layout (3-4) and the loss terms (5)
    rows = Planner(world_size, token_budget, per_device_train_batch_size).add(sample)

Departures from the spec, one line each:
- flush() moves samples so no rank is empty (it would desync collectives); < world_size: dropped.
- A trained first token (completion_mask[0] == 1) has no position predicting it: add() refuses it.
- batch/row_fill_frac is not reported in fixed-count mode, where no token_budget exists.
"""
import bisect
import logging
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

# ── node names: one 64-bit hash per trie node ────────────────────────────────────────────────────

_END = np.uint64(2**64 - 1)         # the "next token" of a sample's last token
_BASE = np.uint64(0x9E3779B97F4A7C15)
_powers = np.ones(1, np.uint64)     # [n] _BASE ** i mod 2**64, a table grown on demand


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64, elementwise on uint64 (wraps mod 2**64); the increment keeps mix(0) != 0."""
    x = x + _BASE
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def node_keys(input_ids: np.ndarray) -> np.ndarray:
    """[L] uint64 names of a sample's trie nodes: key t hashes input_ids[:t+1] and the next token
    (END after the last), i.e. the (token, next) keys of node t's whole path.

    All L names come from one cumulative sum, key t = Σ_{i<=t+1} mix(ext_i)·BASE^i mod 2^64 over the
    tokens extended by END, so a sample is named in O(L) numpy work. Two paths may collide; TreeRow
    checks every hash hit against stored tokens, so a collision can cost sharing, never correctness.
    """
    global _powers
    n = len(input_ids) + 1
    if len(_powers) < n:
        m = max(n, 2 * len(_powers))
        _powers = np.ones(m, np.uint64)
        _powers[1:] = np.cumprod(np.full(m - 1, _BASE, np.uint64))
    ext = np.empty(n, np.uint64)                           # [L+1] tokens, then END
    ext[:-1] = input_ids
    ext[-1] = _END
    return np.cumsum(_mix(ext) * _powers[:n], dtype=np.uint64)[1:]


def _trained(sample) -> int:
    """Loss terms of a sample: trained tokens after the first (nothing predicts position 0)."""
    return int(np.count_nonzero(sample.completion_mask[1:]))


# ── records ──────────────────────────────────────────────────────────────────────────────────────

@dataclass
class PackedRow:
    """One row laid out for the forward.

    N unique tokens, S segments, K gathered K/V indices, M loss terms, k sampler top tokens.
    """
    # the layout (module docstring, steps 3-4)
    input_ids: torch.Tensor          # [N] int64   unique tokens in DFS pre-order
    position_ids: torch.Tensor       # [N] int64   depth in the trie
    subtree_end: torch.Tensor        # [N] int64   last DFS index of each token's subtree
    cu_seqlens_q: torch.Tensor       # [S+1] int32 segment boundaries in input_ids
    kv_index: torch.Tensor           # [K] int64   each segment's root-to-segment path, end to end
    cu_seqlens_k: torch.Tensor       # [S+1] int32 path boundaries in kv_index
    max_seqlen_q: int
    max_seqlen_k: int
    # the loss terms (step 5)
    token_index: torch.Tensor        # [M] int64   packed position that predicts each trained token
    targets: torch.Tensor            # [M] int64
    sampler_logprobs: torch.Tensor   # [M] float32
    advantages: torch.Tensor         # [M] float32
    sample_ids: torch.Tensor         # [M] int64   index of the sample in the row
    model_versions: torch.Tensor     # [M] int64   the policy version that sampled each token
    top_ids: torch.Tensor | None            # [M, k] int64   (-1 pads)
    top_logprobs: torch.Tensor | None       # [M, k] float32 (-inf pads)
    candidate_ids: torch.Tensor | None      # [C] int64      candidate sets laid end to end
    candidate_offsets: torch.Tensor | None  # [M+1] int64    (an empty set = the whole vocabulary)
    # counts for the batch/* metrics
    num_samples: int
    raw_tokens: int                  # Σ sample lengths
    unique_tokens: int               # N
    trained_tokens: int              # M
    masked_tokens: int               # forwarded tokens with completion_mask == 0 (every sample)
    attention_cost: int              # Σ (depth + 1) over tokens: attention score pairs


@dataclass
class Match:
    """Where a sample meets a row: found once by TreeRow.match, passed to fits, added_cost, add."""
    row: "TreeRow"
    row_nodes: int                   # the row's node count then; add() refuses a stale match
    keys: np.ndarray                 # [L] uint64 node_keys of the sample
    shared: int                      # the sample's first `shared` nodes are in the row already
    parent: tuple[int, int] | None   # (chain, position) of the last shared node, if any
    length: int                      # L
    trained: int                     # the sample's loss terms

    @property
    def novel(self) -> int:
        """Nodes that add() creates, as one new chain."""
        return self.length - self.shared


# ── the trie ─────────────────────────────────────────────────────────────────────────────────────

class TreeRow:
    """A prefix trie of samples; one DP rank's forward in one micro-batch.

    A sample that joins shares the longest prefix of nodes already there and brings the rest as one
    new *chain*, hung under its last shared node. Node ids are dense in insertion order: chain c
    holds ids chain_node0[c] .. + len - 1 at depths chain_start[c] .. under chain_parent[c].
    """

    def __init__(self):
        self.samples: list = []
        self.group_ids: set[int] = set()
        self.unique_tokens = 0
        self.raw_tokens = 0
        self.trained_tokens = 0
        self.attention_cost = 0
        self._keys = np.zeros(0, np.uint64)     # [nodes] node keys, sorted
        self._key_node = np.zeros(0, np.int64)  # [nodes] node id of each sorted key
        self._chain_sample: list[int] = []      # sample that created the chain
        self._chain_start: list[int] = []       # depth of its first node
        self._chain_node0: list[int] = []       # id of its first node
        self._chain_parent: list[tuple[int, int] | None] = []  # (chain, position) of the parent
        self._children: dict[int, list[tuple[int, int]]] = {}  # chain -> [(position, child chain)]
        self._sample_chain: list[int] = []      # chain whose path ends at the sample's last node

    # -- matching: which of a sample's nodes the row holds already

    def _exists(self, ids: np.ndarray, node: int, t: int) -> tuple[int, int] | None:
        """(chain, position) of `node` if it is this sample's node at depth t (token by token)."""
        c = bisect.bisect_right(self._chain_node0, node) - 1
        i = node - self._chain_node0[c]
        if self._chain_start[c] + i != t:
            return None
        other = self.samples[self._chain_sample[c]].input_ids
        nxt = ids[t + 1] if t + 1 < len(ids) else -1
        other_nxt = other[t + 1] if t + 1 < len(other) else -1
        same = nxt == other_nxt and np.array_equal(ids[:t + 1], other[:t + 1])
        return (c, i) if same else None

    def _lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n] whether each key names a node of the row (by hash only), and that node's id."""
        where = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
        return self._keys[where] == keys, self._key_node[where]

    def match(self, sample, keys: np.ndarray | None = None) -> Match:
        """How much of `sample` the row holds (keys: node_keys(sample.input_ids), if already known).

        Shared nodes are a prefix of the sample, so the sorted-key lookup (np.searchsorted)
        probes every 64th key, then the 64 keys of the first block that misses; the last hit is
        checked token by token. If that fails (a hash collision), a binary search checks each probe.
        """
        ids = sample.input_ids
        keys = node_keys(ids) if keys is None else keys
        shared, parent = 0, None
        if len(self._keys):
            hit, _ = self._lookup(keys[63::64])
            lo = 64 * (len(hit) if hit.all() else int(np.argmin(hit)))
            hit, _ = self._lookup(keys[lo: lo + 64])
            shared = lo + (len(hit) if hit.all() else int(np.argmin(hit)))
            if shared:
                node = int(self._lookup(keys[shared - 1: shared])[1][0])
                parent = self._exists(ids, node, shared - 1)
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
        return Match(self, len(self._keys), keys, shared, parent, len(ids), _trained(sample))

    def fits(self, match: Match, token_budget: int) -> bool:
        """The row's unique tokens and loss terms both stay within token_budget with the sample."""
        return (self.unique_tokens + match.novel <= token_budget
                and self.trained_tokens + match.trained <= token_budget)

    def added_cost(self, match: Match) -> int:
        """Attention cost the sample would add: Σ (depth + 1) over novel depths shared..L-1."""
        n, shared = match.length, match.shared
        return (n * (n + 1) - shared * (shared + 1)) // 2

    # -- growing the trie

    def add(self, sample, match: Match | None = None) -> None:
        """Add `sample`, its novel nodes as one new chain (match: this row's match() of it)."""
        if sample.completion_mask[0]:
            raise ValueError("RolloutSample.completion_mask[0] is set: "
                             "the first token has no position predicting it")
        if match is None:
            match = self.match(sample)
        elif match.row is not self or match.row_nodes != len(self._keys):
            raise ValueError("add() got a match of another row, or of this row before it grew")
        shared, parent = match.shared, match.parent
        s, n, novel = len(self.samples), match.length, match.novel
        self.attention_cost += self.added_cost(match)
        self.samples.append(sample)
        self.group_ids.add(sample.group_id)
        self.raw_tokens += n
        self.trained_tokens += match.trained
        if not novel:                        # a duplicate: it ends on an existing leaf
            self._sample_chain.append(parent[0])
            return
        chain = len(self._chain_sample)
        node0 = self.unique_tokens           # node ids are dense
        order = np.argsort(match.keys[shared:])                 # [novel] merge the new keys in
        new_keys = match.keys[shared:][order]
        at = np.searchsorted(self._keys, new_keys)
        self._keys = np.insert(self._keys, at, new_keys)
        self._key_node = np.insert(self._key_node, at, node0 + order)
        self._chain_sample.append(s)
        self._chain_start.append(shared)
        self._chain_node0.append(node0)
        self._chain_parent.append(parent)
        if parent is not None:
            self._children.setdefault(parent[0], []).append((parent[1], chain))
        self._sample_chain.append(chain)
        self.unique_tokens += novel

    # -- packing: the layout, then the loss terms

    def pack(self) -> PackedRow:
        """The row as the forward reads it: its DFS layout and its loss terms (module docstring)."""
        if not self.samples:
            raise ValueError("pack() of an empty TreeRow")
        layout, chain_path = self._layout()
        terms = self._loss_terms(chain_path)
        n = len(layout["input_ids"])
        trained = np.zeros(n, bool)     # packed tokens with completion_mask == 1 in some sample
        for s, smp in enumerate(self.samples):
            trained[chain_path[self._sample_chain[s]][np.flatnonzero(smp.completion_mask)]] = True
        return PackedRow(**layout, **terms, num_samples=len(self.samples),
                         raw_tokens=self.raw_tokens, unique_tokens=n,
                         trained_tokens=len(terms["token_index"]),
                         masked_tokens=n - int(trained.sum()), attention_cost=self.attention_cost)

    def _layout(self) -> tuple[dict, list[np.ndarray]]:
        """PackedRow's layout fields, and each chain's path: [depth of its end + 1] packed indices.

        In DFS pre-order a chain's nodes are contiguous, followed by the chains hung under it
        (deepest attach point first), so the row is laid out chain by chain with numpy slices:
        Python works per chain and per segment, numpy per token. A segment ends where a child chain
        hangs, or at the chain's end; its K/V path is its chain's path up to its last token.
        """
        num_chains = len(self._chain_sample)
        chain_len = [len(self.samples[self._chain_sample[c]].input_ids) - self._chain_start[c]
                     for c in range(num_chains)]
        order = []
        stack = [c for c in range(num_chains) if self._chain_parent[c] is None][::-1]
        while stack:                         # pre-order over chains: deepest attach point first
            c = stack.pop()
            order.append(c)
            kids = sorted(self._children.get(c, []), key=lambda pos_kid: -pos_kid[0])
            stack.extend(kid for _, kid in reversed(kids))
        subtree_size = list(chain_len)       # tokens in a chain's subtree
        for c in reversed(order):
            if self._chain_parent[c] is not None:
                subtree_size[self._chain_parent[c][0]] += subtree_size[c]

        id_parts, position_parts, subtree_end_parts = [], [], []
        segment_len, kv_parts = [], []
        chain_path: list = [None] * num_chains
        first = 0                                      # first packed index of chain c
        for c in order:
            start, n = self._chain_start[c], chain_len[c]
            ids = self.samples[self._chain_sample[c]].input_ids
            id_parts.append(ids[start:])
            position_parts.append(np.arange(start, start + n))
            kids = self._children.get(c, [])           # [(position, child chain)]
            below = np.zeros(n + 1, np.int64)          # [n+1] subtree tokens hung at each position
            for pos, kid in kids:
                below[pos] += subtree_size[kid]
            subtree_end_parts.append(first + n - 1 + np.cumsum(below[::-1])[::-1][:n])
            parent = self._chain_parent[c]
            own = np.arange(first, first + n)
            above = [] if parent is None else [chain_path[parent[0]][:start]]
            chain_path[c] = np.concatenate(above + [own])
            # a segment ends where child chains hang, or at the chain's end
            ends = sorted({pos for pos, _ in kids}) + [n - 1]
            segment_len += np.diff([-1] + ends).tolist()
            kv_parts += [chain_path[c][:start + end + 1] for end in ends]
            first += n
        kv_len = [len(p) for p in kv_parts]
        layout = dict(
            input_ids=_tensor(id_parts, np.int64),
            position_ids=_tensor(position_parts, np.int64),
            subtree_end=_tensor(subtree_end_parts, np.int64),
            cu_seqlens_q=_offsets(segment_len, np.int32),
            kv_index=_tensor(kv_parts, np.int64),
            cu_seqlens_k=_offsets(kv_len, np.int32),
            max_seqlen_q=int(max(segment_len)),
            max_seqlen_k=int(max(kv_len)),
        )
        return layout, chain_path

    def _loss_terms(self, chain_path: list[np.ndarray]) -> dict:
        """PackedRow's loss-term fields: one per trained token t >= 1 of each sample, in order.

        Token t is predicted at the packed index of the sample's node t-1: entry t-1 of the path of
        the chain the sample ends in. Its candidate set is its slice of the sample's candidate_ids.
        """
        has_top = self.samples[0].top_ids is not None
        has_candidates = self.samples[0].candidate_counts is not None
        token_index, targets, sampler_logprobs, advantages, sample_ids = [], [], [], [], []
        versions = []
        top_ids, top_logprobs, candidate_ids, candidate_counts = [], [], [], []
        for s, smp in enumerate(self.samples):
            if ((smp.top_ids is not None) != has_top
                    or (smp.candidate_counts is not None) != has_candidates):
                raise ValueError("samples in one row disagree on whether top_ids / candidate sets"
                                 " are present")
            trained = np.flatnonzero(smp.completion_mask[1:]) + 1       # [m] trained positions
            token_index.append(chain_path[self._sample_chain[s]][trained - 1])
            targets.append(smp.input_ids[trained])
            sampler_logprobs.append(smp.sampler_logprobs[trained])
            advantages.append(np.full(len(trained), smp.advantage, np.float32))
            sample_ids.append(np.full(len(trained), s, np.int64))
            versions.append(np.full(len(trained), smp.model_version, np.int64))
            if has_top:
                top_ids.append(smp.top_ids[trained])
                top_logprobs.append(smp.top_logprobs[trained])
            if has_candidates:
                counts = np.asarray(smp.candidate_counts, np.int64)     # [L]
                set_start = np.cumsum(counts) - counts                  # [L] where each set starts
                c = counts[trained]                                     # [m]
                gather = np.repeat(set_start[trained] - np.cumsum(c) + c, c) + np.arange(c.sum())
                candidate_ids.append(smp.candidate_ids[gather])
                candidate_counts.append(c)
        return dict(
            token_index=_tensor(token_index, np.int64),
            targets=_tensor(targets, np.int64),
            sampler_logprobs=_tensor(sampler_logprobs, np.float32),
            advantages=_tensor(advantages, np.float32),
            sample_ids=_tensor(sample_ids, np.int64),
            model_versions=_tensor(versions, np.int64),
            top_ids=_tensor(top_ids, np.int64) if has_top else None,
            top_logprobs=_tensor(top_logprobs, np.float32) if has_top else None,
            candidate_ids=_tensor(candidate_ids, np.int64) if has_candidates else None,
            candidate_offsets=(_offsets(np.concatenate(candidate_counts), np.int64)
                               if has_candidates else None),
        )


def _tensor(parts: list[np.ndarray], dtype) -> torch.Tensor:
    """One contiguous tensor of numpy parts laid end to end."""
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts), dtype=dtype))


def _offsets(lengths, dtype) -> torch.Tensor:
    """[n+1] boundaries of consecutive pieces of these lengths: 0, l0, l0+l1, ..."""
    return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(dtype))


def build_row(samples: list) -> TreeRow:
    """A row holding `samples`, added in order."""
    row = TreeRow()
    for s in samples:
        row.add(s)
    return row


# ── the planner ──────────────────────────────────────────────────────────────────────────────────

class Planner:
    """Streams samples into micro-batches of exactly world_size non-empty rows (one per DP rank).

        planner = Planner(world_size, token_budget, per_device_train_batch_size)
        for sample in stream:
            rows = planner.add(sample)       # list[TreeRow] when a micro-batch closes, else None
            ...
        rows = planner.flush()               # the last micro-batch at end of stream, or None

    token_budget > 0 bounds unique tokens and loss terms per row (the trainer passes the server's
    max_model_len when the config says None); token_budget <= 0 packs per_device_train_batch_size ×
    world_size samples per micro-batch instead (_balanced). A sample no row can hold (oversize())
    is refused: the trainer drops and counts it first (train.py's Feed). State is real: the open
    rows.
    """

    def __init__(self, world_size: int, token_budget: int, per_device_train_batch_size: int):
        self.world_size = world_size
        self.token_budget = token_budget
        self.samples_per_microbatch = per_device_train_batch_size * world_size
        self.rows = [TreeRow() for _ in range(world_size)]
        self.pending: list = []              # fixed-count mode: samples of the open micro-batch

    def oversize(self, sample) -> bool:
        """Over token_budget in tokens or loss terms: no row can hold the sample."""
        budget = self.token_budget
        return budget > 0 and (len(sample.input_ids) > budget or _trained(sample) > budget)

    def add(self, sample) -> list[TreeRow] | None:
        """Place one sample; returns the closed micro-batch (world_size rows) if it did not fit."""
        if self.token_budget <= 0:
            self.pending.append(sample)
            if len(self.pending) < self.samples_per_microbatch:
                return None
            closed, self.pending = self.pending, []
            return self._balanced(closed)
        if self.oversize(sample):
            raise ValueError(f"a sample of {len(sample.input_ids)} tokens ({_trained(sample)} "
                             f"trained) is over token_budget={self.token_budget}: no row can "
                             "hold it; drop it first (Planner.oversize)")
        placed = self._place(sample)
        closed = None
        if placed is None:
            closed, self.rows = self.rows, [TreeRow() for _ in range(self.world_size)]
            placed = self.rows[0], None
        row, match = placed
        row.add(sample, match)
        return closed

    def _place(self, sample) -> tuple[TreeRow, Match] | None:
        """The row the sample joins and its match there, or None: the micro-batch closes.

        1. the least-loaded (attention cost) row already holding its group_id that fits;
        2. else the least-loaded fitting row, if the group has no row yet, if that row is empty
           (some rank still has nothing), or if its cost with the sample stays within the busiest's;
        3. else None. All rows are then non-empty: an empty row fits any sample not oversize.
        The sample's node keys are computed once and each probed row matches it once.
        """
        keys = node_keys(sample.input_ids)          # [L]
        budget = self.token_budget

        def fitting(rows: list[TreeRow]) -> list[tuple[TreeRow, Match]]:
            matches = [(row, row.match(sample, keys)) for row in rows]
            return [(row, match) for row, match in matches if row.fits(match, budget)]

        def cost(row_match: tuple[TreeRow, Match]) -> int:
            return row_match[0].attention_cost

        home = [r for r in self.rows if sample.group_id in r.group_ids]
        at_home = fitting(home)
        if at_home:
            return min(at_home, key=cost)
        away = fitting([r for r in self.rows if r not in home])
        if not away:
            return None
        row, match = best = min(away, key=cost)
        if not home or not row.samples:
            return best
        busiest = max(r.attention_cost for r in self.rows)
        return best if row.attention_cost + row.added_cost(match) <= busiest else None

    def _balanced(self, samples: list) -> list[TreeRow]:
        """Fixed-count mode: whole groups to the least-loaded row, costliest group first; the
        largest group is halved until every rank has a part."""
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
        """The open micro-batch, every rank's row non-empty; None if fewer samples than ranks."""
        samples = self.held()
        self.pending = []                    # fixed-count mode's (always empty with a budget)
        rows, self.rows = self.rows, [TreeRow() for _ in range(self.world_size)]
        if len(samples) < self.world_size:
            if samples:
                log.warning("end of stream: %d samples cannot fill %d ranks; discarded",
                            len(samples), self.world_size)
            return None
        if self.token_budget <= 0:
            return self._balanced(samples)
        for i, row in enumerate(rows):       # an empty rank: the costliest row's last sample
            if not row.samples:
                j = max((j for j, r in enumerate(rows) if len(r.samples) > 1),
                        key=lambda j: rows[j].attention_cost)
                moved = rows[j].samples[-1]
                rows[j] = build_row(rows[j].samples[:-1])
                rows[i] = build_row([moved])
        return rows

    def held(self) -> list:
        """Samples in the open micro-batch, not yet handed to the trainer."""
        if self.token_budget <= 0:
            return list(self.pending)
        return [s for r in self.rows for s in r.samples]

    def drop(self, stale) -> int:
        """Remove the held samples for which stale(sample) is true (rows rebuilt); how many."""
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
        }
        if self.token_budget > 0:
            out["batch/row_fill_frac"] = float(tokens.mean() / self.token_budget)
        return out
