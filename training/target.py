"""The frozen target model: loaded with transformers from a local directory, used for its hidden states.

The drafter is conditioned on the outputs of a few target layers (DESIGN §5). They are captured with forward
hooks on the decoder layers, so "layer l" means exactly the output of `layers[l]` whatever a given
transformers version puts in `hidden_states`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase


def default_feature_layers(num_layers: int, count: int = 5) -> list[int]:
    """`count` layers evenly spread from the second (1) to the third-last (L-3): 36 layers -> 1, 9, 17, 25, 33."""
    first, last = 1, num_layers - 3
    if last - first + 1 < count:
        raise ValueError(f"a target with {num_layers} layers has fewer than {count} layers between 1 and L-3")
    return [round(first + i * (last - first) / (count - 1)) for i in range(count)]


def rope_theta(config) -> float:
    """RoPE base across transformers versions (4.x: rope_theta; 5.x: rope_parameters["rope_theta"])."""
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if theta is None:
        raise ValueError("the target config has no RoPE theta")
    return float(theta)


class Target:
    """A frozen causal LM plus its tokenizer; `features()` returns the concatenated selected layer outputs."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, layers: list[int] | None = None):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = model.config
        num_layers = self.config.num_hidden_layers
        self.layers = list(layers) if layers else default_feature_layers(num_layers)
        if max(self.layers) >= num_layers:
            raise ValueError(f"target_layers {self.layers} out of range for a {num_layers}-layer target")
        self._decoder_layers = model.get_decoder().layers
        self._captured: dict[int, torch.Tensor] | None = None  # a dict only while features() runs
        for index in self.layers:
            self._decoder_layers[index].register_forward_hook(self._capture_hook(index))

    @classmethod
    def load(cls, path: str, device: str | torch.device, dtype: torch.dtype,
             layers: list[int] | None = None) -> Target:
        path = str(Path(path).expanduser())
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        return cls(model.to(device), tokenizer, layers)

    def _capture_hook(self, index: int):
        def hook(module, args, output):
            if self._captured is not None:
                self._captured[index] = output[0] if isinstance(output, tuple) else output
        return hook

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_features(self) -> int:
        return len(self.layers)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, L] token ids -> [B, L, len(layers) * D]. Right padding needs no mask: causal attention never
        lets a real position see a later pad."""
        self._captured = {}
        try:
            self.model.get_decoder()(input_ids=input_ids.to(self.device), attention_mask=attention_mask,
                                     use_cache=False)
            return torch.cat([self._captured[index] for index in self.layers], dim=-1)
        finally:
            self._captured = None

    @torch.no_grad()
    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 64) -> list[list[int]]:
        """The target's greedy continuation of each prompt, ending at (and including) EOS if it comes."""
        eos = self.config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else next(iter(eos_ids), 0)
        continuations = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, prompt in enumerate(chunk):  # left padding: every row ends where generation starts
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=pad, eos_token_id=sorted(eos_ids) or None,
            )
            for row in out[:, width:].tolist():
                cut = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
                continuations.append(row[:cut])
        return continuations
