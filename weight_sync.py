"""概要 (Overview: weight_sync_steps): the trainer's full weights into every vLLM server.

Spec: "weight_sync_steps 回の学習ステップごとに、更新された重みが NCCL を介して vLLM サーバーに転送され"
(every weight_sync_steps steps the updated weights go to the servers over NCCL); 記録されたメトリクス
(Logged metrics): perf/weight_sync_*. One sync, FullSync.push, in the order of vllm_api.md §6:

    rank 0                          servers (HTTP)                    every rank
    ──────                          ──────────────                    ──────────
    (once, at connect: every name and shape checked against the checkpoint each server loaded)
    POST /pause?mode=keep ────────► freeze the scheduler               ┐ perf/weight_sync_pause_s
    barrier ◄───────────────────────────────────────────────────────── ┘ perf/weight_sync_barrier_s
    POST /start_weight_update ────► ready to receive                   ┐ perf/weight_sync_start_s
    POST /update_weights (thread) ► blocks inside the collective       ┘
    for each parameter, in order:                                      ┐ perf/weight_sync_transfer_s
        full_tensor(p): all-gather the FSDP2 shards ◄───────────────── │ (every rank gathers)
        cast to the server dtype (rank 0: fingerprint those verified)  │
        bucket > packed_buffer_size_bytes → broadcast(bucket) ───────► │ receive, load by HF name
    join the thread ◄──────────────── "Weights updated"                ┘
    POST /finish_weight_update {"weight_version": "N"} ► reload ends    perf/weight_sync_finish_s
    verify: POST /collective_rpc ───► each server's fingerprints        sync/verify_s (verify_sync)
    POST /reset_prefix_cache ───────► no KV of the old weights is kept (vLLM 0.33: not by /pause)
    POST /resume  (every path; after a failure over fresh connections,   perf/weight_sync_resume_s
                   confirmed by /is_paused)
    (rank 0) the probe ─────────────► 8 tokens    then settle(), before the next optimizer step:
                                                  the policy scores them: sync/probe_kl per server

Only one bucket (buckets()) is held at a time, never the whole model. Learned from real vLLM 0.32
(docs/vllm_cpu.md): a refused update leaves its model on the meta device and the next forward
kills the engine, so nothing is sent that the server could refuse; uvicorn closes a connection
after a 500, so the closing /resume never reuses a pooled one.

Replicas can die (Members): one that fails a call and /health is taken out and the group re-formed
over the rest (one that dies mid-transfer: the sync is sent once more); back on /health, it rejoins.
A server whose fingerprints differ from what was sent is named with the tensor and both and taken
out the same way (resumed, sent the weights again at the next sync); if it was the last, the sync
raises. lora_sync.MergedSync, a FullSync, sends W + s·B·A.

Departures from the spec, one line each:
- On a CPU both ends form a torch.distributed gloo group (local_vllm, or vLLM with vllm_plugin/).
- A vision-language model syncs only its language model: the vision tower is frozen (train.py).
"""
import importlib.util
import logging
import math
import socket
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from config import dtype_name
from verify_sync import (ENABLE, PROBE_TOKENS, Fingerprints, Probe, base_card,
                         cannot_show, check_served, check_vocab, chosen, dtype_warning, mismatches,
                         served_dtype, policy_logprobs, probe_prompt, served_digests,
                         served_logprobs)
from vllm_client import UNVERIFIED, VLLMClient, VLLMError

log = logging.getLogger(__name__)

PACKED_BUFFER_BYTES = 1 << 30     # vLLM's default packed_buffer_size_bytes
FAILED = "weight sync failed"     # how every rank's error begins when a phase of a sync fails


@dataclass
class SyncStats:
    """perf/weight_sync_* (seconds; bytes sent by rank 0) and sync/* (ours) of one sync."""
    s: float = 0.0                # perf/weight_sync_s: the whole sync
    pause_s: float = 0.0          # pausing every server
    barrier_s: float = 0.0        # waiting for every rank
    start_s: float = 0.0          # opening the update: /start_weight_update, posting the receive
    transfer_s: float = 0.0       # gathering and sending the tensors (or the adapter's load)
    finish_s: float = 0.0         # /finish_weight_update: the servers' reload ends
    resume_s: float = 0.0         # /resume, every server
    bytes: int = 0                # what rank 0 sent: the tensors' bytes, or the adapter file's
    verify_s: float = 0.0         # sync/verify_s: proving it landed (fingerprints; an adapter's
                                  # probe)
    verified_tensors: int = 0     # sync/verified_tensors: each verifiable server showed as sent

    def metrics(self) -> dict[str, float]:
        return {("sync/" if k.startswith("verif") else "perf/weight_sync_") + k: float(v)
                for k, v in vars(self).items()}


# ── what a sync sends ───────────────────────────────────────────────────────────────────────


def language_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(HF name, parameter) of the text decoder and LM head, in model order: what a sync sends (a
    vision tower stays as the server loaded it). Tied weights appear once."""
    modules = (model.get_decoder(), model.get_output_embeddings())
    ids = {id(p) for m in modules for p in m.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) in ids]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard, detached; a plain tensor as it is. For a shard this is an
    all-gather: every rank must call it, in the same order."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def embedding_names(model) -> set[str]:
    """The names of the input embedding's and the LM head's weights (one name when tied): every
    sync verifies them (verify_sync.chosen)."""
    ends = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return {name for name, p in model.named_parameters() if id(p) in ends}


class FullSync:
    """The sync of a model without LoRA: every sync sends the language model's full weights,
    verified by fingerprints, then probed (the parity figure, `parity`: sync/probe_kl).

        sync = FullSync(policy, clients, config)   # every rank
        sync.connect()                             # rank 0 joins the servers
        metrics = sync.push(version)               # every rank, each sync: perf/weight_sync_*
    """

    def __init__(self, policy, clients: list[VLLMClient], config):
        self.policy = policy
        self.weights = WeightSync(clients, config.vllm_server_timeout)
        self.every = config.weight_sync_verify_every             # 0: no verification, no probe
        self.always = embedding_names(policy.model)              # verified at every sync
        self.pushes = 0                                          # the first verifies every tensor
        self.showing: set[str] = set()       # rank 0: the URLs that show their fingerprints
        self.unreadable: set[str] = set()    # rank 0: URLs whose unreadable tensors were said
        self.parity: dict[str, float] = {}   # sync/probe_kl of the last sync, logged every step
        self.worker_kwargs: dict = {}        # RolloutWorker's: rollouts ask for the base card
        self.asked = False                   # every rank: a probe waits to be scored (settle)
        self.asking = None                   # rank 0: its request, in flight ...
        self.prober = ThreadPoolExecutor(1)  # ... on this thread, one at a time

    def specs(self) -> list[tuple[str, torch.Size]]:
        """(name, shape) of what every sync sends, in order: the server's names."""
        return [(name, p.shape) for name, p in language_parameters(self.policy.model)]

    def tensors(self) -> Iterator[torch.Tensor]:
        """What every sync sends, whole, in specs() order (every rank: the all-gathers)."""
        return (full_tensor(p) for _, p in language_parameters(self.policy.model))

    def connect(self) -> None:
        """Rank 0: join the servers (WeightSync.connect); say once which cannot show what they
        hold, and how to enable it."""
        self.weights.connect(self.specs())
        for c in self.weights.members.clients if self.weights.rank == 0 and self.every else []:
            if why := cannot_show(c):
                log.warning("weight sync: %s cannot show the weights it holds (%s), so syncs to it "
                            "are not verified; %s", c.base_url, why, ENABLE)
            else:
                self.showing.add(c.base_url)

    def start(self, version: int) -> None:
        """Every rank, before generation starts: a long-lived server holds whatever the last run
        sent it, so this run's weights are sent, and the first push verifies every tensor."""
        self.push(version)

    def close(self) -> None:
        """The probe's thread ends (a request in flight is bounded: Members.call); the servers
        keep the last weights sent."""
        self.prober.shutdown(wait=False, cancel_futures=True)

    def push(self, version: int, probe_after: bool = True) -> dict[str, float]:
        """Every rank: send, verify (rank 0, between finish and resume: _verify); the probe is
        asked as the servers resume (settle scores it)."""
        specs = self.specs()
        names = chosen([n for n, _ in specs], version, self.every, self.always, self.pushes == 0)
        check = Fingerprints(set(names) if self.showing else set())     # empty off rank 0
        w = self.weights
        stats = w.push(specs, lambda: check.record(specs, self.tensors(), w.device, w.dtype),
                       version, lambda: self._verify(check, version))
        self.pushes += 1
        if probe_after and self.every and w.rank == 0:   # asked now, scored in settle()
            self.asking = self.prober.submit(ask, self.policy, w.members, base_card)
        self.asked = probe_after and self.every > 0
        stats.verify_s += check.seconds
        return stats.metrics()

    def settle(self) -> None:
        """Every rank, before the weights change again (train.py: before each step): the last
        sync's probe, asked when the servers resumed, scored by the policy (the parity figure),
        so its generation never holds up a step."""
        if self.asked:
            self.asked = False
            found = on_rank0(lambda: self.asking.result(), FAILED)   # bounded: Members.call
            self.parity = parity(probe(self.policy, found), self.weights.members.clients)

    def _verify(self, check: Fingerprints, version: int) -> int:
        """Rank 0, after /finish_weight_update and before /resume: every live server that can
        shows the fingerprints of the tensors `check` sent; one that holds other bytes is named
        with the tensors and both fingerprints, taken out (Members) and resumed, since rollouts
        may still reach it; if it was the last one, the sync raises. Tensors a server cannot read
        back exactly are said once and not counted. Returns the tensors every server verified."""
        if not check.sent:
            return 0
        asked = list(check.sent)
        shown = self.weights.members.call(lambda c: served_digests(c, asked), only=self.showing)
        bad, verified = [], []
        for c, (served, excluded) in shown.items():
            if excluded and c.base_url not in self.unreadable:
                self.unreadable.add(c.base_url)
                log.warning("weight sync: %s cannot read back %d tensor(s) exactly, which are "
                            "not verified: %s", c.base_url, len(excluded), excluded)
            if wrong := mismatches(check.sent, served, excluded):
                bad.append((c, f"it holds other bytes than were sent in {len(wrong)} of "
                               f"{len(asked)} verified tensors: {'; '.join(wrong[:3])}"))
            else:
                verified.append(len(asked) - len(excluded))
        self.weights.members.take_out_failed(bad, "failed the sync's verification",
                                             f"weight sync to version {version} did not land "
                                             "as sent")
        for c, _ in bad:
            _attempt(lambda: c.update_weight_version(f"{UNVERIFIED}{version}"))  # out of routing
            if still := c.resume_confirmed():      # out of the syncs, not left paused
                log.warning("weight sync: %s", still)
        return min(verified, default=0)


# ── the probe: what each server's log-probs say (verify_sync measures, this gathers) ──────────


def ask(policy, members: "Members", model_of: Callable[[VLLMClient], str],
        only: set[str] | None = None, tokens: int = PROBE_TOKENS) -> list[tuple]:
    """Rank 0: (url, tokens, their log-probs) of the probe each live server of `members` (in
    `only`, if given) samples under model_of(server), asked in parallel, in the servers' order."""
    prompt = probe_prompt(policy.model.get_input_embeddings().num_embeddings)
    found = members.call(lambda c: served_logprobs(c, model_of(c), prompt, tokens), only=only)
    return [(c.base_url, *reply) for c, reply in found.items()]


def probe(policy, asked, under=None, others: dict | None = None) -> list[Probe]:
    """Every rank: rank 0's `asked` (ask's; None elsewhere) scored by the policy, under the
    context `under()` if given (e.g. the adapter as zeros: the base), and under each of `others`
    (what → a context: a failed delivery). The findings, on every rank."""
    prompt = probe_prompt(policy.model.get_input_embeddings().num_embeddings)
    asked = shared(asked)
    sequences = [(prompt, tokens) for _, tokens, _ in asked]
    if not sequences:
        return []
    with (under or nullcontext)():
        ours = policy_logprobs(policy, sequences)
    theirs = {}
    for what, context in (others or {}).items():
        with context():
            theirs[what] = policy_logprobs(policy, sequences)
    return [Probe(url, torch.tensor(served), ours[i], {w: t[i] for w, t in theirs.items()})
            for i, (url, _, served) in enumerate(asked)]


def parity(probes: list[Probe], clients: list[VLLMClient]) -> dict[str, float]:
    """sync/probe_kl (ours): the largest probe KL, and with several servers each one's as
    sync/probe_kl/<its index in vllm_server_base_url>."""
    if not probes:
        return {}
    out = {"sync/probe_kl": max(p.kl for p in probes)}
    if len(clients) > 1:
        index = {c.base_url: i for i, c in enumerate(clients)}
        out |= {f"sync/probe_kl/{index[p.url]}": p.kl for p in probes}
    return out


# ── at start: what the servers must be started with, and a pause a dead run left ──────────────


def transfer_flags() -> str:
    """The server flags full sync needs, with the backend this trainer's hardware can use."""
    flags = "`--weight-transfer-config '{{\"backend\":\"{}\"}}'` and VLLM_SERVER_DEV_MODE=1"
    if torch.cuda.is_available():
        return flags.format("nccl")
    # no vLLM backend runs without CUDA: ours (vllm_plugin/, tools/vllm_cpu_venv.sh)
    return flags.format("gloo") + (" (vLLM on a CPU: `bash tools/vllm_cpu_venv.sh DIR` makes an "
                                   "environment with our gloo backend)")


def resume_leftover_pause(client) -> None:
    """Resume a server that is paused before this run paused it, with a warning.
    A run killed between /pause and /resume (SIGKILL, OOM, a lost node) leaves its servers paused:
    in keep mode every request waits, forever, including this run's first one. A server without
    the RL routes (no VLLM_SERVER_DEV_MODE: a LoRA-only run's) cannot have been paused by a run."""
    try:
        if not client.is_paused():
            return
    except VLLMError as e:
        if e.status == 404:
            return
        raise
    log.warning("the vLLM server at %s was paused before this run started (a run that stopped "
                "during a weight sync leaves it so): resuming it", client.base_url)
    client.resume()


def check_servers(clients, config, tokenizer, device) -> None:
    """Rank 0, at start: a server a dead run left paused is resumed (a warning); the served
    vocabulary must hold the trained tokenizer's (an error, verify_sync.check_vocab); the served
    dtype should be the trainer's compute dtype (a warning, spec: dtype). Each check costs at
    most one 1-token request."""
    for c in clients:
        resume_leftover_pause(c)
        check_vocab(c, tokenizer)
        try:
            info = c.server_info()
        except VLLMError:                       # no dev mode: weight sync says what is missing
            continue
        if why := dtype_warning(c.base_url, info, config.compute_dtype(device)):
            log.warning(why)


# ── the transfer ────────────────────────────────────────────────────────────────────────────


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_ip(server_url: str) -> str:
    """An address of this host that the server can reach (the route the OS picks towards it)."""
    host = urllib.parse.urlsplit(server_url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(host), 9))     # UDP connect sends nothing
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def buckets(sizes: list[int], buffer_bytes: int) -> list[range]:
    """vLLM's packed chunking: a bucket closes right after its running total first exceeds the
    buffer, so it may overshoot by its last tensor. vLLM's consumer recomputes the same boundaries
    from the declared names, dtypes and shapes. Worked: a 100-byte buffer and tensors of 40, 40, 80
    and 16 bytes: running totals 40, 80, then 160 > 100 closes [40 40 80]; [16] is the last bucket.

    >>> buckets([40, 40, 80, 16], 100)
    [range(0, 3), range(3, 4)]
    """
    out = []
    start = 0
    total = 0
    for i, n in enumerate(sizes):
        total += n
        if total > buffer_bytes:
            out.append(range(start, i + 1))
            start = i + 1
            total = 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


# ── rank 0 acts, every rank raises together ─────────────────────────────────────────────────


def agree(error: BaseException | None, failed: str | None = None, lost: bool = False) -> None:
    """One collective: rank 0's failure (`error`, or None; the other ranks pass None) reaches
    every rank, and all raise together, or none does, so no rank is left waiting in a collective
    for one that left. With `failed`, every rank raises RuntimeError("<failed>: <the error>"), or
    _Lost where rank 0 says `lost`; without, rank 0 raises the error itself and the others a
    RuntimeError("rank 0 stopped: <the error>")."""
    message = [None if error is None else f"{type(error).__name__}: {error}", lost]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(message, src=0)
    said, lost = message
    if said is None:
        return
    if failed is not None:
        raise (_Lost if lost else RuntimeError)(f"{failed}: {said}") from error
    if error is not None:
        raise error
    raise RuntimeError(f"rank 0 stopped: {said}")


def on_rank0(fn: Callable[[], object], failed: str | None = None):
    """fn() on rank 0, and its failure (or none) raised on every rank together (agree, with
    `failed`); its value on rank 0, None on the others."""
    value, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            value = fn()
        except Exception as e:                  # noqa: BLE001 (raised by agree, on every rank)
            error = e
    agree(error, failed)
    return value


def shared(value):
    """Rank 0's `value` on every rank (a picklable object; the other ranks pass anything)."""
    box = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


class WeightSync:
    """The trainer's end of the weight-transfer group (state is real: the group joined once).

        sync = WeightSync(clients, timeout=config.vllm_server_timeout)   # every rank
        sync.connect(specs)                                               # rank 0 joins the servers
        stats = sync.push(specs, tensors, version, verify)                # every rank, each sync
    """

    def __init__(self, clients: list[VLLMClient], timeout: float,
                 buffer_bytes: int = PACKED_BUFFER_BYTES):
        self.members = Members(clients, timeout, "weight sync")   # replicas that can die
        self.timeout = timeout                       # vllm_server_timeout: every call and the group
        self.buffer_bytes = buffer_bytes             # packed_buffer_size_bytes
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = None           # rank 0: the group with the servers' workers
        self.grouped: list[VLLMClient] = []   # rank 0: the servers in that group
        self.paused: list[VLLMClient] = []    # rank 0: the servers this sync paused
        self.backend = "gloo"
        self.vllm_group = False     # joined through vLLM's helpers (real vLLM, NCCL)
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # the servers' dtype: what is sent

    def connect(self, specs: list[tuple[str, torch.Size]] | None = None) -> None:
        """Rank 0: read every server's config, check `specs` (the names and shapes every sync
        will send) against what it serves, then join one group with all their workers."""
        if self.rank != 0:
            return
        infos = {c.base_url: c.server_info() for c in self.members.clients}
        if bad := [url for url, i in infos.items() if not i.get("weight_transfer_config")]:
            raise ValueError(f"the vLLM server(s) {bad} have no weight transfer: restart them "
                             f"with {transfer_flags()}")
        for url, info in infos.items() if specs is not None else ():
            check_served(specs, info["model_config"]["model"], url)
        backends = {i["weight_transfer_config"]["backend"] for i in infos.values()}
        dtypes = {served_dtype(i) for i in infos.values()}
        for what, found in (("weight-transfer backends", backends), ("dtypes", dtypes)):
            if len(found) > 1:
                raise ValueError(f"the servers use different {what} {sorted(found)}")
        self.backend = backends.pop()
        self.dtype = getattr(torch, dtypes.pop())
        self.vllm_group = self.backend == "nccl" and importlib.util.find_spec("vllm") is not None
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._regroup()

    def _regroup(self) -> None:
        """Rank 0: one group with the workers of every live server (at connect, and after a
        server left or came back). The trainer is rank 0; replica i's workers start at
        rank_offset 1 + the sizes (GET /get_world_size) of the live replicas before it."""
        live = self.members.live
        sizes = [c.world_size(include_dp=True) for c in live]
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        info = {"master_address": host_ip(live[0].base_url), "master_port": free_port(),
                "world_size": 1 + sum(sizes), "packed": True,
                "packed_buffer_size_bytes": self.buffer_bytes, "packed_num_buffers": 2}
        self.group = None                  # the old group's sockets close: no server waits on it
        with ThreadPoolExecutor(len(live)) as pool:
            joins = [pool.submit(c.init_weight_transfer_engine, info | {"rank_offset": offset})
                     for c, offset in zip(live, offsets)]
            self.group = self._join(info)
            for c, j in zip(live, joins):
                _result(j, self.timeout, f"joining the weight-transfer group of {c.base_url}")
        self.grouped = live

    def _join(self, info: dict):
        """Rank 0's side of the rendezvous. Real vLLM (NCCL, vllm importable): vLLM's own
        nccl_common.trainer_init and packed producer. local_vllm and our gloo plugin: both ends
        make a torch.distributed group from the same init_info over a TCPStore that rank 0 owns
        (gloo on CPU, NCCL where vllm is not installed), created with the vllm_server_timeout.
        The store and gloo listen on master_address only, the address the servers reach: for
        a local server, loopback (TCPStore alone listens on every interface: it is handed a
        socket bound here, master_listen_fd)."""
        if self.vllm_group:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
            return trainer_init(info | {"rank_offset": 0})
        timeout = timedelta(seconds=self.timeout)
        address = info["master_address"]
        listener = socket.create_server((address, info["master_port"]))
        store = dist.TCPStore(address, info["master_port"], info["world_size"], is_master=True,
                              timeout=timeout, master_listen_fd=listener.detach())
        store = dist.PrefixStore("weight_transfer", store)
        if self.backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
            return dist.ProcessGroupGloo(store, 0, info["world_size"], options)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, 0, info["world_size"], options)

    def push(self, specs: list[tuple[str, torch.Size]],
             tensors: Callable[[], Iterator[torch.Tensor]], version: int,
             verify: Callable[[], int] | None = None) -> SyncStats:
        """Send the tensors as `specs` names and shapes, in that order, and publish `version`.
        Every rank calls it and iterates `tensors()` (FSDP2's gathers are collectives); rank 0
        talks to the servers. Each phase ends in one agreement (agree: rank 0's error reaches
        every rank and all raise together), so no rank is left waiting in a collective. A server
        that died mid-transfer is taken out and the transfer sent once more, to the others. After
        /finish_weight_update, `verify()` (rank 0; the tensors it verified) and the prefix-cache
        reset; then /resume. On any failure the servers are resumed before the error is raised."""
        stats = SyncStats()
        start = time.perf_counter()
        try:
            error = _attempt(self._pause) if self.rank == 0 else None
            stats.pause_s = time.perf_counter() - start
            t = time.perf_counter()
            agree(error, FAILED)            # every rank waits for rank 0's pause: the barrier
            stats.barrier_s = time.perf_counter() - t
            t = time.perf_counter()
            try:
                stats.bytes, stats.start_s = self._transfer(specs, tensors, resend=False)
            except _Lost:                   # a server died mid-transfer: once more, to the others
                stats.bytes, stats.start_s = self._transfer(specs, tensors, resend=True)
            stats.transfer_s = time.perf_counter() - t - stats.start_s
            t = time.perf_counter()
            on_rank0(lambda: self.members.call(lambda c: c.finish_weight_update(str(version))),
                     FAILED)
            stats.finish_s = time.perf_counter() - t
            t = time.perf_counter()
            stats.verified_tensors = on_rank0(verify or (lambda: 0), FAILED) or 0
            stats.verify_s = time.perf_counter() - t
            on_rank0(lambda: self.members.call(lambda c: c.reset_prefix_cache()), FAILED)
        except Exception as e:
            if self.rank == 0:
                still = [why for c in self.paused if (why := c.resume_confirmed())]
                if still:
                    raise RuntimeError(f"{e}; {'; '.join(still)}") from e
            raise
        t = time.perf_counter()
        if self.rank == 0 and _attempt(lambda: self.members.call(lambda c: c.resume())):
            still = [why for c in self.members.live if (why := c.resume_confirmed())]
            if still:
                raise RuntimeError(f"weight sync to version {version} landed, but "
                                   f"{'; '.join(still)}")
        stats.resume_s = time.perf_counter() - t
        stats.s = time.perf_counter() - start
        return stats

    def _pause(self) -> None:
        """Rank 0: pause every live server (and those back since the last sync: Members); one
        that stopped answering is taken out. A server left or came back: re-form the group. The
        caches are reset after the update (/reset_prefix_cache), not by /pause: vLLM 0.33 ignores
        clear_cache in keep mode."""
        self.members.returning()
        self.paused = self.members.live     # resumed whatever happens (one dead since: named)
        self.members.call(lambda c: c.pause(mode="keep", clear_cache=False))
        if self.grouped != self.members.live:
            self._regroup()

    def _transfer(self, specs, tensors, resend: bool) -> tuple[int, float]:
        """Every rank gathers every tensor; rank 0 first opens the update on every server
        (_begin), then broadcasts the buckets while they receive. A failure while sending stops
        the sending, never the gathering; the agreement at the end raises it on every rank: as
        _Lost when it took a dead server out and others are left (not on a resend). Returns
        (bytes sent, seconds opening the update)."""
        start = time.perf_counter()
        # rank 0: each server's POST /update_weights, receiving (the other ranks: None)
        update = on_rank0(lambda: self._begin(specs, resend), FAILED)
        start_s = time.perf_counter() - start
        error, sent = None, 0
        sizes = [math.prod(shape) * self.dtype.itemsize for _, shape in specs]
        it = iter(tensors())
        for chunk in buckets(sizes, self.buffer_bytes):
            parts = [next(it).to(self.device, self.dtype).contiguous() for _ in chunk]  # all ranks
            if self.rank == 0 and error is None:
                flat = torch.cat([p.view(-1).view(torch.uint8) for p in parts])  # [Σ bytes] uint8
                error = _attempt(lambda: self._broadcast(flat, update))
                sent += flat.numel()
        lost = False
        if self.rank == 0:
            for c, u in zip(self.grouped, update):      # a server's own error comes first
                what = f"POST {c.base_url}/update_weights"
                error = _attempt(lambda: _result(u, self.timeout, what)) or error
            lost = error is not None and not resend and self._take_out_dead()
        agree(error, FAILED, lost)
        return sent, start_s

    def _begin(self, specs, resend: bool) -> list:
        """Rank 0: open the update on every live server (begin_update), re-form the group if one
        stopped answering just now, and post each one's /update_weights, which blocks inside the
        receive (so each in a thread of its own): their futures."""
        self.members.call(lambda c: begin_update(c, resend))
        if self.grouped != self.members.live:
            self._regroup()
        info = {"names": [n for n, _ in specs],
                "dtype_names": [dtype_name(self.dtype)] * len(specs),
                "shapes": [list(s) for _, s in specs]}
        pool = ThreadPoolExecutor(len(self.grouped))
        update = [pool.submit(c.update_weights, info) for c in self.grouped]
        pool.shutdown(wait=False)           # the posts run on; their futures still resolve
        return update

    def _take_out_dead(self) -> bool:
        """Rank 0, after a failed transfer: take out every server of the group that fails
        /health; whether any was and some are left."""
        dead = [c for c in self.grouped if not c.healthy()]
        for c in dead:
            self.members.take_out(c, "it stopped answering during the weight transfer")
        return bool(dead) and bool(self.members.live)

    def _broadcast(self, flat: torch.Tensor, update: list) -> None:
        """Send one bucket and wait for it, polling: a server that refused the update (its POST
        already failed) or stopped receiving ends the wait with that reason, or after
        vllm_server_timeout."""
        if self.vllm_group:                # vLLM's PyNcclCommunicator, on the current stream
            self.group.broadcast(flat, src=0, stream=torch.cuda.current_stream())
            done = torch.cuda.Event()
            done.record()
            finished = done.query
        else:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            work = self.group.broadcast([flat], opts)
            finished = work.is_completed
        deadline = time.monotonic() + self.timeout
        while not finished():
            if any(u.done() and u.exception() is not None for u in update):
                raise RuntimeError("a server stopped receiving")   # its own error is reported first
            if time.monotonic() > deadline:
                raise TimeoutError(f"a weight bucket was not received within "
                                   f"vllm_server_timeout={self.timeout:g}s")
            time.sleep(0.001)
        if not self.vllm_group:
            work.wait()                    # raises the transport's error, if any


class Members:
    """The servers a sync reaches (state is real: who is out, and why). A server that fails a call
    and then GET /health is taken out, with a warning naming it; one taken out that answers
    /health again is back from the next sync, which gives it the current weights (or adapter)
    before rollouts reach it (rollout/loop.py routes to it once it serves the current version). The
    error comes only when none is left.

        members = Members(clients, timeout, "weight sync")
        members.returning()                    # each sync first: who is back
        members.call(lambda c: c.pause())      # on every live server; the dead are taken out
    """

    def __init__(self, clients: list[VLLMClient], timeout: float, what: str):
        self.clients = clients
        self.timeout = timeout
        self.what = what
        self.out: dict[str, str] = {}          # base_url → why it was taken out

    @property
    def live(self) -> list[VLLMClient]:
        return [c for c in self.clients if c.base_url not in self.out]

    def returning(self) -> None:
        """The servers taken out that answer /health again are live from now on."""
        back = [c for c in self.clients if c.base_url in self.out and c.healthy()]
        for c in back:
            del self.out[c.base_url]
            log.warning("%s: %s answers again; it rejoins with this sync", self.what, c.base_url)

    def take_out(self, client: VLLMClient, why: str, failure: str = "stopped answering") -> None:
        """Out of the syncs, with a warning naming it, what it did (`failure`) and why."""
        self.out[client.base_url] = why
        log.warning("%s: %s %s and is taken out (the run goes on with %d of %d); %s", self.what,
                    client.base_url, failure, len(self.live), len(self.clients), why)

    def take_out_failed(self, failed: list[tuple[VLLMClient, str]], failure: str,
                        last: str) -> None:
        """Take out each (server, why) of `failed` (take_out: `failure` is what it did); if they
        are every live server, none is: RuntimeError("<last>: <url>: <why>; ...") instead."""
        if failed and len(failed) == len(self.live):
            whys = "; ".join(f"{c.base_url}: {why}" for c, why in failed)
            raise RuntimeError(f"{last}: {whys}; restart the server(s) and resume from the last "
                               "checkpoint")
        for c, why in failed:
            self.take_out(c, why, failure)

    def call(self, call: Callable[[VLLMClient], object], what: str | None = None,
             only: set[str] | None = None) -> dict[VLLMClient, object]:
        """call(c) on every live server (whose URL is in `only`, if given) in parallel: {server:
        what it returned}, in the servers' order. A server that failed and fails /health is
        taken out; the first failure of one that answers is raised (as RuntimeError("<what>:
        ...") with `what`); none left: RuntimeError."""
        live = [c for c in self.live if only is None or c.base_url in only]
        with ThreadPoolExecutor(max(1, len(live))) as pool:
            futures = [pool.submit(call, c) for c in live]
            failures = [_attempt(lambda: _result(f, self.timeout, f"{self.what} with {c.base_url}"))
                        for c, f in zip(live, futures)]
        values, real = {}, []
        for c, f, e in zip(live, futures, failures):
            if e is None:
                values[c] = f.result()
            elif c.healthy():
                real.append(e)
            else:
                self.take_out(c, str(e))
        if not self.live:
            whys = "; ".join(f"{url}: {why}" for url, why in self.out.items())
            raise RuntimeError(f"{self.what}: no vLLM server is left ({whys}); restart them, "
                               "and resume from the last checkpoint")
        if real and what:
            raise RuntimeError(f"{what}: {real[0]}") from real[0]
        if real:
            raise real[0]
        return values


def begin_update(client: VLLMClient, resend: bool = False) -> None:
    """POST /start_weight_update. A session a dead run left open (it was killed between start and
    update: vLLM answers "already active"; a later revision, 409 "already in progress") is
    finished first, with a warning: this update sends every tensor, so nothing of the dead run's
    stays. On a resend the open session is this run's own (a survivor of the failed transfer
    received it all): finished without a warning."""
    try:
        client.start_weight_update()
    except VLLMError as e:
        if e.status != 409 and "already active" not in e.message:
            raise
        if not resend:
            log.warning("%s holds a weight update another run began and never finished: "
                        "finishing it before this run's", client.base_url)
        client.finish_weight_update()
        client.start_weight_update()


def _result(future, timeout: float, what: str):
    try:
        return future.result(timeout=timeout)
    except TimeoutError as e:
        raise TimeoutError(f"{what}: no answer within vllm_server_timeout={timeout:g}s") from e
    except Exception as e:
        raise RuntimeError(f"{what} failed: {e}") from e


def _attempt(fn: Callable[[], object]) -> BaseException | None:
    try:
        fn()
    except Exception as e:     # noqa: BLE001 (the caller reports it)
        return e
    return None


class _Lost(RuntimeError):
    """A server died mid-transfer and others are left: push sends once more (every rank)."""
