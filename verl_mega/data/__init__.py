"""Prompt datasets (JSONL / JSON / parquet, verl's schema, chat templates, held compactly; resumable DP-sharded
batches) and generated tasks."""

from verl_mega.data.arithmetic import REWARD_SPEC as ARITHMETIC_REWARD_SPEC
from verl_mega.data.arithmetic import generate_arithmetic, write_arithmetic_jsonl
from verl_mega.data.prompts import (
    PromptBatch,
    PromptDataError,
    PromptDataset,
    PromptItem,
    PromptLoader,
    PromptRecord,
    load_prompt_records,
)
from verl_mega.data.records import iter_prompt_records
from verl_mega.data.tasks import GENERATED_TASKS, GeneratedTask, generated_task, is_generated

__all__ = [
    "ARITHMETIC_REWARD_SPEC",
    "generate_arithmetic",
    "write_arithmetic_jsonl",
    "PromptBatch",
    "PromptDataError",
    "PromptDataset",
    "PromptItem",
    "PromptLoader",
    "PromptRecord",
    "load_prompt_records",
    "iter_prompt_records",
    "GENERATED_TASKS",
    "GeneratedTask",
    "generated_task",
    "is_generated",
]
