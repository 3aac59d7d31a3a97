"""Reading prompt files (.jsonl, .parquet) into rows, with the file and line of anything that cannot be read."""

from __future__ import annotations

import json
import os
from typing import Any

from baton.config import ConfigError


class DataError(ConfigError):
    """Bad prompt data: a file that cannot be read, or a row without a usable prompt or answer. Names the file,
    the row and the fix. A ConfigError, so the CLI reports it without a traceback."""


def read_rows(path: str, example: dict[str, str] | None = None) -> tuple[list[Any], list[int], str]:
    """(rows, positions, unit) of a `.jsonl` or `.parquet` file: each row as parsed, not yet checked. example: the
    fields a row should have, as {field: "..."} (the data's prompt_key and answer_key), shown in the error of a line
    that is not JSON; default {"prompt": "...", "answer": "..."}.

    A row's position is its 1-based line number in a jsonl file (unit "line"; blank lines count but give
    no row) or its 0-based index in a parquet file (unit "row"). Parquet rows come as JSON would give them:
    struct columns (verl's `reward_model`, `extra_info`) as dicts, list columns (chat messages) as lists.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path} does not exist")
    if path.endswith(".jsonl"):
        return *_read_jsonl(path, json.dumps(example or {"prompt": "...", "answer": "..."})), "line"
    if path.endswith(".parquet"):
        rows = _read_parquet(path)
        return rows, list(range(len(rows))), "row"
    raise DataError(f"{path}: prompt files must end in .jsonl or .parquet")


def _read_jsonl(path: str, example: str) -> tuple[list[Any], list[int]]:
    rows, lines = [], []
    offset = 0  # of the line's first byte in the file
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}, line {number}: the byte {raw[e.start:e.start + 1]!r} at byte offset "
                                f"{offset + e.start} of the file (byte {e.start + 1} of the line) is not UTF-8; "
                                "save the file as UTF-8") from e
            offset += len(raw)
            text = text.rstrip("\r\n")  # so that a JSON error's column is on this line
            if number == 1:
                text = text.removeprefix("\ufeff")  # a byte-order mark some editors write
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {number}: not valid JSON ({e.msg}, column {e.colno}); each line must "
                                f"hold one JSON object such as {example}") from e
            except RecursionError:
                raise DataError(f"{path}, line {number}: nested too deeply to be a row; each line must hold one "
                                f"flat JSON object such as {example}") from None
            try:
                json.dumps(row, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise DataError(f"{path}, line {number}: a lone surrogate (an unpaired \\uD800-\\uDFFF escape) is not "
                                "text; remove it") from None
            rows.append(row)
            lines.append(number)
    return rows, lines


def _read_parquet(path: str) -> list[dict[str, Any]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading parquet needs pyarrow: pip install pyarrow") from None
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot be read as parquet: {e}") from e
