"""align-pipeline: LLM alignment as a Kedro DAG of Megatron-core jobs."""

__version__ = "0.1.0"
