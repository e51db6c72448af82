"""The core's line ledger (README: What the core's lines buy): each feature beyond the spec with the
code lines of the functions that carry it, and the core's total, in the budget's unit (code lines:
no docstrings, comments or blank lines, as the project's budget counts them).

    python -m tools.ledger          # one line per feature, then the core's total

A feature is a list of (file, name): a top-level function or class, a method ("Class.method"), or
"*" for the whole file; a name ending in "*" takes every top-level name it begins. A function is
counted whole, from its decorators to its end: a check inside a spec function is not counted, so
each figure is a floor. tests/test_ledger.py holds the README's table to this output.
"""
import ast
import io
import os
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FEATURES = {
    "verification": [
        ("verify_sync.py", "*"), ("weight_sync.py", "take_out_unverified"),
        ("rollout/servers.py", "drop_unverified")],
    "replicas": [
        ("weight_sync.py", "Members"), ("weight_sync.py", "WeightSync._regroup"),
        ("weight_sync.py", "WeightSync._restarted"), ("weight_sync.py", "WeightSync._lost"),
        ("rollout/servers.py", "take_out"), ("rollout/servers.py", "move"),
        ("rollout/servers.py", "readmit")],
    "run safety": [
        ("checkpoint.py", "settings"), ("checkpoint.py", "check_resume"),
        ("checkpoint.py", "claim"), ("checkpoint.py", "fsync*"), ("metrics.py", "cut_back"),
        ("checkpoint.py", "hold"), ("checkpoint.py", "open_run"), ("checkpoint.py", "read"),
        ("checkpoint.py", "damaged_in")],
    "peft variants": [
        ("lora_sync.py", "Delta"), ("lora_sync.py", "merge_plan"),
        ("lora_sync.py", "merge_refusal"), ("lora_sync.py", "choose")],
    "signal guards": [
        ("rollout/scoring.py", "checked_column"), ("rollout/samples.py", "check_turn"),
        ("train.py", "count_skipped"), ("train.py", "check_skipped"),
        ("rollout/loop.py", "AsyncRolloutLoop._untrained"),
        ("rollout/loop.py", "AsyncRolloutLoop._too_long"),
        ("rollout/loop.py", "AsyncRolloutLoop._failed"),
        ("rollout/tool_calls.py", "call_maybe_async")],
    "KV cap": [
        ("rollout/servers.py", "ConcurrencyCap"), ("rollout/servers.py", "Replica.poll"),
        ("rollout/servers.py", "poll_all")],
    "main-script hazard": [
        ("rollout/worker.py", "_FindMain"), ("rollout/worker.py", "check_picklable"),
        ("rollout/worker.py", "spawn"), ("rollout/worker.py", "check_main_guard"),
        ("rollout/worker.py", "_under_main_guard")],
    "exactly-once": [
        ("rollout/prompts.py", "ResumeIndex"), ("rollout/worker.py", "RolloutWorker.resume_index"),
        ("rollout/worker.py", "RolloutWorker.resume_state")],
    "staleness": [
        ("rollout/staleness.py", "*"), ("rollout/loop.py", "AsyncRolloutLoop._admissible")],
    "evaluation": [
        ("rollout/loop.py", "AsyncRolloutLoop._eval_loop"),
        ("rollout/loop.py", "AsyncRolloutLoop._evaluate"),
        ("rollout/loop.py", "AsyncRolloutLoop._score_eval"), ("rollout/scoring.py", "eval_*"),
        ("rollout/scoring.py", "pass_at"), ("rollout/worker.py", "RolloutWorker.evaluate"),
        ("rollout/worker.py", "RolloutWorker.evaluations"),
        ("rollout/prompts.py", "check_eval_source"), ("metrics.py", "MetricsLog.evaluate")],
    "objectives": [
        ("loss.py", "StepTotals"), ("loss.py", "sample_mean"), ("loss.py", "normalized")],
    "reference KL": [
        ("train.py", "reference_policy"), ("train.py", "Policy.logprobs"),
        ("loss.py", "row_logprobs")],
    "hashed trie": [
        ("trie_pack.py", "node_keys"), ("trie_pack.py", "_mix"),
        ("trie_pack.py", "TreeRow._exists"), ("trie_pack.py", "TreeRow._lookup")],
}


def code_line_numbers(path: str) -> set[int]:
    """The numbers of the lines of `path` that hold code: not blank, a comment or a docstring."""
    src = open(path, encoding="utf-8").read()
    docs = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docs.update(range(first.lineno, first.end_lineno + 1))
    code = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return code


def spans(path: str) -> dict[str, range]:
    """{name: its lines} of the top-level functions and classes of `path`, and of the classes'
    methods as "Class.method"; a span starts at the first decorator."""
    out = {}

    def visit(node, prefix: str) -> None:
        for child in node.body:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                out[prefix + child.name] = range(start, child.end_lineno + 1)
                if isinstance(child, ast.ClassDef) and not prefix:
                    visit(child, child.name + ".")
    visit(ast.parse(open(path, encoding="utf-8").read()), "")
    return out


def feature_lines(items: list[tuple[str, str]], root: str = ROOT) -> int:
    """The code lines of `items` (FEATURES' form); KeyError naming an item that is not found."""
    lines = set()
    for file, name in items:
        path = os.path.join(root, file)
        code = code_line_numbers(path)
        if name == "*":
            lines |= {(file, n) for n in code}
            continue
        found = spans(path)
        picked = [s for key, s in found.items()
                  if key == name or (name.endswith("*") and "." not in key
                                     and key.startswith(name[:-1]))]
        if not picked:
            raise KeyError(f"tools.ledger: {file} has no {name}")
        lines |= {(file, n) for s in picked for n in s if n in code}
    return len(lines)


def core_lines(root: str = ROOT) -> int:
    """Code lines of the core: the top-level modules and rollout/."""
    files = [f for f in os.listdir(root) if f.endswith(".py")]
    files += [os.path.join("rollout", f) for f in os.listdir(os.path.join(root, "rollout"))
              if f.endswith(".py")]
    return sum(len(code_line_numbers(os.path.join(root, f))) for f in files)


def ledger(root: str = ROOT) -> dict[str, int]:
    return {feature: feature_lines(items, root) for feature, items in FEATURES.items()}


def main(argv: list[str]) -> None:
    for feature, lines in ledger().items():
        print(f"{feature:20s} {lines:5d}")
    print(f"{'core':20s} {core_lines():5d}")


if __name__ == "__main__":
    main(sys.argv[1:])
