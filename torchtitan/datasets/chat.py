"""SFT data: chat / instruction records rendered to tokens, with only the answers trained.

Records come from the `chat` dataset (sources.ChatSource: a jsonl(.gz) file at --training.dataset_path).
A record is one json line, either
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
or  {"prompt": "...", "completion": "..."}  (one user turn and one assistant turn).

Rendering (plain text, so it works with any tokenizer): BOS, then per message "### <Role>:\\n" followed by
its content and "\\n\\n", then EOS. Only assistant contents and the final EOS are training targets; the
headers and every other message are prompt, whose labels become IGNORE_INDEX. Records are packed into
windows like plain documents, so train them with `--training.document_masking` to keep conversations
from attending to each other.
"""

from __future__ import annotations

from torchtitan.components.tokenizer.backends import Tokenizer

ROLES = ("system", "user", "assistant")


def chat_messages(record: dict) -> list[dict]:
    """The messages of a record in either accepted form; ValueError names what is wrong."""
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
    else:
        raise ValueError(f"a chat record needs 'messages' or 'prompt' + 'completion', got keys {sorted(record)}")
    for m in messages:
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"a chat message needs a role in {ROLES} and a string content, got {m!r}")
    return messages


def tokenize_chat(record: dict, tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """(tokens, trained) of a record: trained[i] says whether token i is a training target."""
    tokens, trained = [tokenizer.bos_id], [False]
    for m in chat_messages(record):
        header = tokenizer.encode(f"### {m['role'].capitalize()}:\n", bos=False, eos=False)
        body = tokenizer.encode(m["content"] + "\n\n", bos=False, eos=False)
        tokens += header + body
        trained += [False] * len(header) + [m["role"] == "assistant"] * len(body)
    tokens.append(tokenizer.eos_id)
    trained.append(True)
    return tokens, trained


def tokenize_document(doc: str | dict, tokenizer: Tokenizer) -> tuple[list[int], list[bool] | None]:
    """A plain text (every token trained: None) or a chat record, as the packed stream stores it."""
    if isinstance(doc, str):
        return tokenizer.encode(doc, bos=True, eos=True), None
    return tokenize_chat(doc, tokenizer)
