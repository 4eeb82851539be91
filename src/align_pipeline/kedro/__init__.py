"""The Kedro layer: hooks (MLflow runs, staged data_prep outputs, parameter checks), the config loader, the console,
the run-directory lifecycle and the commands of ``align-pipeline``. Nothing below this layer imports it."""
