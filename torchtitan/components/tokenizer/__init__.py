"""Tokenizers: text to token ids and back, and the tokenizer written beside an exported model.

    backends.py   one interface over tiktoken (Llama 3 format, the shipped one), SentencePiece and Hugging Face
                  files; `build_tokenizer` picks the backend from the file
    hf_export.py  the project's tokenizer written as Hugging Face tokenizer files (AutoTokenizer loads them)
"""

from torchtitan.components import _moved


def __getattr__(name: str):  # `torchtitan.components.tokenizer` was the backends module before the packages
    return _moved.moved_attribute(__name__, name)
