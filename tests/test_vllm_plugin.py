"""vllm_plugin/gloo_weight_transfer.py's pure parts, without vLLM installed: its bucket plan is the
trainer's (weight_sync.buckets: both ends must cut the same buckets), and what it refuses before
the model is touched. The engine itself runs against real vLLM in test_vllm_real.py."""
import os
import random
import sys

import torch

from conftest import ROOT
from weight_sync import buckets as trainer_buckets

sys.path.insert(0, os.path.join(ROOT, "vllm_plugin"))
import gloo_weight_transfer as plugin  # noqa: E402


def test_both_ends_cut_the_same_buckets():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 7, 40, 100, 4096]) for _ in range(rng.randint(0, 30))]
        buffer = rng.choice([1, 50, 100, 1000, 1 << 30])
        assert plugin.buckets(sizes, buffer) == trainer_buckets(sizes, buffer)


def info(names, shapes, dtype="float32"):
    return plugin.GlooUpdateInfo(names=names, dtype_names=[dtype] * len(names), shapes=shapes)


def test_refusals_name_what_the_served_checkpoint_lacks():
    served = {"model.embed_tokens.weight": [105, 128], "model.norm.weight": [128]}
    ok = info(list(served), list(served.values()))
    assert plugin.refusal(ok, served, torch.float32) is None
    unknown = info(["model.no_such.weight"], [[128]])
    assert "unknown names ['model.no_such.weight']" in plugin.refusal(unknown, served,
                                                                     torch.float32)
    shape = info(["model.norm.weight"], [[7]])
    assert "model.norm.weight [7] (served [128])" in plugin.refusal(shape, served, torch.float32)
    assert "not the served dtype" in plugin.refusal(info(["model.norm.weight"], [[128]],
                                                         "bfloat16"), served, torch.float32)
    assert plugin.refusal(ok, None, torch.float32) is None   # no checkpoint: vLLM checks it
    ragged = plugin.GlooUpdateInfo(names=["a", "b"], dtype_names=["float32"], shapes=[[1], [1]])
    assert "differ in length" in plugin.refusal(ragged, served, torch.float32)


def test_a_refused_update_is_drained_only_when_its_bucket_sizes_are_known():
    assert plugin.sizable(info(["a"], [[3]], "bfloat16"))
    assert not plugin.sizable(info(["a"], [[3]], "no_such_dtype"))
    assert not plugin.sizable(plugin.GlooUpdateInfo(names=["a"], dtype_names=[], shapes=[[1]]))


def test_the_checkpoint_shapes_come_from_the_safetensors_headers(toy_dir):
    shapes = plugin.checkpoint_shapes(toy_dir)
    assert shapes["model.embed_tokens.weight"] == [105, 128]
    assert "lm_head.weight" not in shapes                           # tied: not in the checkpoint
    assert plugin.checkpoint_shapes("/nonexistent/model") is None
