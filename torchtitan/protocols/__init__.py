"""The contracts between the framework and a model folder. Read these first when adding a model.

    model.py               what the appliers and the trainer rely on in a model and its args; the model
                           output (logits + auxiliary losses + metrics) and inputs beyond tokens
    state_dict_adapter.py  the base class of a model's Hugging Face adapter
    train_spec.py          TrainSpec: a model's name -> its builders and hooks, and the registry

The trainer, the parallelism appliers and the tools use only these; a model folder implements them.
"""

from torchtitan.protocols.model import BaseModelArgs, ModelOutput, ModelProtocol, as_model_output, split_inputs
from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec, get_flavor, get_train_spec, register_train_spec

__all__ = [
    "BaseModelArgs",
    "ModelOutput",
    "ModelProtocol",
    "StateDictAdapter",
    "TrainSpec",
    "as_model_output",
    "get_flavor",
    "get_train_spec",
    "register_train_spec",
    "split_inputs",
]
