"""Evaluation logic shared by the evaluation job and the Kedro layer: promotion gates and the evaluation report."""
