"""torchtitan: PyTorch-native LLM pretraining."""

__version__ = "0.1.0"  # keep in step with pyproject.toml; recorded in every checkpoint manifest
