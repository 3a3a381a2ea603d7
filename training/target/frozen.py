"""The frozen target model: loaded with transformers from a local directory, used for its hidden states.

The drafter is conditioned on the outputs of a few target layers (ARCHITECTURE §5). They are captured with forward
hooks on the decoder layers, so "layer l" means exactly the output of `layers[l]` whatever a given
transformers version puts in `hidden_states`. The forward stops once the last of them has run (the hook on it
raises, `features` catches): the layers after it, the final norm and the LM head are never computed (Qwen3-8B:
34 of 36 layers).

What the served format (ARCHITECTURE §7) needs of a target is checked here, in one line each and before its weights
load: the serving engines read layer l as `hidden_states[l + 1]`, which is the output of `layers[l]` except for
the last layer (there it is after the final norm), so the last layer is refused; the drafter implements the
RoPE types it computes exactly as the served model does (training/target/rope.py); and the block's masked positions
are the `<|MASK|>` token (or the `mask_token` named) embedded by the target's own table, so the table needs a
row for it (a tokenizer without `<|MASK|>` gets it as an added special token; a table with no free row,
SmolLM2's, needs `mask_token` set to a token it has).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from torch import nn
from transformers import AddedToken, AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from training.config import ConfigError
from training.target.rope import served_rope_parameters

MASK_TOKEN = "<|MASK|>"


class _FeaturesReady(Exception):
    """Raised by the hook on the last feature layer: everything `features` needs is captured."""


def default_feature_layers(num_layers: int, count: int = 5) -> list[int]:
    """`count` layers evenly spread from the second (1) to the third-last (L-3): 36 layers -> 1, 9, 17, 25, 33."""
    first, last = 1, num_layers - 3
    if last - first + 1 < count:
        raise ConfigError(f"a target with {num_layers} layers has fewer than {count} layers between 1 and L-3; "
                          "set target_layers")
    return [round(first + i * (last - first) / (count - 1)) for i in range(count)]


def check_feature_layers(layers: list[int], num_layers: int) -> None:
    """Layers a served drafter reads exactly as training does: 0 <= l < L - 1."""
    if any(layer < 0 or layer >= num_layers for layer in layers):
        raise ConfigError(f"target_layers {layers} out of range for a {num_layers}-layer target")
    if num_layers - 1 in layers:
        raise ConfigError(f"target_layers {layers} holds the target's last layer ({num_layers - 1}): serving reads "
                          "it after the target's final norm, training before it; use layers below it")


def rope_parameters(config) -> dict:
    """The target's RoPE as {"rope_type": kind, "rope_theta": theta, ...} (transformers 4.x: rope_theta and
    rope_scaling; 5.x: rope_parameters): a type the drafter computes exactly as the served model does (default,
    linear, llama3, yarn: training/target/rope.py), else a one-line refusal, since an export would claim what it does
    not compute."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        if getattr(config, "rope_theta", None) is not None:
            params.setdefault("rope_theta", config.rope_theta)
    return served_rope_parameters(params)


def mask_token_id(tokenizer: PreTrainedTokenizerBase, embedding_rows: int, mask_token: str | int = "") -> int:
    """The id of the token at the block's masked positions: `mask_token` (a token string or id the tokenizer
    has), else `<|MASK|>`, added to the tokenizer as a special token if it lacks one. Refused unless the
    target's embedding table has a row for it (the served drafter embeds it with that table); a target with no
    free row is told which of its own tokens could serve."""
    if mask_token in ("", MASK_TOKEN):
        if MASK_TOKEN not in tokenizer.get_vocab():
            tokenizer.add_tokens([AddedToken(MASK_TOKEN, special=True, normalized=False)], special_tokens=True)
        token_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if not 0 <= token_id < embedding_rows:
            raise ConfigError(f"the target's embedding table has {embedding_rows} rows, none for {MASK_TOKEN} (id "
                              f"{token_id}): set mask_token to a token it has that the data never uses, e.g. "
                              f"{', '.join(mask_token_candidates(tokenizer)[:6]) or 'an unused special token'}")
        return token_id
    if isinstance(mask_token, int):
        token_id, name = mask_token, f"id {mask_token}"
        known = 0 <= token_id < len(tokenizer)
    else:
        token_id, name = tokenizer.get_vocab().get(mask_token, -1), repr(mask_token)
        known = token_id >= 0
    if not known:
        raise ConfigError(f"mask_token {name} is not a token of the target's tokenizer; candidates: "
                          f"{', '.join(mask_token_candidates(tokenizer)[:6]) or 'none'}")
    if token_id >= embedding_rows:
        raise ConfigError(f"mask_token {name} (id {token_id}) has no row in the target's {embedding_rows}-row "
                          "embedding table")
    return token_id


def mask_token_candidates(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Special tokens the tokenizer defines but neither its chat template nor its bos/eos/pad/unk use: the
    natural mask token for a target whose table has no free row (SmolLM2: <repo_name>, ..., <empty_output>)."""
    used = {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token}
    template = str(getattr(tokenizer, "chat_template", "") or "")
    return [token.content for _, token in sorted(tokenizer.added_tokens_decoder.items())
            if token.special and token.content not in used and token.content not in template
            and token.content != MASK_TOKEN]


def mask_token_name(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """The token string of `token_id`, as the export writes it beside the id (SGLang reads `mask_token`)."""
    return tokenizer.convert_ids_to_tokens(token_id)


class Target:
    """A frozen causal LM plus its tokenizer; `features()` returns the concatenated selected layer outputs."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, layers: list[int] | None = None,
                 run_all_layers: bool = False, mask_token: str | int = "", teacher: bool = False):
        """`run_all_layers` keeps the whole decoder running in `features` (only to time the difference);
        `mask_token` as in `mask_token_id`; `teacher` (distill = true): `training_features` also carries the
        decoder's final (normed) hidden state, whose logits are the target's next-token distribution, so the
        whole decoder runs."""
        self.teacher = teacher
        run_all_layers = run_all_layers or teacher
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = model.config
        num_layers = self.config.num_hidden_layers
        self.layers = list(layers) if layers else default_feature_layers(num_layers)
        check_feature_layers(self.layers, num_layers)
        self.rope_parameters = rope_parameters(self.config)
        rows = model.get_input_embeddings().weight.shape[0]
        # None without a tokenizer (the benchmarks' random targets); the trainer always has one.
        self.mask_token_id = mask_token_id(tokenizer, rows, mask_token) if tokenizer is not None else None
        self.mask_token = mask_token_name(tokenizer, self.mask_token_id) if tokenizer is not None else None
        self._decoder_layers = model.get_decoder().layers
        self._captured: dict[int, torch.Tensor] | None = None  # a dict only while features() runs
        self._in_features = threading.local()  # compiled layers serve training batches: eval and generate vary
        self.layer_stage = None
        self._stop_after = None if run_all_layers else max(self.layers)
        for index in self.layers:
            self._decoder_layers[index].register_forward_hook(self._capture_hook(index))

    @classmethod
    def load(cls, path: str, device: str | torch.device, dtype: torch.dtype,
             layers: list[int] | None = None, mask_token: str | int = "", teacher: bool = False) -> Target:
        path = str(Path(path).expanduser())
        with loading_target("config and tokenizer", path):
            tokenizer = AutoTokenizer.from_pretrained(path)
            config = AutoConfig.from_pretrained(path)
        # Everything the served format needs, checked before the weights load.
        check_feature_layers(list(layers) if layers else default_feature_layers(config.num_hidden_layers),
                             config.num_hidden_layers)
        rope_parameters(config)
        mask_token_id(tokenizer, config.vocab_size, mask_token)
        with loading_target("weights", path):
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation="sdpa")
        return cls(model.to(device), tokenizer, layers, mask_token=mask_token, teacher=teacher)

    def compile_layers(self, stage) -> None:
        """Run the decoder layers that `features(..., compiled=True)` computes through `stage`
        (training/compile/stages.py); every other forward (evaluation, generate: shapes that vary) stays eager."""
        self.layer_stage = stage
        for layer in self._decoder_layers[: self.layers_run]:
            layer.forward = self._layer_forward(layer, layer.forward, stage)

    def _layer_forward(self, layer: nn.Module, eager, stage):
        def forward(*args, **kwargs):
            if getattr(self._in_features, "active", False):
                return stage(layer, *args, **kwargs)
            return eager(*args, **kwargs)
        return forward

    def _capture_hook(self, index: int):
        def hook(module, args, output):
            if self._captured is not None:
                self._captured[index] = output[0] if isinstance(output, tuple) else output
                if index == self._stop_after:
                    raise _FeaturesReady
        return hook

    @property
    def layers_run(self) -> int:
        """Decoder layers a `features` call computes."""
        return self.config.num_hidden_layers if self._stop_after is None else self._stop_after + 1

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
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 compiled: bool = False) -> torch.Tensor:
        """[B, L] token ids -> [B, L, len(layers) * D]. Right padding needs no mask: causal attention never
        lets a real position see a later pad. `compiled`: through the layer stage, if compile_layers gave one
        (the training batches' fixed shapes; a shape it was not warmed for raises)."""
        return self._forward(input_ids, attention_mask, compiled, final=False)

    @torch.no_grad()
    def training_features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What a training step's drafter receives, through the layer stage: the features, and with `teacher`
        the final hidden state after them ([B, L, (len(layers) + 1) * D]; training/model/step.py splits it)."""
        return self._forward(input_ids, None, True, final=self.teacher)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, compiled: bool,
                 final: bool) -> torch.Tensor:
        self._captured = {}
        self._in_features.active = compiled and self.layer_stage is not None
        try:
            try:
                output = self.model.get_decoder()(input_ids=input_ids.to(self.device), attention_mask=attention_mask,
                                                  use_cache=False)
            except _FeaturesReady:
                output = None
            outputs = [self._captured[index] for index in self.layers]
            return torch.cat([*outputs, output.last_hidden_state] if final else outputs, dim=-1)
        finally:
            self._captured = None
            self._in_features.active = False

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


@contextmanager
def loading_target(what: str, path: str) -> Iterator[None]:
    """A missing or broken model directory (no tokenizer, a config that does not parse or validate, truncated or
    mismatched weights) is the user's to mend: one ConfigError line, not transformers' traceback."""
    try:
        yield
    except (OSError, ValueError, StrictDataclassError, SafetensorError) as err:
        raise ConfigError(f"cannot load the target's {what} from {path}: {_one_line(err)}") from None


def _one_line(err: BaseException, limit: int = 240) -> str:
    """An error's message on one line, cut at `limit` characters: transformers' run to paragraphs."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"
