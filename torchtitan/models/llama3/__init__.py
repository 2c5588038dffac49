"""Llama 3 / 3.1: flavors and the train spec that registers the model with the trainer.

To add an architecture, copy this folder, change model.py/args.py/flavors.py and the plan in
parallelize.py, give the spec a new name, and import the folder from torchtitan/models/__init__.py.
"""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.datasets.dataloader import build_text_dataloader
from torchtitan.distributed.pipeline import pipeline_model
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

__all__ = ["Transformer", "TransformerModelArgs", "llama3_flavors"]

register_train_spec(
    TrainSpec(
        name="llama3",
        model_cls=Transformer,
        flavors=llama3_flavors,
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_model,
        build_tokenizer_fn=lambda job_config: build_tokenizer(job_config.model.tokenizer_path),
        build_dataloader_fn=build_text_dataloader,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=Llama3StateDictAdapter,
    )
)
