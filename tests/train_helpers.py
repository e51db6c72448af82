"""Module-level rewards for the trainer tests (the rollout process imports them by name)."""
import os


def recorded_reward(prompts, completions, index, **kwargs) -> list[float]:
    """Distinct rewards (never a flat group) and, when TRAIN_TEST_RECORD names a file, the dataset row
    index of every scored group appended to it (the resume test reads which prompts ran)."""
    path = os.environ.get("TRAIN_TEST_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(f"{index[0]}\n")
    return [float(i) + 0.1 * len(str(c)) for i, c in enumerate(completions)]

