"""torchrun entry points, one recipe per stage (``python -m align_pipeline.train.<stage> --config <json>``); the
toolbox they call is :mod:`align_pipeline.train.core`."""

import warnings

# Without Apex/TE megatron-core warns once per rank per module that it falls back to torch implementations; that is
# the expected configuration on CPU (and SDPA/TorchNorm replace the fused kernels), so keep the logs readable.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex|Apex) (are|is) not installed.*")
