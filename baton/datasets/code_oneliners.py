"""The shipped code task (`data/code_oneliners.jsonl`): 42 one-line Python functions to write, each row a prompt, its
tests under "answer" (a JSON list of assert strings, the ground truth the `code_sandbox` reward runs) and a correct
"reference" solution that the tests check against; the reference is never in the prompt, though like every extra
field it rides along to the reward function, which ignores it. `PromptDataset.from_file` reads the file as it is:

    data: {task: files, train_path: baton/datasets/data/code_oneliners.jsonl, max_prompt_len: 96}
    reward_fn: code_sandbox          # or code_sandbox_all: 1 only when every test passes

(the prompts are written for an instruction-following model; the shipped tiny demo models are not one).
"""

from __future__ import annotations

import os

CODE_ONELINERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "code_oneliners.jsonl")


def code_oneliners():
    """The shipped code task as a `PromptDataset`."""
    from baton.datasets.prompts import PromptDataset  # torch, which this module's path constant does not need

    return PromptDataset.from_file(CODE_ONELINERS)
