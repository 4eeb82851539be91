"""``data_prep``: validate the raw jsonl, build the tokenizer, tokenize/mask/pad/split, persist the artifacts."""

from .pipeline import create_pipeline, create_regression_pipeline  # noqa: F401
