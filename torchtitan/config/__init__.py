"""Job configuration: typed sections (job_config) and their loading from TOML and the command line (manager)."""

from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigError, ConfigManager, field_docs, save_config, to_dict, to_toml

__all__ = ["ConfigError", "ConfigManager", "JobConfig", "field_docs", "save_config", "to_dict", "to_toml"]
