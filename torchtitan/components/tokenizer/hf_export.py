"""The project's tokenizer written as Hugging Face tokenizer files, so `AutoTokenizer.from_pretrained(folder)`
loads the same tokenizer from an exported model folder.

- tiktoken (Llama 3 format, the shipped one): converted to a byte-level BPE `tokenizer.json` with the
  `tokenizers` package. tiktoken merges, at each step, the adjacent pair whose concatenation has the lowest
  rank; a BPE whose merges are ordered by the rank of the token they make (ties by the parts' ranks) picks
  the same pair, so the ids are the same. The Llama 3 split pattern and specials come along, and a
  post-processor puts BOS first, as the project's `encode(bos=True)` does.
- Hugging Face `tokenizer.json`: copied, with its tokenizer_config.json when there is one.
- SentencePiece `.model`: copied as tokenizer.model with a LlamaTokenizer config (transformers converts it).
Each also gets tokenizer_config.json and special_tokens_map.json naming BOS and EOS.
"""

import json
import os
import shutil

from torchtitan.components.tokenizer.backends import (
    LLAMA3_PATTERN,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    load_tiktoken_ranks,
)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte, which byte-level BPE vocabularies are spelled in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tiktoken_to_hf(tok: TiktokenTokenizer):
    """A `tokenizers.Tokenizer` giving the same ids as `tok`."""
    from tokenizers import AddedToken, Regex, Tokenizer as HfTokenizer, decoders, models, pre_tokenizers, processors

    ranks = load_tiktoken_ranks(tok.path)
    alphabet = _byte_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            a, b = token[:i], token[i:]
            if ranks.get(a, rank) < rank and ranks.get(b, rank) < rank:
                merges.append((rank, ranks[a], ranks[b], spell(a), spell(b)))
    merges.sort()
    vocab = {spell(t): r for t, r in ranks.items()}
    hf = HfTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], ignore_merges=True,
                                fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    bos = [k for k, v in tok.special_tokens.items() if v == tok.bos_id][0]
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_id)]
    )
    return hf


def save_hf_tokenizer(tok: Tokenizer, folder: str) -> None:
    """Writes `tok` into `folder` as Hugging Face tokenizer files (see the module docstring)."""
    # split_special_tokens: special-token spellings inside text are ordinary text, as in the project's encode.
    config: dict = {"clean_up_tokenization_spaces": False, "model_max_length": 1 << 30, "split_special_tokens": True}
    if isinstance(tok, TiktokenTokenizer):
        hf = tiktoken_to_hf(tok)
        hf.save(os.path.join(folder, "tokenizer.json"))
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        names = {v: k for k, v in tok.special_tokens.items()}
    elif isinstance(tok, HuggingFaceTokenizer):
        shutil.copyfile(tok.path, os.path.join(folder, "tokenizer.json"))
        source = tok.path.parent / "tokenizer_config.json"
        if source.is_file():
            with open(source) as f:
                config = json.load(f)
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        names = {tok.bos_id: tok._tok.id_to_token(tok.bos_id), tok.eos_id: tok._tok.id_to_token(tok.eos_id)}
    elif isinstance(tok, SentencePieceTokenizer):
        shutil.copyfile(tok.path, os.path.join(folder, "tokenizer.model"))
        config["tokenizer_class"] = "LlamaTokenizer"
        names = {tok.bos_id: tok._sp.id_to_piece(tok.bos_id), tok.eos_id: tok._sp.id_to_piece(tok.eos_id)}
    else:
        raise ValueError(f"no Hugging Face form for tokenizer {type(tok).__name__}")
    special = {"bos_token": names[tok.bos_id], "eos_token": names[tok.eos_id]}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({**config, **special}, f, indent=2)
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)
