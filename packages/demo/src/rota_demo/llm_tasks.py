"""The LLM mode's tasks (``rota demo --engine hf|vllm``): generated prompts with exact answers, a character-level
tokenizer shared by every job, and the verifiable rewards, all on the host (no torch).

Every prompt of a task has the same length, so a batch of them needs no padding, no attention mask and no
left-padding logic in either engine; completions are at most :data:`MAX_NEW` tokens, ending with EOS.

* ``shift``: ``"bad+"`` -> ``"cbe"``, each letter to the next (RL job rl-a);
* ``rev``: ``"bad>"`` -> ``"dab"`` (RL job rl-b);
* ``sort``: ``"cab:"`` -> ``"abc"`` (the SFT job; it learns from generated text and is evaluated by its engine).
"""

from __future__ import annotations

import random

__all__ = ["BOS", "CHARS", "EOS", "MAX_NEW", "PAD", "PROMPT_LEN", "TASKS", "VOCAB", "answer", "decode", "encode",
           "prompts", "reward", "save_tokenizer"]

PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789+=>:abcdefgh"
VOCAB = 32  # 3 specials + the characters, rounded up (the model's vocab_size)
LETTERS = "abcdefgh"
TASKS = ("shift", "rev", "sort")
PROMPT_LEN = 5  # BOS + 4 characters
MAX_NEW = 4  # up to 3 answer characters + EOS
_IDS = {c: i + 3 for i, c in enumerate(CHARS)}


def encode(text: str) -> list[int]:
    return [_IDS[c] for c in text]


def decode(ids: list[int]) -> str:
    """The text of ``ids`` up to (not including) the first EOS; specials other than EOS read as ``?``."""
    out = []
    for i in ids:
        if i == EOS:
            break
        out.append(CHARS[i - 3] if 3 <= i < 3 + len(CHARS) else "?")
    return "".join(out)


def _question(task: str, rng: random.Random) -> str:
    letters = LETTERS[:-1] if task == "shift" else LETTERS  # "h" has no next letter
    word = "".join(rng.choice(letters) for _ in range(3))
    return word + {"shift": "+", "rev": ">", "sort": ":"}[task]


def answer(question: str) -> str:
    """The exact answer of a generated question (the verifier)."""
    word, op = question[:3], question[3]
    if op == "+":
        return "".join(LETTERS[LETTERS.index(c) + 1] for c in word)
    return word[::-1] if op == ">" else "".join(sorted(word))


def prompts(task: str, seed: int, step: int, count: int) -> list[str]:
    """``count`` questions of ``task``, a pure function of (seed, step): the same batch in every mode."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}: choose from {', '.join(TASKS)}")
    rng = random.Random(seed * 1_000_003 + step)
    return [_question(task, rng) for _ in range(count)]


def reward(question: str, completion: list[int]) -> float:
    """1.0 when the completion is exactly the answer followed by EOS, else 0.0."""
    return 1.0 if EOS in completion and decode(completion) == answer(question) else 0.0


def save_tokenizer(path: str) -> None:
    """The same character-level vocabulary as a ``tokenizers`` WordLevel tokenizer, saved with the checkpoint
    (``PreTrainedTokenizerFast.save_pretrained``) so the directory is a complete HF model; the demo itself
    encodes with :func:`encode` (the same ids)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **_IDS}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<pad>")
    fast.save_pretrained(path)
