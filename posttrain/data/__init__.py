"""Data: rows from local files or the embedded task, the train/held-out split, seeded draws, and token ids."""

from posttrain.data.rows import (
    RowSampler,
    check_fields,
    completion_texts,
    load_splits,
    prompt_ids,
    prompt_messages,
    prompt_texts,
    read_rows,
    response_ids,
    uses_chat,
)

__all__ = ["RowSampler", "check_fields", "completion_texts", "load_splits", "prompt_ids", "prompt_messages",
           "prompt_texts", "read_rows",
           "response_ids", "uses_chat"]
