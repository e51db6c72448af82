"""Benchmarks: each case measures the compared variants side by side in one run and prints their ratio.

    python bench.py planner     # trie_pack.py: unique tokens/s of the planner on a realistic stream (CPU)
    python bench.py packing     # tree vs padding-free packing fwd+bwd through our own code path (GPU; tiny on CPU)
    python bench.py logprobs    # loss.py: chunked vs naive log-prob peak memory and exactness

Speed goals live here, never in timed tests: these machines are noisy, ratios from one run are not.
Each case ends with one summary line `<case> key=value ...` that a script can grep.
"""
import sys

# ---- planner, packing (trie_pack.py, tree_attention.py) -------------------------------------------

# ---- logprobs (loss.py) -------------------------------------------------------------------------


if __name__ == "__main__":
    cases = {name: fn for name, fn in globals().items() if name in ("planner", "packing", "logprobs")}
    if len(sys.argv) < 2 or sys.argv[1] not in cases:
        sys.exit(f"usage: python bench.py {{{'|'.join(cases) or 'planner|packing|logprobs'}}} [args]")
    cases[sys.argv[1]](sys.argv[2:])
