"""Write an arithmetic task in verl's RL data layout: `python make_data.py` (re)writes train.parquet and val.parquet
beside this file.

Each row is what verl's data preprocessing scripts (examples/data_preprocess/*.py) write:
    data_source   "arithmetic/add" or "arithmetic/sub"   (rewards and validation metrics are grouped by it)
    prompt        [{"role": "user", "content": "12+7="}]  (chat messages; the tokenizer's chat template renders them)
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "19"}
    extra_info    {"split": "train", "index": 0, "a": 12, "b": 7}
Additions and subtractions of operands 0..max_operand, shuffled with a fixed seed; held-out problems never appear in
training. The files in the repository are this script's output with its defaults.
"""

from __future__ import annotations

import argparse
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq


def make_rows(max_operand: int, seed: int) -> list[dict]:
    problems = [(a, op, b) for a in range(max_operand + 1) for b in range(max_operand + 1) for op in "+-"
                if op == "+" or a >= b]  # no negative differences
    random.Random(seed).shuffle(problems)
    return [{
        "data_source": "arithmetic/add" if op == "+" else "arithmetic/sub",
        "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b if op == "+" else a - b)},
        "extra_info": {"split": None, "index": None, "a": a, "b": b},
    } for a, op, b in problems]


def write_parquet(path: str, rows: list[dict], split: str) -> None:
    rows = [{**row, "extra_info": {**row["extra_info"], "split": split, "index": i}} for i, row in enumerate(rows)]
    partial = path + ".partial"
    pq.write_table(pa.Table.from_pylist(rows), partial)
    os.replace(partial, path)  # never a half-written file under the real name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--max-operand", type=int, default=30)
    parser.add_argument("--num-val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = make_rows(args.max_operand, args.seed)
    if args.num_val >= len(rows):
        parser.error(f"--num-val {args.num_val} leaves no training rows out of {len(rows)}")
    write_parquet(os.path.join(args.out_dir, "train.parquet"), rows[args.num_val:], "train")
    write_parquet(os.path.join(args.out_dir, "val.parquet"), rows[: args.num_val], "test")
    print(f"wrote {len(rows) - args.num_val} training and {args.num_val} held-out rows to {args.out_dir}")


if __name__ == "__main__":
    main()
