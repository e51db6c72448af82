"""The toy task: the tiny model, tokenizer, prompts and rewards that stand in for the spec's hub
model and dataset, so the demo and every test run with HF_HUB_OFFLINE=1 (spec: クイックスタート
(Quick start), offline).

    python toy.py --save /tmp/toy       # config.json, model.safetensors, tokenizer.json, template
    VLLM_SERVER_DEV_MODE=1 python -m local_vllm.server --model toy   # the warmed-up model, cached

The task, one prompt of it (the demo's: standard format, sums drawn evenly, exact_reward):

    prompt      "3+4="                      answer "7"   (a, b in 0..4: one digit)
    completion  "7<|im_end|>" 1.0 · "6<|im_end|>" 0.0 · "2<|im_end|>" 0.0
    conversational (make_dataset's default, the tests'): [{"role": "user", "content": "3+4="}]
                rendered <|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n

The model is a ~0.3M-parameter Qwen3 shape over a character-level tokenizer (printable ASCII plus
Qwen's special and tool tokens), saved with save_pretrained so everything loads it like a hub model.
RL starts from a pretrained model, so the demo's model (ensure_saved) first gets a supervised
warm-up on every sum: one digit, right WARM_HINT of the time (else random), then the end of turn;
it answers in the format and half-knows the arithmetic, which RL sharpens. RL trains on 20 of the
25 sums; the other 5 (HELD_OUT) are the demo's evaluation (train.py --eval_strategy steps).
TRAIN_DEFAULTS are what `python train.py` changes from AsyncGRPOConfig; `python -m tools.bench
learn` runs it.

Departures: the spec trains hub models (our machines have none); the chat template follows Qwen's
layout (`<tools>` in the system turn, `<tool_call>{json}</tool_call>`, `<tool_response>` as user);
the demo's prompts are plain text: as chat turns the same model plateaus lower (~0.75 against ~0.9,
in-process runs of 4 seeds: the operands sit 9 tokens further from the answer).
"""
import argparse
import os
import random

import torch
from datasets import Dataset
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]  # printable ASCII, newline, tab

CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    'Call a tool with <tool_call>{"name": <name>, "arguments": <json>}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '<tool_call>{"name": "{{ fn.name }}", "arguments": {{ fn.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level BPE (no merges) over printable ASCII, plus Qwen's special and tool tokens."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # characters join without separators
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>",
        chat_template=CHAT_TEMPLATE, padding_side="left", model_max_length=1024,
    )


def build_model(vocab_size: int, seed: int = 0):
    """A Qwen3-shaped causal LM with ~0.3M parameters, random init (deterministic for a seed)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM   # the rollout process needs none
    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=SPECIAL.index("<|im_end|>"), pad_token_id=0,   # the generation config's too
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


def warm_up(model, tokenizer, steps: int = 100, batch: int = 64, seed: int = 0,
            standard: bool = False, hint: float = 0.0) -> float:
    """Supervised warm-up on the answer format: each prompt is followed by a digit and the end of
    turn, so the model learns to answer with one digit and stop; the digit is the sum `hint` of
    the time, else random (hint 0: the format only, RL learns the arithmetic). Prompts are chat
    turns, or `standard`: the plain text "3+4=" the demo trains on. Returns the last loss (hint 0:
    floor ln 10, the digit is a coin of 10 faces)."""
    rng = random.Random(seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    sums = [a + b for a in range(5) for b in range(5)]
    pairs = [f"{a}+{b}=" for a in range(5) for b in range(5)]
    if standard:
        prompts = [tokenizer.encode(p, add_special_tokens=False) for p in pairs]
    else:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                 add_generation_prompt=True, return_dict=False)
                   for p in pairs]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        rows = []
        for _ in range(batch):
            k = rng.randrange(len(pairs))
            right = hint and rng.random() < hint
            rows.append(prompts[k] + [digits[sums[k] if right else rng.randrange(10)], end])
        ids = torch.tensor(rows)                                                 # [B, L]
        logits = model(input_ids=ids[:, :-1]).logits[:, -2:]                     # [B, 2, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, -2:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return loss.item()


def save(path: str, seed: int = 0, warm: bool = False) -> str:
    """Write the toy model and tokenizer to `path` (random init, or `warm`: after warm_up)."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed)
    if warm:
        warm_up(model, tokenizer, steps=200, seed=seed, standard=True, hint=WARM_HINT)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def ensure_saved(path: str | None = None) -> str:
    """The warmed-up toy model's directory, built on first use (~/.cache/async_grpo/toy-warm-v3)."""
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    path = path or os.path.join(cache, "async_grpo", "toy-warm-v3")
    if not os.path.exists(os.path.join(path, "config.json")):
        tmp = f"{path}.tmp{os.getpid()}"
        save(tmp, warm=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.rename(tmp, path)  # atomic: a concurrent builder either wins or finds it done
        except OSError:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return path


NUM_PROMPTS = 256
WARM_HINT = 0.3     # the warm-up's share of right answers: a pretrained model half-knows the sums
HELD_OUT = ((0, 3), (1, 0), (2, 4), (3, 1), (4, 2))   # (a, b) the demo never trains on: its eval
# `python train.py` (the toy run): what differs from AsyncGRPOConfig's defaults, and why
TRAIN_DEFAULTS = dict(
    output_dir="runs/toy",
    learning_rate=2.5e-4,         # a 0.3M-parameter model after a format-only warm-up, not a 4B one
    epsilon_high=0.28,            # DAPO's clip-higher: slows the entropy collapse of a tiny model
    num_generations=16,           # more rollouts per prompt: the policy keeps exploring longer
    num_train_epochs=26,          # 6-7 min; each prompt 26 times (6,656 groups, most tie late)
    max_completion_length=3,      # one digit and the end of turn, and a token of slack
    max_staleness=1,
    train_sampling_strategy="sequential",  # the balanced prompts in their order, as measured
    max_concurrent_rollouts=64,   # the spec's formula gives 8 (1 × per_device_train_batch_size 8):
                                  # too few to keep the server busy (at 512 tokens a step:
                                  # 32 and 64 alike, 128 slower)
    token_budget=144,             # one row of 4 groups of 16 (prompts shared) per step: many small
                                  # steps at a low rate settle fewer prompts on a wrong digit
    gradient_checkpointing=False, # nothing to save on a model this small
    save_steps=200,
    save_total_limit=2,
)


def make_dataset(n: int = 64, seed: int = 0, standard: bool = False, balanced: bool = False,
                 held_out: bool | None = None) -> Dataset:
    """`n` addition prompts (a, b in 0..4) with an `answer` column: conversational (one user turn)
    or, `standard`, the plain text "a+b=". `balanced` draws the sum first (each of 0..8 equally
    often), then a: uniform (a, b) makes 0+0 and 4+4 1/25 of the prompts, 2+2's sum 5/25.
    held_out: None any pair; False none of HELD_OUT (the demo's training prompts); True the
    HELD_OUT pairs in turn (its evaluation: sums it never trained on)."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        if held_out:
            a, b = HELD_OUT[len(rows) % len(HELD_OUT)]
        elif balanced:
            total = rng.randint(0, 8)
            a = rng.randint(max(0, total - 4), min(4, total))
            b = total - a
        else:
            a, b = rng.randint(0, 4), rng.randint(0, 4)
        if held_out is False and (a, b) in HELD_OUT:
            continue
        text = f"{a}+{b}="
        prompt = text if standard else [{"role": "user", "content": text}]
        rows.append({"prompt": prompt, "answer": str(a + b)})
    return Dataset.from_list(rows)


def _text(completion) -> str:
    """A completion is a message list (conversational) or a string (standard)."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role") == "assistant")


def sum_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 for exactly the answer, 0.5 if the reply starts with it, 0.2 if it contains it, else 0.
    Shaped so that a random-init policy (tests/test_toy.py) sees a signal, only for the right digit:

        completion text        reward   chance per rollout, uniform policy (105 tokens, 8 long)
        exactly the answer       1.0    ~1e-4
        starts with it           0.5    ~1e-2
        contains it              0.2    ~0.07: ~44% of groups of 8 have unequal rewards
    """
    texts = [_text(completion).strip() for completion in completions]
    return [1.0 if text == ans else 0.5 if text.startswith(ans) else 0.2 if ans in text else 0.0
            for text, ans in zip(texts, answer)]


def exact_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """The demo's reward: 1.0 for exactly the answer, else 0. (Partial credit for a near digit makes
    the middle of a range a safe bet that a tiny policy settles on for good: 0+0 → "2", 4+4 → "6".)
    """
    return [float(_text(completion).strip() == ans) for completion, ans in zip(completions, answer)]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum a + b.
    """
    return a + b


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", metavar="DIR", required=True,
                        help="directory to write the model and tokenizer to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(save(args.save, args.seed))
