"""A run's training data, loaded: its micro-batches, the held-out conversations evaluation drafts on, and what
identifies them (the trainer's world hands over only the target's tokenizer)."""

from __future__ import annotations

from pathlib import Path

from training.config import TrainConfig
from training.console import say
from training.data.chat import BatchStream, prepare_sequences
from training.data.report import mix_line
from training.data.tokenized import load_training_data
from training.target.random_world import NUM_CONVERSATIONS as NUM_RANDOM_CONVERSATIONS
from training.target.random_world import synthetic_conversations


def load_data(config: TrainConfig, tokenizer) -> tuple[BatchStream, list[list[dict]], dict]:
    """The training micro-batches, the held-out conversations evaluation drafts on (eval_data_path, else
    the tail of the training data, through the tokenized cache; with random_target, synthetic conversations
    that fill max_length, tokenized here), and what identifies the training data (the tokenized cache's key:
    the data file's sha256, the tokenizer, the template options; and the count kept). Bad lines stop the run,
    or with skip_bad_data are skipped; they and the conversations the recipe drops (under 2 x block_size loss
    tokens) are counted in one line."""
    if config.random_target:
        conversations = synthetic_conversations(NUM_RANDOM_CONVERSATIONS + config.eval_prompts, config.max_length,
                                                config.seed)
        cut = len(conversations) - config.eval_prompts
        sequences = prepare_sequences(tokenizer, conversations[:cut], config.max_length, config.block_size,
                                      {"enable_thinking": config.enable_thinking})
        held_out = conversations[cut:]
        data_id = {"synthetic conversations of seed": config.seed}
    else:
        data_file = Path(config.data_path).expanduser()
        if data_file.is_file():  # a missing one is load_training_data's error
            say(f"data mix: {mix_line(data_file)}")  # the sources it mixes, by record id
        data = load_training_data(tokenizer, config, log=say)  # tokenised once, then read from its cache
        sequences, held_out = data.sequences, data.held_out
        # What decides the ids (not the path, nor the libraries' versions when the tokenizer is the same).
        data_id = {key: data.tokenized.index["fields"][key] for key in
                   ("data_sha256", "tokenizer", "max_length", "template_options", "skip_bad_data")}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stream = BatchStream(sequences, config.micro_batch_rows(), config.buckets(), config.block_size,
                         config.num_anchors, pad_id, config.seed)
    return stream, held_out, {**data_id, "sequences kept": len(sequences)}
