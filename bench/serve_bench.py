"""The exported drafter, served by the reference implementation at the real Qwen3-8B shape.

    python bench/serve_bench.py [--small] [--device cuda] [--prompt-len 1024] [--new-tokens 256] [--json F]

Builds a random-weight Qwen3-8B-shaped target (bf16, from a transformers config: no download) and a random
drafter of the trainer (5 layers, block 16), checkpoints it with the trainer's own code, exports it with
`training.serve.export` (the directory SGLang and vLLM load), loads that with the reference `DFlashDraftModel`, and
prints a table: the reference drafter's time per block (one forward over the context plus a 16-token block,
CUDA events), the whole greedy speculative loop (`dflash_generate`) per output token, and peak memory. The
reference's proposals for one block are compared with the trainer's drafter on the same context.

Random weights accept about one token per block: the loop's figures are the cost of drafting and verifying,
not a speedup. `--small` is a toy shape for the CPU (a smoke test runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.model.drafter import Drafter, DrafterConfig
from training.output.checkpoint import save_checkpoint
from training.serve.export import export_checkpoint
from training.target.frozen import Target

QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960}
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 4096}


def random_target(shape: dict, device: torch.device, dtype: torch.dtype) -> Target:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    with torch.device(device):  # initialised in place: 8 B parameters are slow to initialise on a CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return Target(model, None)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn() over repeats, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1000)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a toy shape for the CPU")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import dflash.model as reference

    device = torch.device(args.device)
    if device.type != "cuda":  # the reference loop times itself with torch.cuda.synchronize
        reference._cuda_time = time.perf_counter
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SMALL if args.small else QWEN3_8B
    torch.manual_seed(0)
    target = random_target(shape, device, dtype)
    mask_id = shape["vocab_size"] - 1  # a row of the table, as <|MASK|> has in a real target
    config = DrafterConfig.from_target(target.config, 5, 16, target.layers, mask_id)
    embedding, head = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
    with torch.device(device):
        drafter = Drafter(config, embedding, head).to(dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base_mib = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0

    with tempfile.TemporaryDirectory() as tmp:
        optimizer = torch.optim.AdamW(drafter.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        began = time.perf_counter()
        checkpoint = save_checkpoint(Path(tmp) / "run", 0, drafter, optimizer, scheduler, {}, {}, keep=1)
        _, out = export_checkpoint(checkpoint, Path(tmp) / "export",
                                   "bfloat16" if dtype == torch.bfloat16 else "float32")
        export_s = time.perf_counter() - began
        export_mib = sum(f.stat().st_size for f in out.iterdir()) / 2**20
        served, info = reference.DFlashDraftModel.from_pretrained(str(out), output_loading_info=True, dtype=dtype)
    assert all(len(v) == 0 for v in info.values()), info
    served = served.to(device).eval()
    loaded_mib = torch.cuda.memory_allocated(device) / 2**20 - base_mib if device.type == "cuda" else 0.0

    prompt = torch.randint(0, shape["vocab_size"] - 1, (1, args.prompt_len), device=device)
    with torch.no_grad():
        states = target.model(prompt, output_hidden_states=True).hidden_states
        context = reference.extract_context_feature(states, served.target_layer_ids)
        block = torch.full((1, 16), mask_id, device=device)
        block[0, 0] = prompt[0, -1]
        positions = torch.arange(args.prompt_len - 1 + 16, device=device)[None]
        noise = embedding[block]

        def draft_block():
            hidden = served(target_hidden=context[:, :-1], noise_embedding=noise, position_ids=positions)
            return served.compute_logits(hidden[:, 1:], target.model.get_output_embeddings()).argmax(-1)

        draft_ms = timed(draft_block, device, args.repeats)
        theirs = draft_block()
        from training.model.attention import build_mask

        anchors = torch.tensor([[args.prompt_len - 1]], device=device)
        mask = build_mask("sdpa", anchors, torch.ones_like(anchors, dtype=torch.bool), args.prompt_len - 1, 16)
        hidden = drafter.eval()(context[:, :-1], block[:, :1], anchors, mask)
        ours = drafter.logits(hidden[:, 1:]).argmax(-1)
        agree = (ours == theirs).float().mean().item()

        began = time.perf_counter()
        stats = reference.dflash_generate(served, target.model, prompt, args.new_tokens, None, return_stats=True)
        loop_s = time.perf_counter() - began
    peak_mib = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "device": name, "torch": torch.__version__, "shape": "small" if args.small else "qwen3-8b",
        "drafter_params_m": sum(p.numel() for p in drafter.parameters() if p.requires_grad) / 1e6,
        "export_s": export_s, "export_mib": export_mib, "drafter_loaded_mib": loaded_mib,
        "prompt_len": args.prompt_len, "draft_ms_per_block": draft_ms, "proposal_agreement": agree,
        "loop_ms_per_token": stats.time_per_output_token * 1000, "loop_s": loop_s,
        "mean_accepted": sum(stats.acceptance_lengths) / len(stats.acceptance_lengths),
        "output_tokens": stats.num_output_tokens, "peak_mib": peak_mib,
    }
    rows = [("device", name), ("drafter trainable parameters", f"{report['drafter_params_m']:.0f} M"),
            ("export (checkpoint -> served dir)", f"{export_s:.1f} s, {export_mib:.0f} MiB"),
            ("reference drafter loaded", f"{loaded_mib:.0f} MiB on the device"),
            (f"draft one block (context {args.prompt_len - 1}, 16 tokens)", f"{draft_ms:.2f} ms"),
            ("proposals equal to the trainer's drafter", f"{agree:.0%}"),
            ("greedy loop per output token", (f"{report['loop_ms_per_token']:.2f} ms "
                                             f"({stats.num_output_tokens} tokens, {report['mean_accepted']:.2f} "
                                             "per step)")),
            ("peak memory (target + drafter + loop)", f"{peak_mib:.0f} MiB")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
