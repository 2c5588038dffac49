"""The pieces a training run is built from, one package per subsystem (each package's docstring says what it owns):

    checkpoint/     the checkpoint manager (DCP save/load/resume), its on-disk folder format and retention,
                    content checksums, the Hugging Face folder reader/writer, one-process model access for scripts
    optim/          the optimizer builder and container, the LR schedule, Muon and its distributed step
    lora/           LoRA adapters (a model converter) and their export as merged weights or a PEFT folder
    moe/            Mixture-of-Experts layers: args, router, experts, the MoE layer, the load-balance update
    quantization/   model converters (the registry) and Float8 training
    faults/         the numerics guard (loss/grad spikes), the cross-replica weight check, their TrainingError
    tokenizer/      the tokenizer backends (tiktoken, SentencePiece, Hugging Face) and their HF export
    loss.py         cross entropy (plain, chunked), the ignore index
    metrics.py      the metrics: metrics.jsonl, console, TensorBoard, W&B; throughput and MFU
    validate.py     the validator (loss on a held-out split)
    train_state.py  the trainer's own resumable state (step, tokens seen)

Modules that moved here from `torchtitan/components/*.py` keep their old import path for one release, with a
DeprecationWarning (`_moved.py`).
"""

from torchtitan.components import _moved

_moved.install_finder()


def __getattr__(name: str):
    return _moved.package_getattr(__name__, name)
