"""A trainer that dies mid-sync: it pauses the server, starts an update of the model at MODEL_DIR
in 64 KiB buckets, sends the first half of its tensors and exits (os._exit, as a SIGKILL leaves
its sockets) with status 3.

    python tests/dead_sender.py URL MODEL_DIR          # test_vllm_real.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import AutoModelForCausalLM  # noqa: E402

from vllm_client import VLLMClient  # noqa: E402
from weight_sync import WeightSync, language_parameters  # noqa: E402


def main(url: str, model_dir: str) -> None:
    params = language_parameters(AutoModelForCausalLM.from_pretrained(model_dir))
    specs = [(n, p.shape) for n, p in params]
    sync = WeightSync([VLLMClient(url, timeout=60, max_retries=1)], 60.0, buffer_bytes=1 << 16)
    sync.connect(specs)

    def tensors():
        for i, (_, p) in enumerate(params):
            if i == len(params) // 2:
                os._exit(3)
            yield p.detach()
    sync.push(specs, tensors, version=99)


if __name__ == "__main__":
    main(*sys.argv[1:])
