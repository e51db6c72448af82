"""vLLM's own packed NCCL weight transfer, both ends, run without a GPU on what
test_vllm_plugin_gloo_weight_transfer.py hands it (in vLLM's venv: VLLM_PYTHON):

    $VLLM_PYTHON tests/vllm_packed_transfer.py CASES.pt OUT.pt

Each case: "tensors" [(name, tensor)] in the wire dtype, "buffer_bytes", and what our WeightSync
posted and broadcast: "init" (init_weight_transfer_engine), "update" (update_weights), "sent"
(its packed uint8 buffers). For each case it runs

    trainer  NCCLTrainerWeightTransferEngine.send_weights over the tensors, packed, that buffer
             size (nccl_engine.py → packed_tensor.packed_nccl_broadcast_producer → pack_tensors):
             records the update_info it posts and every buffer it broadcasts
    worker   NCCLWeightTransferEngine: parse_init_info(our init) → init_transfer_engine,
             parse_update_info(our update) → receive_weights (packed_nccl_broadcast_consumer), fed
             our buffers: records the buffer sizes it receives and each load_weights batch

Replaced, as there is no CUDA: the communicators (the trainer's broadcast records, the worker's,
from worker_init_process_group, is filled from our buffers in order), the producer's and
consumer's CUDA streams (packed_tensor._get_streams) and the device index they are made on. The
planning, packing, cutting and unpacking are vLLM's.
"""
import sys
from types import SimpleNamespace

import torch
from vllm.distributed.weight_transfer import nccl_engine, packed_tensor
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource


class Tensors(WeightSource):
    """vLLM's WeightSource over a list of (name, tensor), in order."""

    def __init__(self, pairs: list[tuple[str, torch.Tensor]]):
        self.pairs = pairs

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.pairs]

    def __iter__(self):
        return iter(self.pairs)


class NoStream:
    """A CUDA stream's stand-in: nothing runs asynchronously on a CPU."""

    def synchronize(self) -> None:
        pass


class Broadcasts:
    """A communicator whose broadcast records each buffer (trainer) or fills it from `feed`, the
    buffers our trainer sent, in order (worker)."""

    def __init__(self, feed: list[torch.Tensor] | None = None):
        self.feed = None if feed is None else iter(feed)
        self.buffers: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if src != 0:
            raise ValueError(f"broadcast from rank {src}, not the trainer's 0")
        if self.feed is not None:
            ours = next(self.feed, None)
            if ours is not None and ours.shape == tensor.shape:
                tensor.copy_(ours)
        self.buffers.append(tensor.clone())


class Client:
    """The trainer engine's VLLMWeightSyncClient: records the update_info it posts."""

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        self.update = update_info

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


class Model:
    """The worker's model: records each load_weights batch (one per received buffer)."""

    def __init__(self):
        self.batches: list[list[tuple[str, torch.Tensor]]] = []

    def load_weights(self, weights) -> None:
        self.batches.append([(name, t.clone()) for name, t in weights])


def trainer_side(case: dict) -> dict:
    """What vLLM's trainer engine posts and broadcasts for the case's tensors."""
    client = Client()
    engine = nccl_engine.NCCLTrainerWeightTransferEngine(
        client=client, source=Tensors(case["tensors"]), packed=True,
        packed_buffer_size_bytes=case["buffer_bytes"])
    engine.model_update_group = Broadcasts()
    engine.send_weights()
    return {"update": client.update, "buffers": engine.model_update_group.buffers}


def worker_side(case: dict) -> dict:
    """What vLLM's worker engine makes of our init info, update info and buffers."""
    group = Broadcasts(case["sent"])
    nccl_engine.worker_init_process_group = lambda init_info, parallel_config: group
    model = Model()
    engine = nccl_engine.NCCLWeightTransferEngine(
        config=None, vllm_config=SimpleNamespace(parallel_config=None, model_config=None),
        device=torch.device("cpu"), model=model)
    engine.init_transfer_engine(engine.parse_init_info(case["init"]))
    engine.receive_weights(engine.parse_update_info(case["update"]))
    return {"packed": (engine.packed, engine.packed_buffer_size_bytes, engine.packed_num_buffers),
            "received": [b.numel() for b in group.buffers], "batches": model.batches}


def main(cases_path: str, out_path: str) -> None:
    packed_tensor._get_streams = lambda device, n: tuple(NoStream() for _ in range(n))
    torch.accelerator.current_device_index = lambda: 0
    cases = torch.load(cases_path, weights_only=True)
    out = {"defaults": (packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                        packed_tensor.DEFAULT_PACKED_NUM_BUFFERS),
           "cases": {name: {"trainer": trainer_side(case), "worker": worker_side(case)}
                     for name, case in cases.items()}}
    torch.save(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
