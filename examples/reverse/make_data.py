"""Write the string-reversal task's data: `python make_data.py` (re)writes train.jsonl and val.jsonl beside this file.

Each training line is {"prompt": "reverse: hello=", "answer": "olleh", "demo": "olleh"}: random lower-case words of
3 to 5 letters, a fixed seed, held-out words (val.jsonl: prompt and answer only) that never appear in training.
`demo` is a teacher's demonstration, which SFT imitates: this teacher ends `--teacher-error` (0.8) of its answers
with a period ("yzexobp=" -> "pboxezy."), as a model that formats answers its own way does; the reward wants the
bare reversed word. The files in the repository are this script's output.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string


def make_words(num_words: int, seed: int, min_len: int = 3, max_len: int = 5) -> list[str]:
    """`num_words` distinct random words, in the order drawn."""
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < num_words:
        words["".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len)))] = None
    return list(words)


def write_jsonl(path: str, words: list[str], teacher_error: float | None = None, seed: int = 0) -> None:
    """One line per word; with `teacher_error`, also the teacher's demonstration (`demo`)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for word in words:
            row = {"prompt": f"reverse: {word}=", "answer": word[::-1]}
            if teacher_error is not None:
                row["demo"] = row["answer"] + ("." if rng.random() < teacher_error else "")
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--teacher-error", type=float, default=0.8,
                        help="the share of the teacher's demonstrations that end with a period")
    args = parser.parse_args()
    words = make_words(args.num_train + args.num_val, args.seed)
    write_jsonl(os.path.join(args.out_dir, "train.jsonl"), words[args.num_val:], args.teacher_error, args.seed)
    write_jsonl(os.path.join(args.out_dir, "val.jsonl"), words[: args.num_val])
    print(f"wrote {args.num_train} training and {args.num_val} held-out examples to {args.out_dir}")


if __name__ == "__main__":
    main()
