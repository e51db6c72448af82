"""Benchmark of the rollout process (`python -m tools.bench rollout`; the case table and the
departures are tools/bench.py's): the real child, real HTTP, reconcile, scoring and the queue,
against an instant loopback server, so the figure is the rollout process's own cost.
"""
from rollout import AsyncRolloutLoop
from tools.bench_train import pin_threads

# ── rollout (rollout*.py, vllm_client.py) ────────────────────────────────────────────────────────

def rank_reward(prompts, completions, **kwargs) -> list[float]:
    """0, 1, 2, ... by position: never all equal, so every group is kept and yields samples."""
    return [float(i) for i in range(len(completions))]


class ProfiledLoop(AsyncRolloutLoop):
    """The rollout loop under cProfile (its event-loop thread), stats written to
    $BENCH_PROFILE when the run ends."""

    async def run(self) -> None:
        import cProfile
        import os
        profile = cProfile.Profile()
        profile.enable()
        try:
            await super().run()
        finally:
            profile.disable()
            profile.dump_stats(os.environ["BENCH_PROFILE"])


class InstantServer:
    """What the rollout process calls on a vLLM server, answered at no compute: an asyncio
    HTTP/1.1 server on 127.0.0.1, one port per replica, in its own process (see serve()).

    /v1/completions answers with the turn's precomputed tokens (cut at max_tokens), their
    log-probs and the `logprobs` top entries per token, as vLLM lays them out
    (return_token_ids, return_tokens_as_token_ids); a prompt holding `marker` (a tool response)
    gets `after_tool`, any other `first`. The other routes: health, the model card, the flags
    connect() checks, an idle /metrics."""

    def __init__(self, first: list[int], after_tool: list[int] | None, marker: int,
                 texts: dict[int, str], max_model_len: int):
        import json
        self.turns = {False: first, True: after_tool or first}
        self.marker = marker
        self.texts = texts                  # token id -> its text
        self.choices: dict[tuple, bytes] = {}
        card = {"id": "toy", "object": "model", "root": "toy", "parent": None,
                "max_model_len": max_model_len}
        info = {"model_config": {"logprobs_mode": "processed_logprobs", "max_logprobs": 20,
                                 "max_model_len": max_model_len},
                "cache_config": {"kv_cache_size_tokens": 10**9}}
        self.routes = {
            ("GET", "/health"): b"",
            ("GET", "/v1/models"): json.dumps({"object": "list", "data": [card]}).encode(),
            ("GET", "/server_info?config_format=json"):
                json.dumps({"vllm_config": info}).encode(),
            ("GET", "/get_world_size?include_dp=true"): b'{"world_size": 1}',
            ("GET", "/metrics"): b"".join(
                b'%s{engine="0",model_name="toy"} 0.0\n' % name
                for name in (b"vllm:kv_cache_usage_perc", b"vllm:num_requests_waiting",
                             b"vllm:num_requests_running", b"vllm:num_preemptions_total"))}

    def choice(self, after_tool: bool, max_tokens: int, k: int) -> bytes:
        """The reply's choice up to its prompt_token_ids (cached: it depends on these three)."""
        import json
        key = (after_tool, max_tokens, k)
        if key not in self.choices:
            ids = self.turns[after_tool][:max_tokens]
            stopped = len(ids) == len(self.turns[after_tool])
            tops = [{f"token_id:{t}": -0.5, **{f"token_id:{1000 + j}": -1.0 - j for j in range(k)}}
                    for t in ids]
            logprobs = {"text_offset": list(range(len(ids))), "token_logprobs": [-0.5] * len(ids),
                        "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": tops}
            choice = {"index": 0, "text": "".join(self.texts[t] for t in ids[:len(ids) - stopped]),
                      "logprobs": logprobs, "finish_reason": "stop" if stopped else "length",
                      "stop_reason": None, "token_ids": ids}
            self.choices[key] = json.dumps(choice).encode()[:-1]      # without its closing brace
        return self.choices[key]

    def answer(self, method: str, target: str, body: bytes) -> tuple[int, bytes]:
        import json
        if (method, target) == ("POST", "/v1/completions"):
            request = json.loads(body)
            prompt = request["prompt"]
            after_tool = self.marker in prompt
            head = self.choice(after_tool, request["max_tokens"], request.get("logprobs") or 0)
            n = min(request["max_tokens"], len(self.turns[after_tool]))
            usage = b'{"prompt_tokens": %d, "completion_tokens": %d, "total_tokens": %d}' % (
                len(prompt), n, len(prompt) + n)
            return 200, (b'{"id": "cmpl-bench", "object": "text_completion", "created": 0, '
                         b'"model": "toy", "choices": [' + head + b', "prompt_token_ids": '
                         + json.dumps(prompt).encode() + b'}], "usage": ' + usage + b'}')
        if (method, target) in self.routes:
            return 200, self.routes[method, target]
        return 404, b'{"error": {"message": "no such route"}}'

    def serve(self, replicas: int, core: int, ports) -> None:
        """Listen on `replicas` ports of 127.0.0.1 pinned to `core`; send the ports on the pipe
        `ports`; serve until killed."""
        import asyncio
        import os
        os.sched_setaffinity(0, {core})
        server = self

        class Connection(asyncio.Protocol):
            def connection_made(self, transport):
                self.transport = transport
                self.buffer = b""

            def data_received(self, data):
                self.buffer += data
                while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
                    lines = self.buffer[:end].decode("latin-1").split("\r\n")
                    length = 0
                    for line in lines[1:]:
                        name, _, value = line.partition(":")
                        if name.strip().lower() == "content-length":
                            length = int(value)
                    if len(self.buffer) < end + 4 + length:
                        return
                    body = self.buffer[end + 4: end + 4 + length]
                    self.buffer = self.buffer[end + 4 + length:]
                    method, target, _ = lines[0].split(" ", 2)
                    status, payload = server.answer(method, target, body)
                    reason = b"OK" if status == 200 else b"Not Found"
                    self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                                         b"content-length: %d\r\n\r\n%s"
                                         % (status, reason, len(payload), payload))

        async def main():
            loop = asyncio.get_running_loop()
            listening = [await loop.create_server(Connection, "127.0.0.1", 0)
                         for _ in range(replicas)]
            ports.send([s.sockets[0].getsockname()[1] for s in listening])
            await asyncio.Event().wait()
        asyncio.run(main())


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (/proc/PID/stat)."""
    import os
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of a process's main thread (the rollout loop) and of all its other threads
    (the queue's feeder, which pickles samples; the tool pool)."""
    import os
    main = other = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue                                 # the thread ended meanwhile
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if int(tid) == pid:
            main += seconds
        else:
            other += seconds
    return main, other


def _client_floor(url: str, body: dict, requests: int, core: int, out) -> None:
    """VLLMClient.acompletions alone, `requests` of them 64 at a time, pinned to `core`: sends
    (requests per second, CPU ms per request) on the pipe `out`: the most the rollout process
    could do over this HTTP client, with nothing else to do."""
    import asyncio
    import os
    import time

    from vllm_client import VLLMClient
    os.sched_setaffinity(0, {core})

    async def main():
        client = VLLMClient(url)

        async def lane(n):
            for _ in range(n):
                await client.acompletions(body)
        await asyncio.gather(*(lane(4) for _ in range(64)))           # connections, warm-up
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(lane(requests // 64) for _ in range(64)))
        out.send((requests / (time.perf_counter() - start),
                  1e3 * (time.process_time() - cpu) / requests))
        await client.aclose()
    asyncio.run(main())


def _profile_summary(path: str, top: int) -> list[str]:
    """The child's profile: its CPU by package (own time) and the `top` functions by own time."""
    import os
    import pstats
    stats = pstats.Stats(path).stats             # {(file, line, name): (cc, nc, tt, ct, callers)}
    total = sum(v[2] for v in stats.values())
    by_package: dict[str, float] = {}
    for (file, _, name), v in stats.items():
        if file == "~":
            package = "builtins"
        elif "site-packages" in file:
            package = file.split("site-packages" + os.sep)[1].split(os.sep)[0]
        elif file.startswith(os.path.dirname(os.__file__)):
            package = "stdlib " + file[len(os.path.dirname(os.__file__)) + 1:].split(os.sep)[0]
        else:
            package = os.path.basename(file)
        by_package[package] = by_package.get(package, 0.0) + v[2]
    lines = ["  by package (own time): " + ", ".join(
        f"{p} {t / total:.0%}" for p, t in sorted(by_package.items(), key=lambda kv: -kv[1])[:10])]
    for (file, line, name), v in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = name if file == "~" else f"{os.path.basename(file)}:{line}({name})"
        lines.append(f"  {v[2] / total:6.1%} own {v[3] / total:6.1%} cumulative  {v[1]:>8} calls"
                     f"  {where}")
    return lines


def rollout(argv):
    """The rollout process against instant servers: RolloutWorker spawns the real child (real HTTP,
    connect, reconcile, scoring, the queue), pinned to one core; InstantServer (all replicas, one
    process) and this process (the trainer's side: get() and a version every --per-version
    samples) share the other core. Cases: single-turn, and a tool call then an answer (two
    requests a rollout), both `--completion` tokens in all; conversational prompts.

    rollouts_per_s: wall clock from `ready` to the end marker; cpu_per_rollout_ms: the child's CPU
    (all its threads) over the same span; server_busy: the server's CPU share of that span (near
    1: the server, not the child, was the limit). --profile adds a cProfile run of the child
    (slower: profiling costs CPU) and prints where its time goes."""
    import argparse
    import multiprocessing as mp
    import os
    import tempfile
    import time

    import toy
    from config import AsyncGRPOConfig
    from rollout.worker import RolloutWorker

    parser = argparse.ArgumentParser(prog="python -m tools.bench rollout")
    parser.add_argument("--groups", type=int, default=400, help="prompts, each one group")
    parser.add_argument("--generations", type=int, default=8, help="num_generations (G)")
    parser.add_argument("--completion", type=int, default=256, help="generated tokens a rollout")
    parser.add_argument("--replicas", default="1,4", help="replica counts of the single-turn case")
    parser.add_argument("--top", type=int, default=0,
                        help="num_sampler_logprobs (0: score_centering off, one log-prob a token)")
    parser.add_argument("--concurrency", type=int, default=64, help="max_concurrent_rollouts")
    parser.add_argument("--per-version", type=int, default=128,
                        help="samples the trainer side consumes per policy version")
    parser.add_argument("--profile", action="store_true", help="also profile the child")
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    child_core = {cores[0]}
    other_core = cores[-1]
    os.sched_setaffinity(0, {other_core})
    tokenizer = toy.build_tokenizer()
    eos = tokenizer.eos_token_id
    texts = {i: tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))}
    filler = tokenizer.convert_tokens_to_ids(list("Let me think step by step. " * args.completion))
    call = tokenizer.encode('<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
    half = args.completion // 2
    single = filler[: args.completion - 1] + [eos]
    first = filler[: half - len(call) - 1] + call + [eos]
    after_tool = filler[: args.completion - len(first) - 1] + [eos]
    marker = tokenizer.convert_tokens_to_ids("<tool_response>")
    dataset = toy.make_dataset(args.groups)
    ctx = mp.get_context("spawn")

    def measure(replicas: int, tools: bool, profile: str | None, floor: dict | None = None) -> dict:
        server = InstantServer(first if tools else single, after_tool if tools else None, marker,
                               texts, max_model_len=4096)
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=server.serve, args=(replicas, other_core, send), daemon=True)
        process.start()
        urls = ",".join(f"http://127.0.0.1:{port}" for port in receive.recv())
        config = AsyncGRPOConfig(
            vllm_server_base_url=urls, num_generations=args.generations,
            max_completion_length=args.completion, num_train_epochs=1,
            max_concurrent_rollouts=args.concurrency, score_centering=args.top > 0,
            num_sampler_logprobs=max(args.top, 1), vllm_server_timeout=30.0)
        if profile:
            os.environ["BENCH_PROFILE"] = profile
        worker = RolloutWorker(config, dataset, [rank_reward], tokenizer,
                               tools=[toy.add] if tools else None,
                               loop_cls=ProfiledLoop if profile else AsyncRolloutLoop)
        try:
            worker.start()
            pin_threads(worker.process.pid, child_core)
            start = time.perf_counter()
            child_start = _thread_cpu_s(worker.process.pid)
            server_start = _cpu_s(process.pid)
            samples = 0
            while worker.get(timeout=60) is not None:
                samples += 1
                if samples % args.per_version == 0:
                    worker.set_model_version(samples // args.per_version)
            wall = time.perf_counter() - start
            loop_s, threads_s = (b - a for a, b in zip(child_start,
                                                       _thread_cpu_s(worker.process.pid)))
            server_cpu = _cpu_s(process.pid) - server_start
            if floor is not None:
                body = {"model": "toy", "prompt": list(range(30)), "max_tokens": args.completion,
                        "logprobs": args.top, "return_token_ids": True,
                        "return_tokens_as_token_ids": True}
                receive, send = ctx.Pipe(duplex=False)
                bare = ctx.Process(target=_client_floor,
                                   args=(urls.split(",")[0], body, 4096, cores[0], send))
                bare.start()
                floor.update(zip(("requests_per_s", "cpu_per_request_ms"), receive.recv()))
                bare.join()
        finally:
            worker.stop()
            process.kill()
            process.join()
        rollouts = args.groups * args.generations
        return {"rollouts_per_s": rollouts / wall, "samples_per_s": samples / wall,
                "cpu_per_rollout_ms": 1e3 * (loop_s + threads_s) / rollouts,
                "loop_thread_ms": 1e3 * loop_s / rollouts,
                "other_threads_ms": 1e3 * threads_s / rollouts, "server_busy": server_cpu / wall}

    cases = [(f"single-turn replicas={r}", int(r), False) for r in args.replicas.split(",")]
    cases.append(("tool call + answer replicas=1", 1, True))
    print(f"G={args.generations} completion={args.completion} top={args.top} "
          f"groups={args.groups} concurrency={args.concurrency}; child on core {cores[0]}, "
          f"server and trainer side on core {other_core}; load {os.getloadavg()[0]:.2f}")
    results = {}
    floor = {}
    for name, replicas, tools in cases:
        results[name] = measure(replicas, tools, None, None if floor else floor)  # floor: once
        print(f"  {name}: " + " ".join(f"{k}={v:.0f}" if k.endswith("_per_s") else f"{k}={v:.3f}"
                                       for k, v in results[name].items()))
    print(f"  the HTTP client alone (VLLMClient.acompletions, one core, the same replies): "
          f"requests_per_s={floor['requests_per_s']:.0f} "
          f"cpu_per_request_ms={floor['cpu_per_request_ms']:.3f}")
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            for name, replicas, tools in cases[:1] + cases[-1:]:
                path = os.path.join(tmp, "child.prof")
                measure(replicas, tools, path)
                print(f"  profile of the child, {name}:")
                print("\n".join(_profile_summary(path, 15)))
    slowest = min(results.values(), key=lambda r: r["rollouts_per_s"])
    print(f"rollout rollouts_per_s={slowest['rollouts_per_s']:.0f} "
          f"samples_per_s={slowest['samples_per_s']:.0f} "
          f"cpu_per_rollout_ms={slowest['cpu_per_rollout_ms']:.3f} (the slowest case)")
