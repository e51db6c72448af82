"""tools/bench_train.py (the benchmark's training cases): the LoRA byte ratio on meta-device shapes
replays the spec's figure (LoRA: an r=32 adapter of Qwen2.5-7B is ~1% of its weights). The cases
themselves run as `python -m tools.bench CASE`; test_readme.py checks the README's cases exist."""
import torch


def test_meta_device_byte_ratio_matches_the_spec_figure():
    """r=32 on Qwen2.5-7B's shapes: ~160 MB of adapter against ~15 GB of weights (spec: LoRA),
    about 1%."""
    from tools.bench_train import lora_byte_ratio
    full, adapter = lora_byte_ratio("qwen2.5-7b", r=32)
    assert 14e9 < full < 16e9 and 150e6 < adapter < 170e6
    assert torch.isclose(torch.tensor(adapter / full), torch.tensor(0.0106), rtol=0.05)
