"""Checkpoints: how a run's state reaches disk and comes back.

    manager.py        CheckpointManager: DCP save (sync/async), load, resume, export and seed checkpoints
    folders.py        the on-disk folder format: naming, completion manifest, validation, retention
    checksums.py      content checksums of checkpoint files (written with the manifest, checked on load)
    hf_folder.py      Hugging Face folders (config.json + safetensors) read into and written from a model
    offline_model.py  one-process model access for scripts: build the model of a checkpoint on CPU, load it

Outside this package, code imports `manager`, `hf_folder` and `offline_model`; `folders` and `checksums` are the
manager's internals (the import contract in .importlinter holds that).
"""

from torchtitan.components import _moved


def __getattr__(name: str):  # `torchtitan.components.checkpoint` was the manager module before the packages
    return _moved.moved_attribute(__name__, name)
