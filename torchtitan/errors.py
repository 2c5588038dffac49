"""The errors a user can cause and fix: each is reported as one line and a non-zero exit, never a traceback."""

from torchtitan.components.checkpoint.manager import CheckpointError
from torchtitan.components.faults.training_error import TrainingError
from torchtitan.config import ConfigError
from torchtitan.datasets.sources import DataSourceError
from torchtitan.distributed.parallel_dims import LayoutError


# DataSourceError: said in one line, but restartable (train.py records user errors as restartable).
USER_ERRORS = (ConfigError, LayoutError, FileNotFoundError, TrainingError, ValueError, CheckpointError,
               DataSourceError)
