"""The stateful data loader the trainer iterates: microbatches of this rank's slice of each global batch."""

import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.tokenizer import Tokenizer
from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.packing import GlobalBatchSlicer
from torchtitan.datasets.sources import open_documents


def build_text_dataloader(
    *,
    tokenizer: Tokenizer,
    job_config: JobConfig,
    split: str,
    dp_rank: int,
    dp_degree: int,
    global_batch_size: int,
    local_batch_size: int,
    infinite: bool,
) -> StatefulDataLoader:
    """Batches of `local_batch_size` (input, label) pairs, [B, seq_len] each, from `training.dataset`.

    Consecutive batches of one rank make up that rank's slice of one global batch (gradient-accumulation
    microbatches), so global_batch_size must be a multiple of local_batch_size x dp_degree.
    num_workers=0 keeps the saved state exact (no prefetched, unaccounted batches).
    """
    t = job_config.training
    source = open_documents(t.dataset, t.dataset_path, split)
    ds = GlobalBatchSlicer(
        source,
        tokenizer,
        seq_len=t.seq_len,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        infinite=infinite,
    )
    with warnings.catch_warnings():  # torchdata calls a deprecated torch hook on construction; harmless
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(ds, batch_size=local_batch_size, num_workers=0, drop_last=True)
