"""A stand-in for vLLM's offline API (`LLM`, `SamplingParams`, `vllm.inputs.TokensPrompt`), enough for
training/regenerate/generation.py's EngineGenerator to run on the CPU: the engine is transformers' model, decoding one
prompt at a time, greedy or seeded sampling, and its outputs are shaped as vLLM's (`RequestOutput.outputs[0]`
with `token_ids`, the stop token included as vLLM includes it, and `finish_reason` "stop" or "length"). Every
call is recorded in CALLS for the tests to read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM

CALLS: list[dict] = []


@dataclass
class SamplingParams:
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None


@dataclass
class CompletionOutput:
    token_ids: tuple[int, ...]
    finish_reason: str


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLM:
    def __init__(self, model: str, dtype: str = "auto", seed: int = 0, generation_config: str = "auto", **kwargs):
        CALLS.append({"init": {"model": model, "dtype": dtype, "seed": seed, "generation_config": generation_config}})
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    @torch.no_grad()
    def generate(self, prompts: list[dict], params: list[SamplingParams], use_tqdm: bool = True):
        CALLS.append({"generate": len(prompts), "params": params})
        return [self._one(p["prompt_token_ids"], q) for p, q in zip(prompts, params)]

    def _one(self, prompt: list[int], params: SamplingParams) -> RequestOutput:
        generator = torch.Generator().manual_seed(params.seed or 0)
        tokens: list[int] = []
        for _ in range(params.max_tokens):
            logits = self.model(torch.tensor([prompt + tokens])).logits[0, -1]
            if params.temperature > 0:
                token = int(torch.multinomial((logits / params.temperature).softmax(-1), 1, generator=generator))
            else:
                token = int(logits.argmax())
            tokens.append(token)
            if token in params.stop_token_ids:
                return RequestOutput(prompt, [CompletionOutput(tuple(tokens), "stop")])
        return RequestOutput(prompt, [CompletionOutput(tuple(tokens), "length")])
