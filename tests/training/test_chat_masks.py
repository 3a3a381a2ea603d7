"""Loss masks of multi-turn conversations against hand-built expectations, with the tiny ChatML template and with
Qwen3's real chat template (fixtures/qwen3_chat_template.jinja: the `chat_template` of Qwen/Qwen3-8B's
tokenizer_config.json, which renders earlier assistant turns without their `<think>` block and the last one with
one, empty or not).

The rule under test (training/data/chat.py): loss on what follows the generation prompt of each assistant turn,
through its `<|im_end|>`; never the role header, the newline after `<|im_end|>`, or a system/user token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from training.data.chat import ChatTokenizer, encode_chat
from training.target.tiny import synthetic_words, tiny_tokenizer

QWEN3_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja").read_text()
WORDS = synthetic_words(300)


@pytest.fixture(scope="module")
def chatml():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def qwen3():
    """The tiny word-level vocabulary with Qwen3's chat template and its (non-special) think tokens."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


def text(*words: str) -> str:
    return "".join(" " + w for w in words)


def said(words: tuple[str, ...], loss: int) -> list[tuple[str, int]]:
    return [(" " + w, loss) for w in words]


def header(role: str) -> list[tuple[str, int]]:
    return [("<|im_start|>", 0), (role, 0), ("\n", 0)]


END = [("<|im_end|>", 0), ("\n", 0)]  # the end of a turn without loss
REPLY_END = [("<|im_end|>", 1), ("\n", 0)]  # a reply's end: the end-of-turn token is the target's, the newline is not


def masked_tokens(tokenizer, messages, **options) -> list[tuple[str, int]]:
    sequence = ChatTokenizer(tokenizer, options)(messages)  # the whole conversation, as the trainer reads it
    assert sequence.input_ids == encode_chat(tokenizer, messages, template_options=options)
    assert len(sequence.loss_mask) == len(sequence.input_ids)
    return list(zip(tokenizer.convert_ids_to_tokens(sequence.input_ids), sequence.loss_mask))


SYSTEM, U1, A1, U2, A2, U3, A3 = (WORDS[0:3], WORDS[3:7], WORDS[7:12], WORDS[12:14], WORDS[14:20], WORDS[20:23],
                                  WORDS[23:27])
R1, R2 = WORDS[30:33], WORDS[33:35]  # reasoning


def test_chatml_every_assistant_turn_carries_loss(chatml):
    messages = [{"role": "system", "content": text(*SYSTEM)}, {"role": "user", "content": text(*U1)},
                {"role": "assistant", "content": text(*A1)}, {"role": "user", "content": text(*U2)},
                {"role": "assistant", "content": text(*A2)}, {"role": "user", "content": text(*U3)},
                {"role": "assistant", "content": text(*A3)}]
    expected = (header("system") + said(SYSTEM, 0) + END
                + header("user") + said(U1, 0) + END + header("assistant") + said(A1, 1) + REPLY_END
                + header("user") + said(U2, 0) + END + header("assistant") + said(A2, 1) + REPLY_END
                + header("user") + said(U3, 0) + END + header("assistant") + said(A3, 1) + REPLY_END)
    assert masked_tokens(chatml, messages) == expected


def test_chatml_a_conversation_without_a_reply_has_no_loss(chatml):
    messages = [{"role": "user", "content": text(*U1)}, {"role": "assistant", "content": ""},
                {"role": "user", "content": text(*U2)}]
    expected = (header("user") + said(U1, 0) + END + header("assistant") + REPLY_END
                + header("user") + said(U2, 0) + END)
    assert masked_tokens(chatml, messages) == expected  # an empty reply is just its end-of-turn token


def qwen3_conversation(first_reply: str, last_reply: str) -> list[dict]:
    return [{"role": "user", "content": text(*U1)}, {"role": "assistant", "content": first_reply},
            {"role": "user", "content": text(*U2)}, {"role": "assistant", "content": last_reply}]


THINK_EMPTY = [("<think>", 0), ("\n", 0), ("\n", 0), ("</think>", 0), ("\n", 0), ("\n", 0)]


def test_qwen3_thinking_off_earlier_turn_stripped_scaffold_without_loss(qwen3):
    # The first reply's reasoning is dropped by the template (an earlier turn): only its answer is there.
    messages = qwen3_conversation(f"<think>\n{text(*R1)}\n</think>\n\n{text(*A1)}", text(*A2))
    expected = (header("user") + said(U1, 0) + END + header("assistant") + said(A1, 1) + REPLY_END
                + header("user") + said(U2, 0) + END + header("assistant") + THINK_EMPTY + said(A2, 1) + REPLY_END)
    assert masked_tokens(qwen3, messages, enable_thinking=False) == expected


def test_qwen3_thinking_on_the_last_turns_reasoning_carries_loss(qwen3):
    messages = qwen3_conversation(text(*A1), f"<think>\n{text(*R2)}\n</think>\n\n{text(*A2)}")
    think = ([("<think>", 1), ("\n", 1)] + said(R2, 1) + [("\n", 1), ("</think>", 1), ("\n", 1), ("\n", 1)])
    expected = (header("user") + said(U1, 0) + END + header("assistant") + said(A1, 1) + REPLY_END
                + header("user") + said(U2, 0) + END + header("assistant") + think + said(A2, 1) + REPLY_END)
    assert masked_tokens(qwen3, messages, enable_thinking=True) == expected


def test_qwen3_thinking_on_an_empty_think_block_is_the_targets_output(qwen3):
    # With thinking on the generation prompt stops at the header: the target writes the (empty) block itself.
    messages = qwen3_conversation(text(*A1), text(*A2))
    expected = (header("user") + said(U1, 0) + END + header("assistant") + said(A1, 1) + REPLY_END
                + header("user") + said(U2, 0) + END + header("assistant") + [(t, 1) for t, _ in THINK_EMPTY]
                + said(A2, 1) + REPLY_END)
    assert masked_tokens(qwen3, messages, enable_thinking=True) == expected


def test_qwen3_three_turns_with_a_system_prompt(qwen3):
    messages = [{"role": "system", "content": text(*SYSTEM)}, {"role": "user", "content": text(*U1)},
                {"role": "assistant", "content": f"<think>\n{text(*R1)}\n</think>\n\n{text(*A1)}"},
                {"role": "user", "content": text(*U2)}, {"role": "assistant", "content": text(*A2)},
                {"role": "user", "content": text(*U3)}, {"role": "assistant", "content": text(*A3)}]
    expected = (header("system") + said(SYSTEM, 0) + END
                + header("user") + said(U1, 0) + END + header("assistant") + said(A1, 1) + REPLY_END
                + header("user") + said(U2, 0) + END + header("assistant") + said(A2, 1) + REPLY_END
                + header("user") + said(U3, 0) + END + header("assistant") + THINK_EMPTY + said(A3, 1) + REPLY_END)
    assert masked_tokens(qwen3, messages, enable_thinking=False) == expected
