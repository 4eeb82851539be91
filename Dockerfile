# GPU image: NGC PyTorch (CUDA, NCCL, Transformer Engine and Apex preinstalled, Python 3.12).
# The same commands as README.md, minus the `cpu` extra (the container's CUDA build of torch is kept).
#   docker build -t align-pipeline .
#   docker run --gpus all --ipc=host -v $PWD:/workspace/align-pipeline align-pipeline kedro run -e gpu
# Mount the checkout itself: data/, the MLflow store (mlflow.db, mlruns/) and conf/local stay on the host after the
# container ends (mounting data/ alone loses every MLflow run). The image's editable install points at this path.
FROM nvcr.io/nvidia/pytorch:25.09-py3

ENV KEDRO_DISABLE_TELEMETRY=true \
    PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0

WORKDIR /workspace/align-pipeline
COPY pyproject.toml README.md ./
COPY src ./src
COPY conf ./conf
COPY data/01_raw ./data/01_raw
RUN pip install --no-cache-dir -e ".[dev]"
COPY tests ./tests
COPY benchmarks ./benchmarks

# Transformer Engine is detected at run time (align_pipeline.model.gpt.have_transformer_engine); on CPU, or without
# TE, the local layer spec with SDPA core attention is used.
CMD ["kedro", "run"]
