"""The offline world tinker-cookbook's RL recipes run in, for ``test_tinker_cookbook_rl.py``: run in the cookbook's venv
(``python cookbook_world.py HUB_CACHE DATASETS_CACHE``), it writes

* a tiny Qwen3 under the hub name ``Qwen/Qwen3-4B-Instruct-2507`` (a name the cookbook knows: its renderer is
  ``qwen3_instruct``) with a byte-level BPE tokenizer trained here that has the chat's special tokens;
* ``openai/gsm8k`` (config ``main``) in the datasets cache, a few questions of the same shape, for ``rl_loop``;
* and the model's weights after a short supervised warm-up (plain torch) on the first batches both recipes will
  sample: for each prompt, the right answer half the time and a wrong one the other half, so the recipes' rewards
  are neither always 0 nor always 1 and their training steps have advantages to train on.

The prompts are rendered by the cookbook's own renderer and dataset code, exactly as the recipes will render them.
"""

from __future__ import annotations

import sys
from pathlib import Path

MODEL = "Qwen/Qwen3-4B-Instruct-2507"
REV = "0123abcd"
GSM8K_ROWS = 8  # rl_loop's batch_size in the test: one batch
ARITH_BATCHES, ARITH_GROUPS = 2, 4  # math_rl's max_steps and groups_per_batch in the test


def tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["What is 4 + 5? 9", "How many r's are in strawberry? Provide a numerical answer without units, written "
              "inside \\boxed{}.", "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w",
              "user\nassistant\nsystem\n", "The answer is \\boxed{3}. #### 42", "0123456789 + - = ?"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 20, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>",
                                  pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    out.save_pretrained(folder)
    return out


def gsm8k(cache: Path) -> list[tuple[str, str]]:
    import datasets

    rows = [(f"Tom has {a} apples and buys {a + 6} more. How many apples does he have?",
             f"He has {a} + {a + 6} = {2 * a + 6}.\n#### {2 * a + 6}") for a in range(1, GSM8K_ROWS + 1)]

    class Gsm8k(datasets.GeneratorBasedBuilder):
        BUILDER_CONFIGS = [datasets.BuilderConfig(name="main", version=datasets.Version("0.0.0"))]

        def _info(self) -> datasets.DatasetInfo:
            return datasets.DatasetInfo(features=datasets.Features({"question": datasets.Value("string"),
                                                                    "answer": datasets.Value("string")}))

        def _split_generators(self, dl_manager: object) -> list[datasets.SplitGenerator]:
            return [datasets.SplitGenerator(name=s, gen_kwargs={}) for s in ("train", "test")]

        def _generate_examples(self):
            for i, (q, a) in enumerate(rows):
                yield i, {"question": q, "answer": a}

    Gsm8k(cache_dir=str(cache), config_name="main", repo_id="openai/gsm8k", dataset_name="gsm8k",
          hash=REV).download_and_prepare()
    return rows


def examples(tok: object, rows: list[tuple[str, str]]) -> list[tuple[list[int], list[str]]]:
    """(rendered prompt tokens, [right response, wrong response]) of every prompt the test's recipe runs sample."""
    import asyncio

    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset

    renderer = renderers.get_renderer("qwen3_instruct", tok)
    out = []
    # rl_loop: its few-shot prefix and suffix (read from its source: the recipe builds them inline)
    import inspect

    from tinker_cookbook.recipes import rl_loop
    src = inspect.getsource(rl_loop.main)
    suffix = " Provide a numerical answer without units, written inside \\boxed{}."
    assert suffix.replace("\\", "\\\\") in src, "rl_loop's question suffix is not the one this world renders"
    prefix = [{"role": "user", "content": "How many r's are in strawberry?" + suffix},
              {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r "
               "4) a 5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"}]
    for q, a in rows:
        prompt = renderer.build_generation_prompt([*prefix, {"role": "user", "content": q + suffix}])
        answer = a.rpartition("#### ")[2]
        out.append((prompt.to_ints(), [f"\\boxed{{{answer}}}", "\\boxed{0}"]))
    # math_rl's arithmetic env, first batches (its dataset seeds each batch by its index)
    dataset = ArithmeticDataset(batch_size=ARITH_GROUPS, renderer=renderer, group_size=1, n_batches=ARITH_BATCHES)
    for i in range(ARITH_BATCHES):
        for builder in dataset.get_batch(i):
            env = asyncio.run(builder.make_envs())[0]
            ob, _ = asyncio.run(env.initial_observation())
            out.append((ob.to_ints(), [str(env.x + env.y), "0"]))
    return out


def warm_up(folder: Path, tok: object, data: list[tuple[list[int], list[str]]]) -> None:
    """A tiny Qwen3, trained to answer each prompt right half the time (plain torch, deterministic)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=512, tie_word_embeddings=False,
                                  eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), dtype="float32")
    model = AutoModelForCausalLM.from_config(config)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    seqs = [(p, p + tok.encode(r, add_special_tokens=False) + [end]) for p, rs in data for r in rs]
    width = max(len(s) for _, s in seqs)
    tokens = torch.full((len(seqs), width), tok.pad_token_id)
    weights = torch.zeros(len(seqs), width - 1)
    for i, (p, s) in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s)
        weights[i, len(p) - 1:len(s) - 1] = 1.0
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(100):
        logits = model(tokens[:, :-1]).logits
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        loss = (nll * weights).sum() / weights.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"warm-up loss {float(loss.detach()):.3f} (ln 2 = 0.693 is the half-right optimum per answer token)")
    model.save_pretrained(folder)


def main(hub_cache: Path, datasets_cache: Path) -> None:
    repo = hub_cache / f"models--{MODEL.replace('/', '--')}"
    folder = repo / "snapshots" / REV
    folder.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(REV)
    tok = tokenizer(folder)
    rows = gsm8k(datasets_cache)
    warm_up(folder, tok, examples(tok, rows))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
