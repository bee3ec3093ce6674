"""hybridpar: exact context, tensor and data parallelism for hybrid Mamba2/attention LMs."""

from hybridpar.models.hybrid import HybridConfig, HybridLM

__version__ = "0.1.0"
__all__ = ["HybridConfig", "HybridLM", "__version__"]
