"""toy.py: the offline model loads like a hub model, the chat template handles tools, the rewards
are as documented, and GRPO learns the task."""
import pickle
import subprocess
import sys

import pytest
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
    out = subprocess.run([sys.executable, "toy.py", "--save", str(tmp_path / "m")],
                         capture_output=True, text=True, cwd=toy.__file__.rsplit("/", 1)[0],
                         check=True)
    assert out.stdout.strip() == str(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").exists()
    assert (tmp_path / "m" / "tokenizer.json").exists()


def test_chat_template_round_trips_with_tools_and_tool_messages():
    tokenizer = toy.build_tokenizer()
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "1+2="},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "add", "content": "3"}]
    text = tokenizer.apply_chat_template(messages, tools=[toy.add], add_generation_prompt=True,
                                         tokenize=False)
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools\n<tools>\n")
    assert '"name": "add"' in text and "The first integer." in text   # the docstring's schema
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert call + '<|im_end|>\n' in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, tools=[toy.add], add_generation_prompt=True,
                                        return_dict=False)
    assert tokenizer.decode(ids) == text                     # character level: exact round trip
    for tag in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
    # a prompt without tools renders a plain conversation, and a prefix stays a prefix
    plain = tokenizer.apply_chat_template(messages[1:2], add_generation_prompt=True,
                                          tokenize=False)
    assert plain == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"


def test_dataset_and_reward():
    ds = toy.make_dataset(32, seed=3)
    assert ds.column_names == ["prompt", "answer"] and len(ds) == 32
    for row in ds:
        a, b = row["prompt"][0]["content"].rstrip("=").split("+")
        assert row["prompt"][0]["role"] == "user"
        assert int(a) + int(b) == int(row["answer"]) and len(row["answer"]) == 1
    texts = ("7", " 7 ", "71", "x7y", "8", "")
    completions = [[{"role": "assistant", "content": c}] for c in texts]
    assert toy.sum_reward(None, completions, ["7"] * 6) == [1.0, 1.0, 0.5, 0.2, 0.0, 0.0]
    assert toy.sum_reward(None, ["7"], ["7"]) == [1.0]         # standard (string) completions
    assert pickle.loads(pickle.dumps(toy.sum_reward)) is toy.sum_reward   # to the rollout process


def test_demo_prompts_are_plain_text_with_every_sum_equally_often():
    ds = toy.make_dataset(900, seed=1, standard=True, balanced=True)
    counts = {str(s): 0 for s in range(9)}
    for row in ds:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert 0 <= int(a) <= 4 and 0 <= int(b) <= 4 and str(int(a) + int(b)) == row["answer"]
        counts[row["answer"]] += 1
    # ~100 each (4 standard deviations: 60..140); uniform pairs would give "0" 36 and "4" 180
    assert all(60 <= n <= 140 for n in counts.values()), counts


def test_exact_reward_is_one_only_for_exactly_the_answer():
    texts = ("7", " 7 ", "71", "6", "x7", "")
    assert toy.exact_reward(None, list(texts), ["7"] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    assert toy.exact_reward(None, chat, ["4", "4"]) == [1.0, 0.0]


def test_the_warm_up_teaches_the_format_and_not_the_answer():
    """After the warm-up a plain "a+b=" prompt is answered with one digit, spread over the digits
    (the answer is RL's to learn), and then the end of turn."""
    tokenizer = toy.build_tokenizer()
    model = toy.build_model(len(tokenizer))
    toy.warm_up(model, tokenizer, steps=100, batch=32, standard=True)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    prompt = tokenizer.encode("3+4=", add_special_tokens=False)
    with torch.no_grad():
        p = model(torch.tensor([prompt + [digits[7]]])).logits[0, -2:].softmax(-1)   # [2, V]
    assert p[0, digits].sum() > 0.9 and p[0, digits].max() < 0.3, p[0, digits]
    assert p[1, tokenizer.eos_token_id] > 0.9


@pytest.mark.slow
def test_grpo_learns_the_toy_task_on_cpu():
    """The toy task's claim: GRPO with our packing and loss raises the reward of the random-init
    model within a few hundred steps on a CPU. An on-policy loop in one process (transformers'
    sampler, no server): each step samples 8 completions for each of 4 prompts, keeps groups with
    unequal rewards and takes one step."""
    import numpy as np

    import tree_attention
    from loss import StepTotals, compute_loss
    from rollout.samples import RolloutSample
    from config import AsyncGRPOConfig
    from trie_pack import build_row

    torch.manual_seed(0)
    tokenizer = toy.build_tokenizer()
    model = toy.build_model(len(tokenizer))
    config = AsyncGRPOConfig(num_generations=8, num_sampler_logprobs=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prompts = toy.make_dataset(64, seed=0)
    mean_rewards = []
    for step in range(240):
        samples, rewards = [], []
        for group_id in range(4):
            row = prompts[(4 * step + group_id) % len(prompts)]
            prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                   return_dict=False)
            model.set_attn_implementation("sdpa")
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt] * 8), do_sample=True, top_k=0,
                                     max_new_tokens=6, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=0,
                                     eos_token_id=tokenizer.eos_token_id)
            logprobs = torch.stack(out.logits, 1).log_softmax(-1)    # [8, T, V] the sampler's q
            completions = []
            for ids, lp in zip(out.sequences[:, len(prompt):].tolist(), logprobs):
                eos = tokenizer.eos_token_id
                n = ids.index(eos) + 1 if eos in ids else len(ids)
                completions.append((ids[:n], lp[:n]))
            texts = [tokenizer.decode(c, skip_special_tokens=True) for c, _ in completions]
            r = np.array(toy.sum_reward(None, texts, [row["answer"]] * 8))
            rewards.extend(r)
            if r.std() == 0:
                continue                                          # a flat group teaches nothing
            for (ids, lp), advantage in zip(completions, (r - r.mean()) / r.std()):
                L = len(prompt) + len(ids)
                P = len(prompt)
                sampler = np.zeros(L, np.float32)                           # [L]
                sampler[P:] = lp.gather(1, torch.tensor(ids)[:, None])[:, 0].numpy()
                top = lp.topk(8, -1)
                top_ids = np.full((L, 8), -1)                               # [L, 8]
                top_ids[P:] = top.indices.numpy()
                top_lps = np.full((L, 8), -np.inf, np.float32)              # [L, 8]
                top_lps[P:] = top.values.numpy()
                mask = np.r_[np.zeros(P), np.ones(len(ids))].astype(np.int8)
                samples.append(RolloutSample(np.array(prompt + ids), mask, sampler,
                                             float(advantage), group_id, 0, top_ids=top_ids,
                                             top_logprobs=top_lps))
        mean_rewards.append(np.mean(rewards))
        if not samples:
            continue
        packed = build_row(samples).pack()
        tree_attention.install(model, "sdpa")
        out = tree_attention.forward_row(model, packed, model.model)
        hidden = out.last_hidden_state[0]                                   # [N, H]
        loss, _ = compute_loss(hidden, model.lm_head.weight, None, packed, config,
                               StepTotals.of([packed]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    first, last = np.mean(mean_rewards[:20]), np.mean(mean_rewards[-40:])
    assert last > 0.15 and last > 3 * first, (first, last)   # measured: 0.04 -> 0.21 (seeded, CPU)
