"""The tiny preset's world, built locally with no network: a random Qwen3 target and the data it generates.

The tokenizer is a word-level one over synthetic words with ChatML special tokens. Every word token carries its
leading space and every other token is an added token, so any id sequence decodes to text that encodes back to
the same ids: the generated replies survive the JSONL round trip exactly, and the drafter learns the target's
own outputs.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

from training.data.chat import encode_chat
from training.durable import staging_dir
from training.target.frozen import Target

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
ADDED_TOKENS = ["system", "user", "assistant", "\n"]
NUM_WORDS = 300
REPLY_TOKENS = (24, 64)  # each reply is cut at a random length in this range (or at EOS)
PROMPT_WORDS = (4, 12)
LM_HEAD_SCALE = 20.0


def synthetic_words(count: int, seed: int = 0) -> list[str]:
    """Distinct pronounceable words of consonant-vowel syllables (none can contain a role name)."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))))
    return sorted(words)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    words = [" " + word for word in synthetic_words(NUM_WORDS)]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + ADDED_TOKENS + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[^\s]+|\s"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # concatenate: the spaces live inside the word tokens
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<|endoftext|>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    wrapped.add_tokens(ADDED_TOKENS)
    wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


def tiny_vocab_size(tokenizer: PreTrainedTokenizerFast) -> int:
    """Rows of the tiny target's tables: the tokenizer's tokens plus at least one spare row, where the trainer's
    `<|MASK|>` lands (an added special token), padded to a multiple of 16 as real models pad theirs (Qwen3-8B:
    151,669 tokens, 151,936 rows)."""
    return -(-(len(tokenizer) + 1) // 16) * 16


def tiny_target_config(tokenizer: PreTrainedTokenizerFast, vocab_size: int | None = None) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size or tiny_vocab_size(tokenizer), hidden_size=64, intermediate_size=192, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_theta=10000.0,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def build_tiny_target(path: Path, seed: int = 0) -> None:
    """A randomly initialised Qwen3 with the tiny tokenizer, saved like any Hugging Face checkpoint.

    Initialised with exactly the tokenizer's rows, as tiny-v1 was (the same random network), then given its
    spare rows: random embedding rows like any untrained one, LM-head rows of 0 (a trained model's unused rows
    score low), so the greedy target never emits a token its tokenizer cannot decode."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_target_config(tokenizer, len(tokenizer)), dtype=torch.float32)
    with torch.no_grad():  # a std-0.02 random head gives near-uniform logits whose loss barely moves;
        model.lm_head.weight.mul_(LM_HEAD_SCALE)  # scaling it changes no greedy choice, only the sharpness
    model.resize_token_embeddings(tiny_vocab_size(tokenizer), mean_resizing=False)
    with torch.no_grad():
        model.lm_head.weight[len(tokenizer):] = 0
    with staging_dir(path) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def build_tiny_data(target: Target, train_path: Path, eval_path: Path, num_train: int = 384,
                    num_eval: int = 16, seed: int = 0) -> None:
    """Random user prompts answered greedily by the target: conversations for training and held-out ones."""
    tokenizer = target.tokenizer
    rng = random.Random(seed)
    first_word = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    prompts = []
    for _ in range(num_train + num_eval):  # words only: not the <|MASK|> the loaded tokenizer has after them
        ids = [rng.randrange(first_word, first_word + NUM_WORDS) for _ in range(rng.randint(*PROMPT_WORDS))]
        prompts.append(tokenizer.decode(ids))
    prompt_ids = [encode_chat(tokenizer, [{"role": "user", "content": p}], generation_prompt=True) for p in prompts]
    replies = target.generate_greedy(prompt_ids, max_new_tokens=REPLY_TOKENS[1])
    conversations = []
    for prompt, reply in zip(prompts, replies):
        reply = [t for t in reply if t != tokenizer.eos_token_id][: rng.randint(*REPLY_TOKENS)]
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": tokenizer.decode(reply)}]
        conversations.append(json.dumps({"messages": messages}))
    _write_atomic(train_path, conversations[:num_train])
    _write_atomic(eval_path, conversations[num_train:])


def ensure_tiny(target_path: str, data_path: str, eval_data_path: str, seed: int = 0) -> None:
    """Build whatever of the tiny target and its data is missing (the data needs the target)."""
    target_dir = Path(target_path).expanduser()
    train, held_out = Path(data_path).expanduser(), Path(eval_data_path or data_path + ".eval").expanduser()
    if not (target_dir / "config.json").is_file():
        print(f"building the tiny random target in {target_dir}", flush=True)
        build_tiny_target(target_dir, seed)
    if not train.is_file() or (eval_data_path and not held_out.is_file()):
        print(f"generating tiny data with the target: {train}", flush=True)
        target = Target.load(str(target_dir), "cpu", torch.float32)
        build_tiny_data(target, train, held_out, seed=seed)


def _write_atomic(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
