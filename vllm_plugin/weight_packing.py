"""The layout of a weight update that both of its ends compute: vLLM's packed buckets and the
tensor shapes of a served checkpoint. One definition, for the trainer (weight_sync.py) and our gloo
engine in vLLM's workers (gloo_weight_transfer.py); torch-free, so neither end pays for the other.

    buckets([40, 40, 80, 16], 100)   → [range(0, 3), range(3, 4)]   what each broadcast carries
    checkpoint_shapes("runs/model")  → {"model.embed_tokens.weight": [105, 128], ...}
"""
import glob
import os


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


def checkpoint_shapes(model: str) -> dict[str, list[int]] | None:
    """{name: shape} of a checkpoint's tensors (a directory, or a hub id in this machine's cache),
    read from its safetensors headers; None when it has none here."""
    from safetensors import safe_open
    if not os.path.isdir(model):
        try:
            from huggingface_hub import snapshot_download
            model = snapshot_download(model, local_files_only=True,
                                      allow_patterns=["*.safetensors"])
        except Exception:  # noqa: BLE001 (not in the cache, or not a hub id)
            return None
    shapes = {}
    for path in glob.glob(os.path.join(model, "*.safetensors")):
        with safe_open(path, "pt") as f:
            shapes |= {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    return shapes or None
