"""toy.py: the offline model loads like a hub model, the chat template handles tools, the reward is as documented."""
import pickle
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import toy


def test_saved_directory_loads_with_auto_classes(toy_dir):
    tokenizer = AutoTokenizer.from_pretrained(toy_dir)
    model = AutoModelForCausalLM.from_pretrained(toy_dir)
    assert model.config.model_type == "qwen3"
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.config.vocab_size == len(tokenizer)
    # the same weights as a fresh build with the same seed: the toy is deterministic
    fresh = toy.build_model(len(tokenizer), seed=0)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_cli_saves_a_model_directory(tmp_path):
    out = subprocess.run([sys.executable, "toy.py", "--save", str(tmp_path / "m")], capture_output=True, text=True,
                         cwd=toy.__file__.rsplit("/", 1)[0], check=True)
    assert out.stdout.strip() == str(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").exists() and (tmp_path / "m" / "tokenizer.json").exists()


def test_chat_template_round_trips_with_tools_and_tool_messages():
    tokenizer = toy.build_tokenizer()
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "1+2="},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
                {"role": "tool", "name": "add", "content": "3"}]
    text = tokenizer.apply_chat_template(messages, tools=[toy.add], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools\n<tools>\n")
    assert '"name": "add"' in text and "The first integer." in text       # the schema from the docstring
    assert '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><|im_end|>\n' in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, tools=[toy.add], add_generation_prompt=True, return_dict=False)
    assert tokenizer.decode(ids) == text                                  # character level: exact round trip
    for tag in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
    # a prompt without tools renders a plain conversation, and a prefix stays a prefix
    plain = tokenizer.apply_chat_template(messages[1:2], add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"


def test_dataset_and_reward():
    ds = toy.make_dataset(32, seed=3)
    assert ds.column_names == ["prompt", "answer"] and len(ds) == 32
    for row in ds:
        a, b = row["prompt"][0]["content"].rstrip("=").split("+")
        assert row["prompt"][0]["role"] == "user" and int(a) + int(b) == int(row["answer"]) and len(row["answer"]) == 1
    completions = [[{"role": "assistant", "content": c}] for c in ("7", " 7 ", "71", "x7y", "8", "")]
    assert toy.sum_reward(None, completions, ["7"] * 6) == [1.0, 1.0, 0.5, 0.2, 0.0, 0.0]
    assert toy.sum_reward(None, ["7"], ["7"]) == [1.0]                    # standard (string) completions too
    assert pickle.loads(pickle.dumps(toy.sum_reward)) is toy.sum_reward   # crosses to the rollout process
