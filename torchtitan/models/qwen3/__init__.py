"""Qwen3 (dense): flavors and the train spec that registers the model with the trainer.

Written only against torchtitan.protocols (the model protocol, BaseModelArgs, StateDictAdapter, TrainSpec);
the framework's shared pieces it uses are the attention kernel, the parallelism appliers and the pipeline
builder. docs/adding_a_model.md walks through this folder.
"""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.datasets.dataloader import build_text_dataloader
from torchtitan.distributed.pipeline import pipeline_model
from torchtitan.models.common.qwen3_args import Qwen3ModelArgs
from torchtitan.models.qwen3.flavors import qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.models.common.qwen3_state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

__all__ = ["Qwen3", "Qwen3ModelArgs", "qwen3_flavors"]

register_train_spec(
    TrainSpec(
        name="qwen3",
        model_cls=Qwen3,
        flavors=qwen3_flavors,
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_model,
        build_tokenizer_fn=lambda job_config: build_tokenizer(job_config.model.tokenizer_path),
        build_dataloader_fn=build_text_dataloader,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=Qwen3StateDictAdapter,
    )
)
