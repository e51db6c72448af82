"""tree_attention.py's flex backend compiled on a CPU: torch.compile runs the C++ compiler, a child
process, so these tests stay out of the fast tier that test_tree_attention.py belongs to (its
helpers build the models and rows)."""
import pytest
import torch

import tree_attention
from test_tree_attention import model, pack, packed_logps, samples, windowed


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_flex_forward_on_cpu_equals_sdpa(family):
    """flex has no CPU backward in torch 2.13; its forward (compiled on first call) must match,
    with the window as a mask_mod and softcapping as a score_mod (gemma2)."""
    row = pack(samples(4))
    flex, sdpa = (model(4) if family == "qwen3" else windowed(family, 4) for _ in range(2))
    tree_attention.install(flex, "flex")
    tree_attention.install(sdpa, "sdpa")
    with torch.no_grad():
        assert (packed_logps(flex, row) - packed_logps(sdpa, row)).abs().max().item() <= 1e-5
