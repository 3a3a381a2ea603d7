"""Tokenisation with loss on assistant tokens only, anchors, fixed shapes, and a resumable stream."""

from __future__ import annotations

import json
import random

import pytest
import torch

from training.data.chat import (
    BatchStream,
    DataError,
    Sequence,
    anchor_candidates,
    draw_anchors,
    load_conversations,
    prepare_sequences,
)
from training.target.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def words(tokenizer, count: int, seed: int) -> str:
    rng = random.Random(seed)
    first_word = tokenizer.convert_tokens_to_ids("\n") + 1
    return tokenizer.decode([rng.randrange(first_word, len(tokenizer)) for _ in range(count)])


def test_tiny_tokenizer_round_trips_any_token_sequence(tokenizer):
    ids = list(range(len(tokenizer))) * 3
    random.Random(0).shuffle(ids)
    assert tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids


def test_short_sequences_are_dropped_and_long_ones_truncated(tokenizer):
    short = [{"role": "user", "content": words(tokenizer, 3, 0)}, {"role": "assistant", "content": words(tokenizer, 5, 1)}]
    long = [{"role": "user", "content": words(tokenizer, 3, 0)}, {"role": "assistant", "content": words(tokenizer, 60, 2)}]
    sequences = prepare_sequences(tokenizer, [short, long], max_length=48, block_size=4)
    assert len(sequences) == 1 and len(sequences[0].input_ids) == 48


def test_anchors_are_distinct_sorted_assistant_positions_with_a_whole_block():
    sequence = Sequence(list(range(40)), [0] * 10 + [1] * 20 + [0] * 5 + [1] * 5)
    candidates = anchor_candidates(sequence, block_size=8)
    assert candidates == list(range(10, 30))  # 35..39 are assistant tokens too, but no whole block fits after them
    anchors = draw_anchors(sequence, 8, 12, random.Random(0))
    assert len(anchors) == 12 and len(set(anchors)) == 12 and anchors == sorted(anchors)
    assert set(anchors) <= set(candidates)
    assert len(draw_anchors(sequence, 8, 100, random.Random(0))) == len(candidates)


def make_stream(count: int = 10, batch_size: int = 3, seed: int = 7) -> BatchStream:
    rng = random.Random(0)
    sequences = []
    for i in range(count):
        length = rng.randint(20, 60)
        sequences.append(Sequence([rng.randrange(5, 100) for _ in range(length)], [0] * 5 + [1] * (length - 5)))
    return BatchStream(sequences, batch_size, buckets=[32, 64], block_size=4, num_anchors=6, pad_id=0, seed=seed)


def test_batches_have_fixed_shapes():
    stream = make_stream()
    shapes = set()
    for _ in range(12):
        batch = next(stream)
        assert batch.input_ids.shape[0] == 3 and batch.anchors.shape == (3, 6)
        shapes.add(tuple(batch.input_ids.shape))
        for row in range(3):
            n = int(batch.block_valid[row].sum())
            anchors = batch.anchors[row, :n].tolist()
            assert anchors == sorted(set(anchors)) and all(batch.loss_mask[row, a] for a in anchors)
    assert shapes <= {(3, 32), (3, 64)}


def test_stream_resumes_exactly_and_redraws_anchors_each_epoch():
    stream = make_stream()
    for _ in range(5):  # crosses into the second epoch (10 sequences, 3 per batch)
        next(stream)
    state = json.loads(json.dumps(stream.state_dict()))  # survives serialisation
    expected = [next(stream) for _ in range(4)]
    resumed = make_stream()
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.anchors, want.anchors)

    fresh = make_stream(count=3, batch_size=3)
    epoch0, epoch1 = next(fresh), next(fresh)
    order0 = [tuple(r) for r in epoch0.input_ids.tolist()]
    row_in_epoch1 = [tuple(r) for r in epoch1.input_ids.tolist()].index(order0[0])
    assert not torch.equal(epoch0.anchors[0], epoch1.anchors[row_in_epoch1])


def test_skipping_a_batch_leaves_the_stream_where_making_it_would():
    made, skipped = make_stream(), make_stream()
    for i in range(9):  # across epochs (10 sequences, 3 per batch)
        want = next(made)
        if i % 3 == 1:  # another node's batch
            skipped.skip()
            continue
        got = next(skipped)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.anchors, want.anchors)
    assert skipped.state_dict() == made.state_dict()


def test_bad_data_lines_are_one_line_errors(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"nope": 1}\n')
    with pytest.raises(DataError, match=r"data.jsonl:2:"):
        load_conversations(str(path))
    with pytest.raises(DataError, match="not found"):
        load_conversations(str(tmp_path / "missing.jsonl"))


def test_bad_data_lines_can_be_skipped_and_listed(tmp_path):
    good = {"messages": [{"role": "user", "content": "a\u2028b"}, {"role": "assistant", "content": "c"}]}
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join([
        json.dumps(good, ensure_ascii=False).encode(),  # U+2028 raw inside a string: still one line
        b"not json",
        b'{"nope": 1}',
        b"",
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',  # not UTF-8
        b'{"messages": "hi"}',
        json.dumps(good).encode(),
    ]) + b"\n")
    with pytest.raises(DataError, match=r"data.jsonl:2: not a"):
        load_conversations(str(path))
    skipped: list[str] = []
    assert load_conversations(str(path), skipped) == [good["messages"], good["messages"]]
    assert [line.split(": not a")[0] for line in skipped] == [f"{path}:{n}" for n in (2, 3, 5, 6)]
