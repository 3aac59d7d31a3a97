"""Write the string-reversal task's data: `python make_data.py` (re)writes train.jsonl and val.jsonl beside this file.

Each line is {"prompt": "reverse: hello=", "answer": "olleh"}: random lower-case words of 3 to 7 letters, a fixed
seed, and held-out words that never appear in training. The files in the repository are this script's output.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string


def make_words(num_words: int, seed: int, min_len: int = 3, max_len: int = 7) -> list[str]:
    """`num_words` distinct random words, in the order drawn."""
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < num_words:
        words["".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len)))] = None
    return list(words)


def write_jsonl(path: str, words: list[str]) -> None:
    with open(path, "w") as f:
        for word in words:
            f.write(json.dumps({"prompt": f"reverse: {word}=", "answer": word[::-1]}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    words = make_words(args.num_train + args.num_val, args.seed)
    write_jsonl(os.path.join(args.out_dir, "train.jsonl"), words[args.num_val:])
    write_jsonl(os.path.join(args.out_dir, "val.jsonl"), words[: args.num_val])
    print(f"wrote {args.num_train} training and {args.num_val} held-out examples to {args.out_dir}")


if __name__ == "__main__":
    main()
