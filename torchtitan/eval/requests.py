"""Requests of a task as token windows, built exactly as lm-evaluation-harness's `--model hf` builds them.

- multiple_choice: one request per choice, (context, target_delimiter + choice);
  loglikelihood: (context, doc_to_target) — the harness adds no delimiter there;
  loglikelihood_rolling: the document (doc_to_target) alone.
- (context, continuation) pairs: trailing whitespace of the context moves to the continuation, the whole
  string and the context are encoded (with the tokenizer's BOS, as the harness's Hugging Face tokenizer adds
  it), and the continuation is what the whole has beyond the context's tokens. An empty context conditions on
  BOS alone. The model reads (context + continuation)[-(L + 1):][:-1] (the context cut from the left when
  longer than the window L) and the last len(continuation) positions are scored.
- rolling documents: the encoded document is cut into disjoint windows of at most L predicted tokens, the
  first conditioned on BOS, each later one on the L tokens before its end (the harness's
  get_rolling_token_windows with context_len 1, made disjoint); a document's log-likelihood is the sum.

A window is (tokens the model reads, how many of its last positions are scored, the request it adds to).
"""

import dataclasses

from torchtitan.eval.tasks import Task, TaskError


@dataclasses.dataclass
class Window:
    tokens: list[int]
    """What the model reads (at most the window length)."""
    targets: list[int]
    """The tokens predicted at the last len(targets) positions of `tokens` (each the next token)."""
    request: int
    """Index of the request (within its task) whose log-likelihood this window adds to."""


@dataclasses.dataclass
class TaskRequests:
    task: Task
    pairs: list[tuple[str, str]] | list[str]
    """(context, continuation) per request, or the document of a rolling request."""
    windows: list[Window]
    doc_of_request: list[int]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as the harness splits them."""
    if context == "":
        cont = tokenizer.encode(continuation, bos=False, eos=False)
        if cont and cont[0] == tokenizer.bos_id:
            return cont[:1], cont[1:]
        return [tokenizer.bos_id], cont
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, bos=True, eos=False)
    ctx = tokenizer.encode(context, bos=True, eos=False)
    return ctx, whole[len(ctx):]


def pair_window(ctx: list[int], cont: list[int], max_length: int, request: int) -> Window:
    full = ctx + cont
    return Window(full[-(max_length + 1):][:-1], cont, request)


def rolling_windows(tokens: list[int], prefix: int, max_length: int, request: int) -> list[Window]:
    """Disjoint rolling windows of at most `max_length` predicted tokens (harness: context_len 1)."""
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    out = [Window([prefix] + tokens[:first - 1], tokens[:first], request)]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_length)
        end = done + n
        read = tokens[max(end - max_length - 1, 0):end - 1]
        out.append(Window(read, tokens[end - n:end], request))
        done = end
    return out


def build_requests(task: Task, tokenizer, max_length: int, fewshot_seed: int) -> TaskRequests:
    """Every request of `task` and its windows; raises TaskError (one line) for a document that cannot be
    scored: an empty choice list, a continuation longer than the window."""
    windows: list[Window] = []
    pairs: list = []
    doc_of_request: list[int] = []
    if task.output_type == "loglikelihood_rolling":
        for i, doc in enumerate(task.docs):
            text = task.target(doc)
            if not isinstance(text, str):
                raise TaskError(f"task {task.name}: document {i}'s doc_to_target is {type(text).__name__}, not text")
            tokens = tokenizer.encode(text, bos=True, eos=False)
            windows += rolling_windows(tokens, tokenizer.bos_id, max_length, len(pairs))
            pairs.append(text)
            doc_of_request.append(i)
        return TaskRequests(task, pairs, windows, doc_of_request)
    for i, (doc, context) in enumerate(zip(task.docs, task.contexts(fewshot_seed))):
        if task.output_type == "multiple_choice":
            choices = task.choices(doc)
            if not isinstance(choices, list) or not choices:
                raise TaskError(f"task {task.name}: document {i} has an empty choice list (doc_to_choice)")
            conts = [f"{task.target_delimiter}{c}" for c in choices]
        else:
            conts = [str(task.target(doc))]
        for cont in conts:
            ctx_tokens, cont_tokens = encode_pair(tokenizer, context, cont)
            if not cont_tokens:
                raise TaskError(f"task {task.name}: document {i}'s continuation {cont!r} encodes to no token")
            if len(cont_tokens) > max_length:
                raise TaskError(f"task {task.name}: document {i}'s continuation is {len(cont_tokens)} tokens, longer "
                                f"than the evaluation window ({max_length}, --training.seq_len); drop the document, "
                                f"raise the window or leave the task out (--eval.enable false)")
            windows.append(pair_window(ctx_tokens, cont_tokens, max_length, len(pairs)))
            pairs.append((context, cont))
            doc_of_request.append(i)
    return TaskRequests(task, pairs, windows, doc_of_request)
