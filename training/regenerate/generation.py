"""Generating replies for regeneration (training/regenerate/run.py): a batch of records in, the records with the
target's own replies out, turn by turn. `ReplicaGenerator` runs one device's replica of the target through
transformers' `generate` (decode = "dynamic") or the static-cache loop of training/regenerate/static_decode.py ("static");
`EngineGenerator` hands the prompts to an inference engine (backend = "vllm": vLLM's offline `LLM.generate`),
with the same chat template, stop tokens, output format and seeds."""

from __future__ import annotations

import copy
import functools
import hashlib

import torch

from training.config import ConfigError
from training.data.chat import encode_chat
from training.regenerate.continuous import ContinuousDecoder
from training.regenerate.records import PromptRecord, id_key, reply_positions
from training.regenerate.static_decode import (
    ATTENTION,
    DecodeCounters,
    StaticDecoder,
    check_static_decodable,
    sample,
)

STATIC_MIN_WIDTH = 256  # the static decode's smallest prompt width (each width has its own captured step)
STATIC_CACHE_WIDTH = 1024  # wider batches decode in fewer rows: no cache is larger than batch_size rows of this


def stop_ids(generation_config, tokenizer, where: str) -> tuple[list[int], int]:
    """The ids that end a reply (the generation config's and the tokenizer's EOS) and the padding id."""
    eos = generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    eos_ids = sorted({*eos, tokenizer.eos_token_id} - {None})
    if not eos_ids:
        raise ConfigError(f"{where}: neither the tokenizer nor the generation config has an EOS")
    return eos_ids, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]


def reply_of(tokens: list[int], eos_ids: list[int]) -> tuple[list[int], int, bool]:
    """A row's new tokens cut at its first EOS: (the reply, tokens generated with the EOS, cut at the limit)."""
    end = next((i for i, token in enumerate(tokens) if token in eos_ids), None)
    return (tokens, len(tokens), True) if end is None else (tokens[:end], end + 1, False)


def left_padded(prompts: list[list[int]], rows: int, width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask [rows, width]: every row ends where generation starts; rows past the
    prompts repeat the last one (filler for a fixed shape)."""
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for row in range(rows):
        prompt = prompts[min(row, len(prompts) - 1)]
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def ended_at_last_reply(messages: list[dict], at: int) -> list[dict]:
    """A conversation whose reply at `at` does not fit in the target's window: it ends at its last reply (or, with
    none yet, at the prompt, which then trains nothing)."""
    replied = [n for n, m in enumerate(messages[:at]) if m["role"] == "assistant"]
    return messages[: replied[-1] + 1 if replied else at]


def output_record(record: PromptRecord, messages: list[dict], truncated: bool, shortened: bool) -> dict:
    """An output line: the record's id and its messages, and "truncated" / "shortened" when they hold."""
    return {"id": record.id, "messages": messages, **({"truncated": True} if truncated else {}),
            **({"shortened": True} if shortened else {})}


class ReplicaGenerator:
    """One device's target replica and tokenizer: a batch of records -> regenerated records."""

    def __init__(self, model, tokenizer, config):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.device = model.get_input_embeddings().weight.device
        self.eos_ids, self.pad_id = stop_ids(model.generation_config, tokenizer, config.target_path)
        self.continuous = config.decode == "continuous"
        self.static = self.continuous or config.decode == "static" or (config.decode == "auto" and
                                                                        self.device.type == "cuda")
        self.decoders: dict[tuple, StaticDecoder] = {}  # by (rows, width): the two last used (each holds a cache)
        self.counters = DecodeCounters()
        self.decoder_continuous: ContinuousDecoder | None = None
        # a reply must fit in the target's window with its context: a longer conversation ends before that turn
        window = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.context_limit = min(window, config.max_context_tokens or window)
        if self.static:
            check_static_decodable(model.config)
            model.set_attn_implementation(ATTENTION)

    def sampling(self) -> dict:
        if self.config.temperature > 0:  # top_k 0: the model's own generation defaults must not narrow it
            return {"do_sample": True, "temperature": self.config.temperature, "top_p": self.config.top_p,
                    "top_k": 0}
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}

    def seed(self, records: list[PromptRecord]) -> None:
        value = int(hashlib.sha256(f"{self.config.seed}/{id_key(records[0].id)}".encode()).hexdigest()[:15], 16)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(value)
        else:
            torch.default_generator.manual_seed(value)

    def decoder(self, rows: int, width: int) -> StaticDecoder:
        if (rows, width) not in self.decoders:
            if len(self.decoders) == 2:
                self.decoders.pop(next(iter(self.decoders)))
            self.decoders[rows, width] = StaticDecoder(self.model, rows, width, self.config.max_new_tokens,
                                                       self.eos_ids, self.counters)
        self.decoders[rows, width] = self.decoders.pop((rows, width))  # the most recently used goes last
        return self.decoders[rows, width]

    def new_tokens(self, ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
        """Each row's generated tokens (up to its first EOS and perhaps beyond)."""
        if self.static:
            sampled = self.config.temperature > 0
            return self.decoder(*ids.shape).generate(ids, mask, functools.partial(
                sample, temperature=self.config.temperature, top_p=self.config.top_p) if sampled else None)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=self.config.max_new_tokens, pad_token_id=self.pad_id,
                                  eos_token_id=self.eos_ids, **self.sampling())
        return out[:, ids.shape[1]:].tolist()

    def replies(self, contexts: list[list[dict]]) -> list[tuple[str, int, bool] | None]:
        """(reply text, tokens generated, cut at max_new_tokens) for each conversation so far; None for one whose
        context leaves no room for max_new_tokens in the target's window."""
        prompts = [encode_chat(self.tokenizer, c, True, self.config.template_options()) for c in contexts]
        fits = [i for i, p in enumerate(prompts) if len(p) + self.config.max_new_tokens <= self.context_limit]
        results: list[tuple[str, int, bool] | None] = [None] * len(prompts)
        if fits:
            for i, row in zip(fits, self.completions([prompts[i] for i in fits])):
                reply, count, cut = reply_of(row, self.eos_ids)
                results[i] = (self.tokenizer.decode(reply), count, cut)
        return results

    @torch.no_grad()
    def completions(self, prompts: list[list[int]]) -> list[list[int]]:
        """Each token-id prompt's new tokens (max_new_tokens, up to its first EOS and perhaps beyond)."""
        width, rows = max(len(p) for p in prompts), len(prompts)
        if self.static:  # one shape per width; a wide batch in fewer rows, so no cache outgrows a 1,024-wide one
            width = max(STATIC_MIN_WIDTH, 1 << (width - 1).bit_length())
            size, new = self.config.batch_size, self.config.max_new_tokens
            rows = max(1, min(size, size * (STATIC_CACHE_WIDTH + new) // (width + new)))
        tokens = []
        for start in range(0, len(prompts), rows):
            chunk = prompts[start:start + rows]
            tokens += self.new_tokens(*left_padded(chunk, rows if self.static else len(chunk), width,
                                                   self.pad_id))[: len(chunk)]
        return tokens

    def regenerate(self, records: list[PromptRecord]) -> tuple[list[dict], int]:
        """The records with every reply the target's own, and the number of tokens generated."""
        if self.continuous:
            return self.regenerate_continuously(records)
        self.seed(records)
        conversations = [copy.deepcopy(r.messages) for r in records]
        positions = [reply_positions(r.messages) for r in records]
        truncated, shortened = [False] * len(records), [False] * len(records)
        tokens = 0
        for turn in range(max(len(p) for p in positions)):
            rows = [i for i, p in enumerate(positions) if turn < len(p)]
            replies = self.replies([conversations[i][: positions[i][turn]] for i in rows])
            for i, reply in zip(rows, replies):
                at = positions[i][turn]
                if reply is None:  # no room left in the target's window
                    conversations[i] = ended_at_last_reply(conversations[i], at)
                    positions[i], shortened[i] = positions[i][:turn], True
                    continue
                text, count, cut = reply
                conversations[i][at:at + 1] = [{"role": "assistant", "content": text}]
                truncated[i] |= cut
                tokens += count
        return [output_record(*row) for row in zip(records, conversations, truncated, shortened)], tokens

    def regenerate_continuously(self, records: list[PromptRecord]) -> tuple[list[dict], int]:
        """regenerate's records through the continuous decoder: each conversation's next turn is queued the moment
        its reply is known (the turn order and the records are regenerate's)."""
        conversations = [copy.deepcopy(r.messages) for r in records]
        positions = [reply_positions(r.messages) for r in records]
        truncated, shortened = [False] * len(records), [False] * len(records)
        turns, tokens = [0] * len(records), 0
        limit = self.context_limit

        def job(i: int):
            """Record i's next turn as a job; None when it has none left (or no room for it, shortened)."""
            if turns[i] == len(positions[i]):
                return None
            at = positions[i][turns[i]]
            prompt = encode_chat(self.tokenizer, conversations[i][:at], True, self.config.template_options())
            if len(prompt) + self.config.max_new_tokens > limit:
                conversations[i], shortened[i] = ended_at_last_reply(conversations[i], at), True
                return None
            return i, prompt

        def finished(i: int, generated: list[int]):
            nonlocal tokens
            reply, count, cut = reply_of(generated, self.eos_ids)
            at = positions[i][turns[i]]
            conversations[i][at:at + 1] = [{"role": "assistant", "content": self.tokenizer.decode(reply)}]
            truncated[i] |= cut
            tokens += count
            turns[i] += 1
            return job(i)

        if self.decoder_continuous is None:
            self.decoder_continuous = ContinuousDecoder(self.model, self.config.batch_size, limit,
                                                        self.config.max_new_tokens, self.eos_ids, self.pad_id,
                                                        self.counters)
        self.decoder_continuous.decode([j for j in map(job, range(len(records))) if j is not None], finished)
        return [output_record(*row) for row in zip(records, conversations, truncated, shortened)], tokens


class EngineGenerator(ReplicaGenerator):
    """The replies from an inference engine's offline API (vLLM's `LLM.generate` on token-id prompts): the engine
    batches, caches and schedules by itself; prompts, stop ids, decoding and the records are this module's."""

    def __init__(self, target_dir: str, tokenizer, config):
        try:
            from vllm import LLM, SamplingParams
        except ImportError:
            raise ConfigError("backend = \"vllm\" needs the vllm package where the regeneration runs "
                              "(pip install vllm); it is not installed") from None
        from transformers import GenerationConfig

        self.tokenizer, self.config, self.device = tokenizer, config, torch.device("cuda")
        self.eos_ids, self.pad_id = stop_ids(GenerationConfig.from_pretrained(target_dir), tokenizer, target_dir)
        self.static, self.continuous, self.batch_seed, self.sampling_params = False, False, 0, SamplingParams
        dtype = "auto" if config.dtype == "auto" else config.dtype
        # generation_config="vllm": the model's own sampling defaults (top-k, repetition penalty) must not apply
        self.engine = LLM(model=target_dir, dtype=dtype, seed=config.seed, generation_config="vllm")

    def seed(self, records: list[PromptRecord]) -> None:
        self.batch_seed = int(hashlib.sha256(f"{self.config.seed}/{id_key(records[0].id)}".encode()).hexdigest()[:8],
                              16)

    @torch.no_grad()
    def replies(self, contexts: list[list[dict]]) -> list[tuple[str, int, bool]]:
        from vllm.inputs import TokensPrompt

        sampled = self.config.temperature > 0
        params = [self.sampling_params(max_tokens=self.config.max_new_tokens, stop_token_ids=self.eos_ids,
                                       temperature=self.config.temperature, top_p=self.config.top_p if sampled else 1.0,
                                       top_k=-1, seed=self.batch_seed + n if sampled else None)
                  for n in range(len(contexts))]
        prompts = [TokensPrompt(prompt_token_ids=encode_chat(self.tokenizer, c, True, self.config.template_options()))
                   for c in contexts]
        results = []
        for output in self.engine.generate(prompts, params, use_tqdm=False):
            completion = output.outputs[0]
            reply, _, cut = reply_of(list(completion.token_ids), self.eos_ids)
            # the engine may leave the stop token out of token_ids: its finish reason says how the reply ended
            stopped = completion.finish_reason == "stop"
            results.append((self.tokenizer.decode(reply), len(reply) + stopped, not stopped and cut))
        return results
