"""The vLLM servers the rollout process generates from (spec: 並行性 (Concurrency); the replicas
of the adapter-sync note, docs/lora_adapter_sync.md, without its proxy): one `Replica` per URL,
its live concurrency cap, the checks at start (`connect_all`), routing (`pick`), the /metrics polls
(`poll_all`) and a replica's way out and back (`Replica.down`, `serves`).

    config.vllm_server_base_url = "http://a:8000,http://b:8000"      (server_urls splits it)
        └─ Replica a, Replica b: each its VLLMClient, its ConcurrencyCap (bound: the replica's share
           of max_concurrent_rollouts), the rollouts assigned to it, what its /metrics said last
    a new group ── pick(): least loaded ──► replica b     load = (assigned + queued on the server)
                                                                 / cap + KV-cache usage
    the group's num_generations rollouts all run on b (b's prefix cache holds their prompt), each
    waiting for a free slot under b's cap; every metrics_interval_s poll_all() moves the caps

A replica that stops answering (a failed call, then a failed /health) is out of routing; its
rollouts run again on the others. It is back once /health answers and it serves the current
policy version, which the trainer's next sync gives it (weight_sync.Members).

A worked example: caps a = 8, b = 8; a has 8 rollouts assigned and 2 requests queued, KV usage
0.7; b has 8 assigned, none queued, usage 0.3 → load a = 10/8 + 0.7 = 1.95, load b = 8/8 + 0.3 =
1.3 → b. Equal loads: the replica picked least recently (an idle pool still takes turns).

Departures from the spec, and why:
- Replicas are first-class (TRL needs a proxy): the rollout process routes groups itself.
- max_concurrent_rollouts bounds all servers together: each replica's cap is bounded by its share.
- A replica that stops answering is routed around; the run stops, naming them, when none is left.
"""
import asyncio
import logging
import math
from dataclasses import dataclass

from vllm_client import UNVERIFIED, VLLMClient, VLLMError

log = logging.getLogger(__name__)

RAISE_BELOW = 0.6  # spec: while KV usage < 0.6 and nothing waits, ...
RAISE_BY = 0.25    # ... +25% per cap's worth of completed rollouts
CUT_ABOVE = 0.8    # spec: when KV usage > 0.8, ...
CUT_BY = 0.30      # ... −30%


@dataclass
class ConcurrencyCap:
    """The live cap on in-flight rollouts, kept just under `bound` (max_concurrent_rollouts).

    Starts at KV-cache tokens // max_model_len (the requests that fit at full length). Every poll of
    /metrics calls `observe`; every completed rollout calls `rollout_done`:
      - KV usage > 0.8 cuts the cap by 30%; no further cut until in-flight falls under the new cap
        (running requests are never cancelled, so the pool drains first);
      - while nothing waits on the server and usage stays < 0.6, each cap's worth of completed
        rollouts raises the cap by 25% (at least +1), up to `bound`;
      - a server without /metrics keeps the cap at `bound` (adaptive=False).
    """
    bound: int
    cap: int
    adaptive: bool = True
    calm: bool = False    # the last poll saw no waiting request and usage < 0.6
    completed: int = 0    # rollouts completed since the last change, all while calm
    draining: bool = False

    @classmethod
    def start(cls, bound: int, kv_cache_tokens: int | None, max_model_len: int,
              has_metrics: bool) -> "ConcurrencyCap":
        if not has_metrics:
            return cls(bound, bound, adaptive=False)
        fits = kv_cache_tokens // max_model_len if kv_cache_tokens else bound
        return cls(bound, max(1, min(bound, fits)))

    def observe(self, kv_usage: float, waiting: float, inflight: int) -> None:
        if not self.adaptive:
            return
        self.draining = self.draining and inflight >= self.cap
        self.calm = waiting == 0 and kv_usage < RAISE_BELOW
        if not self.calm:
            self.completed = 0
        if kv_usage > CUT_ABOVE and not self.draining:
            self.cap = max(1, int(self.cap * (1 - CUT_BY)))
            self.draining = inflight >= self.cap
            self.completed = 0

    def rollout_done(self, inflight: int) -> None:
        if not self.adaptive:
            return
        self.draining = self.draining and inflight >= self.cap
        if self.calm:
            self.completed += 1
            if self.completed >= self.cap:
                self.cap = min(self.bound, max(self.cap + 1, math.ceil(self.cap * (1 + RAISE_BY))))
                self.completed = 0


@dataclass(eq=False)
class Replica:
    """One vLLM server and what the rollout process knows of it."""
    url: str
    client: VLLMClient
    cap: ConcurrencyCap
    max_model_len: int = 0
    use_generate: bool = False      # candidate sets come from /inference/v1/generate
    assigned: int = 0               # rollouts of admitted groups routed here, still generating
    inflight: int = 0               # rollouts generating here now
    kv_usage: float = 0.0           # from the last /metrics poll
    waiting: float = 0.0
    running: float = 0.0
    preemptions: float = 0.0        # since the last poll (rollout/vllm_preemptions_total)
    picked: int = 0                 # when it last got a group (pick's count), for ties
    last_counter: float | None = None  # the server's vllm:num_preemptions_total at the last poll
    down: str | None = None         # why it is out of routing (None: in routing)

    def load(self) -> float:
        return (self.assigned + self.waiting) / self.cap.cap + self.kv_usage

    async def poll(self) -> None:
        """Read /metrics (summed over the server's engines; KV usage their max) and move the cap."""
        try:
            samples = await self.client.ametrics()
        except (VLLMError, TimeoutError) as e:
            log.warning("could not read %s/metrics (%s); its concurrency cap stays at %d",
                        self.url, e, self.cap.cap)
            return
        if not samples:
            return

        def values(name):
            return [v for _, v in samples.get(name, [])]
        self.kv_usage = max(values("vllm:kv_cache_usage_perc"), default=0.0)
        self.waiting = sum(values("vllm:num_requests_waiting"))
        self.running = sum(values("vllm:num_requests_running"))
        counter = sum(values("vllm:num_preemptions_total"))
        last = counter if self.last_counter is None else self.last_counter   # first poll: none
        # a restarted server starts its counter again at 0
        self.preemptions = counter - last if counter >= last else counter
        self.last_counter = counter
        self.cap.observe(self.kv_usage, self.waiting, self.inflight)


def make_replicas(urls: list[str], bound: int, timeout: float, max_retries: int) -> list[Replica]:
    """One Replica per URL, each bounded by its share of `bound`; caps start at connect()."""
    share = math.ceil(bound / len(urls))
    return [Replica(url, VLLMClient(url, timeout=timeout, max_retries=max_retries,
                                    max_connections=share + 1),     # its rollouts, + /metrics
                    ConcurrencyCap(share, share, adaptive=False)) for url in urls]


class NoReplicaLeft(RuntimeError):
    """Every replica is out of routing: the rollout process stops."""


def pick(replicas: list[Replica]) -> Replica:
    """The replica for a new group: the least loaded in routing; on ties, the one picked least
    recently. None in routing: NoReplicaLeft, naming each and why."""
    live = [r for r in replicas if r.down is None]
    if not live:
        whys = "; ".join(f"{r.url}: {r.down}" for r in replicas)
        raise NoReplicaLeft(f"no vLLM server is left to generate from ({whys}); is it running? "
                            "Restart it, or remove it from vllm_server_base_url")
    chosen = min(live, key=lambda r: (r.load(), r.picked))
    chosen.picked = max(r.picked for r in replicas) + 1
    return chosen


async def connect_all(replicas: list[Replica], config, num_top: int | None,
                      probe_token: int) -> tuple[str, int]:
    """Check every replica at start (`connect`) and that they serve one model: (the model's name,
    the smallest max_model_len). The first failure names its replica's URL."""
    served = [await connect(r, config, num_top, probe_token) for r in replicas]
    if len(set(served)) > 1:
        by_url = {r.url: name for r, name in zip(replicas, served)}
        raise ValueError(f"the vLLM replicas serve different models {by_url}: every URL in "
                         "vllm_server_base_url must serve the same model")
    return served[0], min(r.max_model_len for r in replicas)


async def poll_all(replicas: list[Replica]) -> dict[str, float]:
    """Read each replica's /metrics (moving its cap) and sum up the server side of the periodic
    metrics: KV usage the max over replicas; requests, caps and counters summed. Preemptions are
    those since the last poll (the spec: during the logging window, whose emissions add up)."""
    polled = [r for r in replicas if r.cap.adaptive and r.down is None]
    await asyncio.gather(*(r.poll() for r in polled))
    metrics = {"rollout/concurrency": sum(r.inflight for r in replicas),
               "rollout/concurrency_cap": sum(r.cap.cap for r in replicas),
               "rollout/vllm_retry_total": sum(r.client.retry_total for r in replicas)}
    if polled:
        metrics |= {"rollout/kv_cache_usage": max(r.kv_usage for r in polled),
                    "rollout/vllm_queued_requests": sum(r.waiting for r in polled),
                    "rollout/vllm_running_requests": sum(r.running for r in polled),
                    "rollout/vllm_preemptions_total": sum(r.preemptions for r in polled)}
    return metrics


async def connect(replica: Replica, config, num_top: int | None, probe_token: int) -> str:
    """Check one server at start (the flags the config needs) and start its cap; returns the name
    of its base model."""
    url = replica.url
    client = replica.client
    await asyncio.to_thread(client.wait_for_health)
    info = await asyncio.to_thread(client.server_info)
    model_config = info.get("model_config") or {}
    problems = []   # what the server cannot do for this config ...
    flags = []      # ... and the flags that fix it
    if (mode := model_config.get("logprobs_mode")) != "processed_logprobs":
        problems.append(f"it returns {mode} log-probs, not those of the distribution it samples "
                        "from")
        flags.append("--logprobs-mode processed_logprobs")
    max_logprobs = model_config.get("max_logprobs", 20)
    if num_top is not None and max_logprobs != -1 and max_logprobs < num_top:
        problems.append(f"it returns at most {max_logprobs} log-probs per token and "
                        f"num_sampler_logprobs is {num_top}")
        flags.append(f"--max-logprobs {num_top}")
    if problems:
        raise ValueError(f"the vLLM server at {url} cannot serve this config: "
                         f"{'; '.join(problems)}. Restart it with `{' '.join(flags)}`")
    served = (await asyncio.to_thread(client.models))["data"][0]["id"]
    replica.max_model_len = await asyncio.to_thread(client.max_model_len)
    if config.truncated_sampling:
        replica.use_generate = await returns_candidates(client, served, config, probe_token)
        if not replica.use_generate:
            log.warning("top_k/top_p/min_p truncate sampling, but the vLLM server at %s returns no "
                        "candidate sets: the trainer normalises log π_θ over the whole vocabulary, "
                        "so every importance ratio is biased low (by the π_θ mass outside the "
                        "token's set: see sampling/importance_sampling_ratio/mean). %s", url,
                        candidates_remedy(info))
    cache = info.get("cache_config") or {}
    blocks = (cache.get("num_gpu_blocks") or 0) * (cache.get("block_size") or 0)
    kv_tokens = cache.get("kv_cache_size_tokens") or blocks
    has_metrics = await client.ametrics() is not None
    replica.cap = ConcurrencyCap.start(replica.cap.bound, kv_tokens or None, replica.max_model_len,
                                       has_metrics)
    return served


def take_out(replicas: list[Replica], replica: Replica, error: BaseException,
             failure: str = "stopped answering") -> None:
    """Out of routing, with a warning (once) naming it."""
    if replica.down is None:
        replica.down = f"{type(error).__name__}: {error}"
        log.warning("the vLLM server at %s %s (%s): out of routing, %d replica(s) left; its "
                    "rollouts run again on the others", replica.url, failure, replica.down,
                    sum(r.down is None for r in replicas))


async def drop_unverified(replicas: list[Replica], model: str, adapter: bool) -> None:
    """Out of routing (once per policy version, before a group starts at it: the trainer marks a
    server before it publishes the version): every live replica that failed the trainer's check
    of what it serves. Full sync: its weight version says so (vllm_client.UNVERIFIED, set by
    weight_sync): it holds other weights than were sent. Adapter sync (`adapter`): it lists no
    card for the current adapter `model` (lora_sync unloads an adapter whose probe failed).
    readmit brings it back once a later sync lands on it and is verified."""
    for r in replicas:
        if r.down is None:
            try:
                if adapter:
                    held = None if await lists_model(r.client, model) else f"no adapter {model}"
                else:
                    held = await asyncio.to_thread(r.client.weight_info)
                    held = f"weight version {held!r}" if held.startswith(UNVERIFIED) else None
            except (VLLMError, TimeoutError):
                continue                         # no answer: the requests' failures decide
            if held is not None:
                take_out(replicas, r, RuntimeError(held),
                         "failed the trainer's verification of what it serves")


def move(replicas: list[Replica], group, rollouts: int) -> Replica:
    """Route a group (rollout.PendingGroup) whose replica is out to the one pick() gives, with
    its `rollouts` not started yet."""
    old, group.replica = group.replica, pick(replicas)
    old.assigned -= rollouts
    group.replica.assigned += rollouts
    return group.replica


async def readmit(replicas: list[Replica], model: str, version: int, adapter: bool) -> bool:
    """Back in routing: each replica out of it that `serves` policy `version` (the trainer's
    sync gave it the weights or the adapter `model`). Whether any came back."""
    back = False
    for r in replicas:
        if r.down is not None and await serves(r, model, version, adapter):
            r.down = None
            back = True
            log.warning("the vLLM server at %s answers again with policy version %d: back in "
                        "routing", r.url, version)
    return back


async def serves(replica: Replica, model: str, version: int, adapter: bool) -> bool:
    """May a replica out of routing come back: does /health answer, and does it serve policy
    `version` (full sync: /weight_info at least `version`; LoRA: the adapter `model` loaded)?"""
    client = replica.client
    if not await asyncio.to_thread(client.healthy):
        return False
    try:
        if adapter:
            return await lists_model(client, model)
        held = await asyncio.to_thread(client.weight_info)
    except (VLLMError, TimeoutError):
        return False
    return held.isdigit() and int(held) >= version


async def lists_model(client: VLLMClient, model: str) -> bool:
    """Does GET /v1/models list a card named `model` (an adapter loaded under that name)?"""
    cards = (await asyncio.to_thread(client.models))["data"]
    return any(c["id"] == model for c in cards)


def candidates_remedy(info: dict) -> str:
    """How this server could return candidate sets: the flags, where its hardware allows them."""
    if (info.get("device_config") or {}).get("device") == "cpu":
        return ("vLLM on a CPU cannot return them (sampling masks need its Model Runner V2, which "
                "needs Triton's GPU backend): sample with top_k=0, top_p=1 and min_p=None instead")
    return ("Restart it with `--return-sampling-mask --enable-scale-out` (vLLM >= 0.28, a GPU; "
            "refused: VLLM_USE_V2_MODEL_RUNNER=1), or sample with top_k=0, top_p=1, min_p=None")


async def returns_candidates(client: VLLMClient, model: str, config, token: int) -> bool:
    """Probe /inference/v1/generate with one token: 403/404 = no --enable-scale-out; no
    sampling_mask = no --return-sampling-mask."""
    params = {"max_tokens": 1, "temperature": config.temperature, "top_k": config.top_k,
              "logprobs": 0}
    try:
        reply = await client.agenerate({"model": model, "token_ids": [token],
                                        "sampling_params": params})
    except VLLMError as e:
        if e.status in (403, 404):
            return False
        raise
    return bool(reply["choices"][0].get("sampling_mask"))
