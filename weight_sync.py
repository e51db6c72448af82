"""The trainer's full weights into every vLLM server: one sync, the replicas it reaches, and the
checks at start that make it safe to send.

Spec: 概要 (Overview: weight_sync_steps): "weight_sync_steps 回の学習ステップごとに、更新された重みが
NCCL を介して vLLM サーバーに転送され" (every weight_sync_steps steps the updated weights go to the
servers over NCCL); 記録されたメトリクス (Logged metrics): perf/weight_sync_*. One sync,
WeightSync.push, in the order of vLLM's weight-transfer API (POST /pause ... /resume):

    rank 0                          servers (HTTP)                    every rank
    ──────                          ──────────────                    ──────────
    (at start: the servers healthy, their vocabulary, dtype and every name and shape checked)
    POST /pause?mode=keep ────────► freeze the scheduler               ┐ perf/weight_sync_pause_s
      (+ GET /weight_info: a server that restarted is regrouped)       ┘
    barrier ◄───────────────────────────────────────────────────────── perf/weight_sync_barrier_s
    POST /start_weight_update ────► ready to receive                   ┐ perf/weight_sync_start_s
    POST /update_weights (thread) ► blocks inside the collective       ┘
    for each parameter, in order:                                      ┐ perf/weight_sync_transfer_s
        full_tensor(p): all-gather the FSDP2 shards ◄───────────────── │ (every rank gathers)
        cast to the server dtype                                       │
        bucket > packed_buffer_size_bytes → broadcast(bucket) ───────► │ receive, load by HF name
    join the thread ◄──────────────── "Weights updated"                ┘
    POST /finish_weight_update {"weight_version": "N"} ► reload ends    perf/weight_sync_finish_s
    POST /reset_prefix_cache ───────► no KV of the old weights is kept (vLLM 0.33: not by /pause)
    POST /resume  (on every exit path, SIGTERM's included)             perf/weight_sync_resume_s

Only one bucket (buckets()) is held at a time, never the whole model. From real vLLM 0.32
(docs/vllm_cpu.md): a refused update leaves its model on the meta device and the next forward
kills the engine, so nothing is sent that the server could refuse (check_served); uvicorn closes
a connection after a 500, so the closing /resume after a failure never reuses a pooled one; a
broadcast a server never took holds the trainer's exit for vllm_server_timeout unless the group
is torn down (_ungroup).

Replicas come and go (Members): one that fails a call and /health is taken out and the group
re-formed over the rest (one that dies mid-transfer: the sync is sent once more); back on /health,
it rejoins and is given the weights. One that restarted on its URL shows the weight version a
fresh vLLM reports ("default"), not the one this run published: it is regrouped at the next sync,
or, mid-transfer, the transfer is sent once more.

Verification is optional and lives in verify_sync.py: FullSync.push calls it once, after the
sync (Verifier.check_full), and takes out a server that holds other bytes than were sent.
A LoRA run that cannot sync its adapter sends W + s·B·A: a FullSync of lora_sync.merge_plan.

Departures from the spec, one line each:
- On a CPU both ends form a torch.distributed gloo group (local_vllm, or vLLM with vllm_plugin/).
- A vision-language model syncs only its language model: the vision tower is frozen (train.py).
"""
import importlib.util
import logging
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from checkpoint import full_tensor
from config import dtype_name
from ranks import agree, on_rank0
from vllm_client import UNVERIFIED, VLLMClient, VLLMError
from vllm_plugin.weight_group import free_port, host_ip, weight_group
from vllm_plugin.weight_packing import buckets, checkpoint_shapes

log = logging.getLogger(__name__)

PACKED_BUFFER_BYTES = 1 << 30     # vLLM's default packed_buffer_size_bytes
FAILED = "weight sync failed"     # how every rank's error begins when a phase of a sync fails


@dataclass
class SyncStats:
    """perf/weight_sync_* of one sync: seconds, and the bytes rank 0 sent."""
    s: float = 0.0                # the whole sync
    pause_s: float = 0.0          # pausing every server
    barrier_s: float = 0.0        # waiting for every rank
    start_s: float = 0.0          # opening the update: /start_weight_update, posting the receive
    transfer_s: float = 0.0       # gathering and sending the tensors (or the adapter's load)
    finish_s: float = 0.0         # /finish_weight_update: the servers' reload ends
    resume_s: float = 0.0         # /resume, every server
    bytes: int = 0                # what rank 0 sent: the tensors' bytes, or the adapter file's

    @contextmanager
    def timed(self, name: str):
        """Adds the block's seconds to the field `name`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - start)

    def metrics(self) -> dict[str, float]:
        return {f"perf/weight_sync_{k}": float(v) for k, v in vars(self).items()}


# ── what a sync sends ───────────────────────────────────────────────────────────────────────


def language_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(HF name, parameter) of the text decoder and LM head, in model order: what a sync sends (a
    vision tower stays as the server loaded it). Tied weights appear once."""
    modules = (model.get_decoder(), model.get_output_embeddings())
    ids = {id(p) for m in modules for p in m.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) in ids]


class FullSync:
    """The sync of full weights: every sync sends the tensors of its plan, by default the language
    model's weights (a model without LoRA); lora_sync's plans send a peft model's merged weights
    (merge_plan) or its base weights.

        sync = FullSync(policy, clients, config, verifier)   # every rank; verifier: None is off
        sync.start(version)                        # the group joined, this run's weights sent
        metrics = sync.push(version)               # every rank, each sync: perf/weight_sync_*
    """

    def __init__(self, policy, clients: list[VLLMClient], config, verifier=None, plan=None):
        self.weights = WeightSync(clients, config.vllm_server_timeout)
        self.verifier = verifier             # verify_sync.Verifier, or None: syncs unverified
        self.worker_kwargs: dict = {}        # RolloutWorker's: rollouts ask for the base card
        # (server name, tensor, what is merged into it: lora_sync.Delta or None) of what is sent
        self.plan = plan or [(name, p, None) for name, p in language_parameters(policy.model)]

    def specs(self) -> list[tuple[str, torch.Size]]:
        """(name, shape) of what every sync sends, in order: the server's names."""
        return [(name, p.shape) for name, p, _ in self.plan]

    def tensors(self, only: set[str] | None = None) -> Iterator[torch.Tensor]:
        """What every sync sends (those named in `only`, if given), whole, with its delta merged
        (Delta.merged), in specs() order (every rank: the all-gathers)."""
        return (full_tensor(p) if delta is None else delta.merged(p)
                for name, p, delta in self.plan if only is None or name in only)

    def connect(self) -> None:
        """Rank 0: join the servers, every name and shape checked first (WeightSync.connect)."""
        self.weights.connect(self.specs())

    def start(self, version: int) -> None:
        """Every rank, before generation starts: join, and send this run's weights (a long-lived
        server holds whatever the last run sent it)."""
        self.connect()
        self.push(version)

    def close(self) -> None:
        """Nothing to release: the servers keep the last weights sent."""

    def push(self, version: int) -> dict[str, float]:
        """Every rank: the weights to every server (WeightSync.push); with verification on, the
        servers that hold other bytes than were sent (verify_sync) are taken out."""
        stats = self.weights.push(self.specs(), self.tensors, version).metrics()
        if self.verifier is None:
            return stats
        failed, figures = self.verifier.check_full(self, version)
        on_rank0(lambda: take_out_unverified(
            self.weights.members, failed, "failed the sync's verification",
            f"weight sync to version {version} did not land as sent",
            lambda c: c.update_weight_version(f"{UNVERIFIED}{version}")), FAILED)
        return stats | figures


# ── at start: is the served model the one we train, and how must the servers be started? ─────
# (spec: AsyncGRPOConfig.dtype: 「不一致は、トレーニング開始時に警告としてログに記録されます」, a
# dtype mismatch is logged as a warning at training start.) `info`: a server's /server_info.


def check_servers(clients, config, device) -> None:
    """Rank 0, at start, before anything reads the servers: each one healthy (within
    vllm_server_timeout); one that is paused resumed, with a warning (a run killed between /pause
    and /resume by SIGKILL, OOM or a lost node leaves it so: in keep mode every request waits,
    forever, this run's first one included); its dtype is the trainer's compute dtype (a
    warning, spec: dtype). A server without the dev routes (no VLLM_SERVER_DEV_MODE) is refused
    here: every sync reads /server_info, a dev route (the client's 404 names the variable)."""
    for c in clients:
        c.wait_for_health()
        if c.is_paused():
            log.warning("the vLLM server at %s was paused before this run started (a run that "
                        "stopped during a weight sync leaves it so): resuming it", c.base_url)
            c.resume()
        if why := dtype_warning(c.base_url, c.server_info(), config.compute_dtype(device)):
            log.warning(why)


def served_dtype(info: dict) -> str | None:
    """The server's dtype ("bfloat16"), or None if it is not said."""
    dtype = (info.get("model_config") or {}).get("dtype")
    return dtype_name(dtype) if dtype else None


def dtype_warning(url: str, info: dict, compute_dtype) -> str | None:
    """Why the trainer's and the server's log-probs differ in precision, with the fix; None when
    they agree (or the server does not say)."""
    served, ours = served_dtype(info), dtype_name(compute_dtype)
    if served is None or served == ours:
        return None
    return (f"the vLLM server at {url} serves {served} but the trainer computes in {ours}, so "
            f"every importance ratio carries the precision gap: restart it with `vllm serve "
            f"--dtype {ours}`, or set bf16/fp16 to match it")


def check_served(specs: list[tuple[str, torch.Size]], model: str, url: str) -> None:
    """Refuse, before anything is sent, a sync whose names or shapes the server's model lacks:
    real vLLM answers such an update with a 500 and is left unable to generate. A checkpoint this
    machine cannot read is only warned about (vLLM checks while loading)."""
    served = checkpoint_shapes(model)
    if served is None:
        log.warning("%s serves %r, which this machine cannot read: a sync's names and shapes are "
                    "not checked before they are sent", url, model)
        return
    unknown = [n for n, _ in specs if n not in served]
    wrong = [f"{n} {list(s)} (served {served[n]})" for n, s in specs
             if n in served and list(s) != served[n]]
    if unknown or wrong:
        raise ValueError(f"{url} serves {model!r}, whose weights are not the trained model's: "
                         f"unknown names {unknown[:5]}, other shapes {wrong[:5]}; nothing was "
                         f"sent (vLLM cannot survive a refused update): serve the model you train")


def transfer_flags() -> str:
    """The server flags full sync needs, with the backend this trainer's hardware can use: no
    vLLM backend runs without CUDA but ours (vllm_plugin/, tools/vllm_cpu_venv.sh)."""
    flags = "`--weight-transfer-config '{\"backend\":\"%s\"}'` and VLLM_SERVER_DEV_MODE=1"
    if torch.cuda.is_available():
        return flags % "nccl"
    return flags % "gloo" + (" (vLLM on a CPU: `bash tools/vllm_cpu_venv.sh DIR` makes an "
                             "environment with our gloo backend)")


# ── the transfer ────────────────────────────────────────────────────────────────────────────


class WeightSync:
    """The trainer's end of the weight-transfer group (state is real: the group joined, and the
    version it was last given).

        sync = WeightSync(clients, timeout=config.vllm_server_timeout)   # every rank
        sync.connect(specs)                                               # rank 0 joins the servers
        stats = sync.push(specs, tensors, version)                        # every rank, each sync
    """

    def __init__(self, clients: list[VLLMClient], timeout: float,
                 buffer_bytes: int = PACKED_BUFFER_BYTES):
        self.members = Members(clients, timeout, "weight sync")   # replicas that can die
        self.timeout = timeout                       # vllm_server_timeout: every call and the group
        self.buffer_bytes = buffer_bytes             # packed_buffer_size_bytes
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = None           # rank 0: the group with the servers' workers
        self.grouped: list[VLLMClient] = []   # rank 0: the servers in that group
        self.published: str | None = None     # rank 0: the weight version the group last got
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

    def push(self, specs: list[tuple[str, torch.Size]],
             tensors: Callable[[], Iterator[torch.Tensor]], version: int) -> SyncStats:
        """Send the tensors as `specs` names and shapes, in that order, and publish `version`.
        Every rank calls it and iterates `tensors()` (FSDP2's gathers are collectives); rank 0
        talks to the servers. Each phase ends in one agreement (agree: rank 0's error reaches
        every rank and all raise together), so no rank is left waiting in a collective. The
        servers are resumed on every way out, a stop (SystemExit, KeyboardInterrupt) included."""
        stats = SyncStats()
        with stats.timed("s"):
            try:
                with stats.timed("pause_s"):
                    error = _attempt(self._pause) if self.rank == 0 else None
                with stats.timed("barrier_s"):
                    agree(error, FAILED)        # every rank waits for rank 0's pause: the barrier
                try:
                    self._transfer(stats, specs, tensors, resend=False)
                except _Lost:                   # a server died or restarted mid-transfer:
                    self._transfer(stats, specs, tensors, resend=True)      # to the rest
                with stats.timed("finish_s"):
                    on_rank0(lambda: self.members.call(
                        lambda c: c.finish_weight_update(str(version))), FAILED)
                self.published = str(version)
                on_rank0(lambda: self.members.call(lambda c: c.reset_prefix_cache()), FAILED)
            except BaseException as e:
                if self.rank == 0:
                    self._resume_after(e)
                raise
            with stats.timed("resume_s"):
                if self.rank == 0 and _attempt(lambda: self.members.call(lambda c: c.resume())):
                    if still := [why for c in self.members.live if (why := c.resume_confirmed())]:
                        raise RuntimeError(f"weight sync to version {version} landed, but "
                                           f"{'; '.join(still)}")
        return stats

    def _pause(self) -> None:
        """Rank 0: pause every live server (and those back since the last sync: Members), and
        read its weight version; one that stopped answering is taken out. A server left, came
        back, or restarted (it no longer holds the version the group was given): re-form the
        group. The caches are reset after the update (/reset_prefix_cache), not by /pause:
        vLLM 0.33 ignores clear_cache in keep mode."""
        self.members.readmit_healthy()
        self.paused = self.members.live     # resumed whatever happens (one dead since: named)
        self.members.call(lambda c: c.pause(mode="keep", clear_cache=False))
        restarted = [c for c in self.grouped if self._restarted(c)]
        if restarted or self.grouped != self.members.live:
            self._regroup()

    def _restarted(self, client: VLLMClient) -> bool:
        """Rank 0: whether a grouped server restarted since the group was given its weights: it
        reports another weight version (GET /weight_info; a fresh vLLM: "default"), and so no
        longer has the group; said with a warning. Before a first version was published, or
        where it does not answer (its own failure is the one reported), never."""
        try:
            held = client.weight_info()
        except Exception:          # noqa: BLE001 (the sync's own error is the one reported)
            return False
        if self.published is None or held == self.published:
            return False
        log.warning("weight sync: %s restarted (it reports weight version %r, not %r): it "
                    "rejoins the group and is given the weights", client.base_url, held,
                    self.published)
        return True

    def _resume_after(self, error: BaseException) -> None:
        """Rank 0, after a failed or stopped sync: resume every server it paused, over fresh
        connections; one that may still be paused is named, in the error raised (a failure) or
        in a warning (a stop: SystemExit, KeyboardInterrupt, which go on)."""
        still = [why for c in self.paused if (why := c.resume_confirmed())]
        if still and isinstance(error, Exception):
            raise RuntimeError(f"{error}; {'; '.join(still)}") from error
        if still:
            log.warning("weight sync: %s", "; ".join(still))

    def _transfer(self, stats: SyncStats, specs, tensors, resend: bool) -> None:
        """Every rank gathers every tensor; rank 0 first opens the update on every server
        (_begin), then broadcasts the buckets while they receive. A failure while sending stops
        the sending, never the gathering; the group is then torn down (_ungroup), and the
        agreement at the end raises it on every rank: as _Lost when a server died or restarted
        and some are left (not on a resend)."""
        with stats.timed("start_s"):
            # rank 0: each server's POST /update_weights, receiving (the other ranks: None)
            update = on_rank0(lambda: self._begin(specs, resend), FAILED)
        error, lost = None, False
        with stats.timed("transfer_s"):
            try:
                sizes = [shape.numel() * self.dtype.itemsize for _, shape in specs]
                it = iter(tensors())
                for chunk in buckets(sizes, self.buffer_bytes):
                    parts = [next(it) for _ in chunk]       # every rank: the all-gathers
                    if self.rank == 0 and error is None:     # rank 0 alone casts and sends
                        flat = torch.cat([p.to(self.device, self.dtype).flatten() for p in parts])
                        error = _attempt(lambda: self._broadcast(flat.view(torch.uint8), update))
                        stats.bytes += flat.nbytes
                if self.rank == 0:
                    for c, u in zip(self.grouped, update):   # a server's own error comes first
                        what = f"POST {c.base_url}/update_weights"
                        error = _attempt(lambda: _result(u, self.timeout, what)) or error
            except BaseException:
                if self.rank == 0:
                    self._ungroup(update)
                raise
            if error is not None:
                lost = not resend and self._lost()
                self._ungroup(update)
        agree(error, FAILED, _Lost if lost else RuntimeError)

    def _begin(self, specs, resend: bool) -> list:
        """Rank 0: open the update on every live server (begin_update), re-form the group if one
        stopped answering just now, and post each one's /update_weights, which blocks inside the
        receive (so each in a thread of its own, which never holds up this process's exit):
        their futures."""
        self.members.call(lambda c: begin_update(c, resend))
        if self.grouped != self.members.live:
            self._regroup()
        info = {"names": [n for n, _ in specs],
                "dtype_names": [dtype_name(self.dtype)] * len(specs),
                "shapes": [list(s) for _, s in specs]}
        return [in_background(lambda c=c: c.update_weights(info)) for c in self.grouped]

    def _lost(self) -> bool:
        """Rank 0, after a failed transfer: take out every server of the group that fails
        /health; whether any was, or any restarted, and some are left (then it is sent again)."""
        dead = [c for c in self.grouped if not c.healthy()]
        for c in dead:
            self.members.take_out(c, "it stopped answering during the weight transfer")
        restarted = [c for c in self.grouped if c not in dead and self._restarted(c)]
        return bool(dead or restarted) and bool(self.members.live)

    def _ungroup(self, update: list | None) -> None:
        """Rank 0, after a failed or stopped transfer: tear the group down now, so that neither
        this process's exit nor a server waits for a broadcast the other end never took (a
        refused update: the wait would be vllm_server_timeout). A server whose update already
        ended releases its end first (/shutdown_weight_transfer_engine); the next transfer
        re-forms the group."""
        for c, u in zip(self.grouped, update or []):
            if u.done():
                _attempt(c.shutdown_weight_transfer_engine)
        self.group, self.grouped = None, []

    def _regroup(self) -> None:
        """Rank 0: one group with the workers of every live server (at connect, and after a
        server left, came back or restarted). The trainer is rank 0; replica i's workers start at
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
        make one from the same init_info (vllm_plugin/weight_group.py: gloo on CPU, NCCL where
        vllm is not installed), with the vllm_server_timeout, listening on master_address only,
        the address the servers reach (for a local server, loopback)."""
        if self.vllm_group:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init
            return trainer_init(info | {"rank_offset": 0})
        listener = socket.create_server((info["master_address"], info["master_port"]))
        return weight_group(info["master_address"], info["master_port"], info["world_size"], 0,
                            self.backend, self.timeout, listen_fd=listener.detach())

    def _broadcast(self, flat: torch.Tensor, update: list) -> None:
        """Send one bucket and wait for it, polling: a server that refused the update (its POST
        already failed) or stopped receiving ends the wait with that reason, or after
        vllm_server_timeout."""
        if self.vllm_group:                # vLLM's PyNcclCommunicator, on the current stream
            self.group.broadcast(flat, src=0, stream=torch.cuda.current_stream())
            done = torch.cuda.Event()
            done.record()
            finished = done.query
        else:                              # a torch.distributed backend: gloo, or NCCL
            work = self.group.broadcast(flat, 0)           # from rank 0, the trainer
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
        members.readmit_healthy()              # each sync first: who is back
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

    def readmit_healthy(self) -> None:
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

    def call(self, call: Callable[[VLLMClient], object], what: str | None = None,
             only: set[str] | None = None) -> dict[VLLMClient, object]:
        """call(c) on every live server (whose URL is in `only`, if given) in parallel: {server:
        what it returned}, in the servers' order. A server that failed and fails /health is
        taken out; the first failure of one that answers is raised (as RuntimeError("<what>:
        ...") with `what`); none left: RuntimeError."""
        live = [c for c in self.live if only is None or c.base_url in only]
        values, real = {}, []
        with ThreadPoolExecutor(max(1, len(live))) as pool:
            for c, f in [(c, pool.submit(call, c)) for c in live]:
                try:
                    values[c] = _result(f, self.timeout, f"{self.what} with {c.base_url}")
                except Exception as e:           # noqa: BLE001 (raised below, or taken out)
                    if c.healthy():
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


def take_out_unverified(members: Members, failed: dict[str, str], failure: str, last: str,
                        then: Callable[[VLLMClient], object]) -> None:
    """Rank 0, after verification (verify_sync) refused some servers: take out each live one of
    `failed` (URL → why; Members.take_out: `failure` is what it did), then(it) on each, its
    error only said (rollout.servers.drop_unverified routes around it); if they are every live
    server, none is: RuntimeError("<last>: <url>: <why>; ...") instead."""
    out = [c for c in members.live if c.base_url in failed]
    if out and len(out) == len(members.live):
        whys = "; ".join(f"{c.base_url}: {failed[c.base_url]}" for c in out)
        raise RuntimeError(f"{last}: {whys}; restart the server(s) and resume from the last "
                           "checkpoint")
    for c in out:
        members.take_out(c, failed[c.base_url], failure)
        if error := _attempt(lambda: then(c)):
            log.warning("%s: %s is taken out, but the rollout process may still route to it "
                        "(%s)", members.what, c.base_url, error)


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


# ── threads and deadlines ───────────────────────────────────────────────────────────────────


def in_background(fn: Callable[[], object]) -> Future:
    """fn() on a daemon thread (it never holds up the process's exit): its future."""
    future = Future()

    def run():
        try:
            future.set_result(fn())
        except Exception as e:          # noqa: BLE001 (raised where the result is read)
            future.set_exception(e)
    threading.Thread(target=run, daemon=True).start()
    return future


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
    """A server died or restarted mid-transfer and others are left: push sends once more (every
    rank)."""
