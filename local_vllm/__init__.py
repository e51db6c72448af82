"""The embedded vLLM stand-in (docs/vllm_api.md): a small vLLM-compatible server on
transformers, run as a process. The trainer, the tools and the tests import only `launch` (the
standard library only); nothing here imports the trainer side.

    launch.py     LocalServer (`python -m local_vllm.server ...`), VLLMServe (`vllm serve ...`)
    server.py     the contract: request parsing and validation, one function per route, the CLI
    requests.py   request checks: fields, types, sampling parameters, prompts
    transport.py  HTTP/1.1 framing, bounded bodies, JSON errors, --api-key
    engine.py     continuous batching, KV accounting, sampling, LoRA, receiving weights
"""
