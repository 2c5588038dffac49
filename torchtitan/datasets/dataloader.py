"""The stateful data loader the trainer iterates: microbatches of this rank's slice of each global batch."""

import warnings
from pathlib import Path

from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.tools import storage
from torchtitan.components.tokenizer.backends import Tokenizer
from torchtitan.config.job_config import JobConfig
from torchtitan.datasets.packing import (
    ExhaustedPolicy,
    GlobalBatchSlicer,
    ReadRetry,
    SampleFeatures,
    ShardWindows,
    TextWindows,
    WindowSource,
)
from torchtitan.datasets.schedule import mixture_schedule, source_weight
from torchtitan.datasets.shards import open_shards
from torchtitan.datasets.sources import DATASETS, open_documents


def parse_mixture(entries: list[str]) -> list[tuple[str, float]]:
    """`training.datasets` entries "SOURCE:WEIGHT" -> [(source, weight)]; ValueError names a bad entry."""
    out = []
    for entry in entries:
        source, value = source_weight(entry)
        if value < 0:
            raise ValueError(
                f"--training.datasets entry {entry!r} must be SOURCE:WEIGHT with a positive weight (or 0: a source "
                f"that a later --training.mixture_phases phase brings in), e.g. stdlib_docs:0.7 or /data/shards/web:0.3"
            )
        out.append((source, value))
    if out and not any(w > 0 for _, w in out):
        raise ValueError(f"--training.datasets {','.join(entries)} gives no source a positive weight")
    return out


def open_window_source(
    source: str, dataset_path: str | None, split: str, tokenizer: Tokenizer, window: int, policy: ExhaustedPolicy,
    retry: ReadRetry = ReadRetry(),
) -> WindowSource:
    """A registered dataset name (tokenized as it is read) or a folder written by
    `python -m torchtitan.datasets.pretokenize` (its `<split>/` shards)."""
    if is_dataset_name(source):
        # open_documents names the valid datasets (and the nearest one) for an unknown name.
        return TextWindows(open_documents(source, dataset_path, split), tokenizer, window, policy, retry=retry)
    folder = check_shard_folder(source, split)
    return ShardWindows(open_shards(storage.join(str(folder), split), tokenizer), window, policy,
                        name=storage.basename(str(folder)))


def is_dataset_name(source: str) -> bool:
    """A registered dataset name (or a mistyped one), as opposed to a shard folder's path."""
    return source in DATASETS or ("/" not in source and not Path(source).exists())


def check_shard_folder(source: str, split: str) -> Path | str:
    """The shard folder `source` (a path, or an object store URL), which must hold the `split` split;
    FileNotFoundError with one line if not."""
    if storage.is_url(source):
        folder = source.rstrip("/")
        if not storage.isdir(folder):
            raise FileNotFoundError(f"shard folder {folder} does not exist or is empty (upload a folder written by "
                                    f"python -m torchtitan.datasets.pretokenize there)")
        if not storage.isdir(storage.join(folder, split)):
            raise FileNotFoundError(f"shard folder {folder} has no {split}/ split")
        return folder
    folder = Path(source)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"shard folder {folder} does not exist (write it with python -m torchtitan.datasets.pretokenize)"
        )
    if not (folder / split).is_dir():
        raise FileNotFoundError(
            f"shard folder {folder} has no {split}/ split; write it with "
            f"`python -m torchtitan.datasets.pretokenize ... --split {split} --output {folder}`"
        )
    return folder


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
    """Batches of `local_batch_size` (inputs, labels) pairs, [B, seq_len] each, from `training.dataset` or
    the mixture `training.datasets`. `inputs` is the token tensor, or a dict of it and per-token features
    (document_ids, positions, source_ids) when document masking or a mixture asks for them.

    Consecutive batches of one rank make up that rank's slice of one global batch (gradient-accumulation
    microbatches), so global_batch_size must be a multiple of local_batch_size x dp_degree.
    num_workers=0 keeps the saved state exact (no prefetched, unaccounted batches).
    """
    t = job_config.training
    policy: ExhaustedPolicy = t.dataset_exhausted if infinite else "end"
    if t.datasets and t.dataset_path:
        raise ValueError(
            "--training.dataset_path applies to --training.dataset only; a --training.datasets mixture names "
            "datasets at their default location or shard folders (pre-tokenize local files first)"
        )
    mixture = parse_mixture(t.datasets) if t.datasets else [(t.dataset, 1.0)]
    # Validation reads the base mixture: its per-source losses stay comparable across the phases.
    weights = mixture_schedule(job_config, mixture) if infinite else [w for _, w in mixture]
    path, retry = t.dataset_path, ReadRetry(t.source_retries, t.source_retry_backoff_s)
    sources = [open_window_source(s, path, split, tokenizer, t.seq_len + 1, policy, retry) for s, _ in mixture]
    features = SampleFeatures(
        document_ids=t.document_masking,
        document_positions=t.document_positions,
        source_ids=len(sources) > 1,  # loss/<source>, and validation/loss/<source>
        bos_id=tokenizer.bos_id,
    )
    ds = GlobalBatchSlicer(
        sources,
        weights,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        seed=job_config.debug.seed or 0,
        features=features,
    )
    with warnings.catch_warnings():  # torchdata calls a deprecated torch hook on construction; harmless
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(ds, batch_size=local_batch_size, num_workers=0, drop_last=True)
