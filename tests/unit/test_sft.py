"""SFT: chat records are packed with their prompts masked out of the loss (IGNORE_INDEX), so prompt tokens
get exactly zero gradient while answers train."""

import json

import pytest
import torch

from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.config import ConfigManager
from torchtitan.datasets.chat import tokenize_chat
from torchtitan.datasets.dataloader import build_text_dataloader
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer

RECORDS = [
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": f"What is {i} plus {i}?"},
                  {"role": "assistant", "content": f"It is {2 * i}."}]}
    if i % 2 else {"prompt": f"Name the module number {i}.", "completion": f"Module {i} is os.path."}
    for i in range(1, 40)
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


@pytest.fixture
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def test_only_answers_and_the_final_eos_are_targets(tok):
    tokens, trained = tokenize_chat(RECORDS[0], tok)
    answer = [t for t, keep in zip(tokens, trained) if keep]
    assert tok.decode(answer[:-1]) == "It is 2.\n\n" and answer[-1] == tok.eos_id
    assert tokens[0] == tok.bos_id and not trained[0]


def test_bad_record_is_named():
    with pytest.raises(ValueError, match="'messages' or 'prompt' \\+ 'completion'"):
        tokenize_chat({"question": "?"}, build_tokenizer(None))


def test_prompt_tokens_get_zero_gradient(tok, chat_file):
    cfg = ConfigManager().parse_args(["--training.dataset", "chat", "--training.dataset_path", str(chat_file),
                                      "--training.seq_len", "64", "--training.document_masking"])
    loader = build_text_dataloader(tokenizer=tok, job_config=cfg, split="train", dp_rank=0, dp_degree=1,
                                   global_batch_size=4, local_batch_size=4, infinite=True)
    inputs, labels = next(iter(loader))
    masked = labels == IGNORE_INDEX
    assert 0.2 < masked.float().mean() < 0.9  # prompts and answers are both there
    torch.manual_seed(0)
    model = Transformer(TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=tok.vocab_size,
                                             multiple_of=16, max_seq_len=64))
    model.init_weights()
    logits = model(inputs["tokens"], document_ids=inputs["document_ids"])
    logits.retain_grad()
    loss = cross_entropy_sum(logits, labels) / (~masked).sum()  # normalised by the trained-token count
    loss.backward()
    per_position = logits.grad.abs().amax(-1)
    assert torch.all(per_position[masked] == 0)  # exactly zero at every prompt position
    assert torch.all(per_position[~masked] > 0)
