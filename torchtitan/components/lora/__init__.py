"""LoRA: low-rank adapters trained on a frozen base.

    adapters.py  the `lora` model converter: adapters mixed into the targeted linears, merging them
    export.py    a LoRA checkpoint exported as merged weights or as a PEFT adapter folder
"""

from torchtitan.components import _moved


def __getattr__(name: str):  # `torchtitan.components.lora` was the adapters module before the packages
    return _moved.moved_attribute(__name__, name)
