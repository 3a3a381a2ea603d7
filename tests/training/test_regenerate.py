"""python -m training.regenerate on the tiny target: greedy replies are the target's own, multi-turn replies see
the target's earlier ones, every id is written exactly once across kills and restarts, bad input exits 2."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.config import load_config
from training.data.chat import encode_chat
from training.regenerate.run import (
    RegenerateConfig,
    ReplicaGenerator,
    content_id,
    main,
    recover_output,
    regenerate,
)
from training.target.tiny import synthetic_words

REPO = Path(__file__).resolve().parents[2]
WORDS = synthetic_words(300)


def words(rng: random.Random, count: int) -> str:
    return "".join(" " + rng.choice(WORDS) for _ in range(count))


def write_prompts(path: Path, count: int, seed: int = 0) -> list[dict]:
    """Records of one to three turns: some end with a user message, some hold old assistant replies, some have
    their own ids."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        messages = [{"role": "system", "content": words(rng, 3)}] if i % 4 == 0 else []
        for turn in range(1 + i % 3):
            messages.append({"role": "user", "content": words(rng, rng.randint(2, 6))})
            if turn < i % 3 or i % 2:
                messages.append({"role": "assistant", "content": words(rng, 5)})  # replaced by the target's
        records.append({"messages": messages, **({"id": f"rec-{i}"} if i % 3 == 0 else {})})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def config_for(world, prompts: Path, output: Path, *overrides: str) -> RegenerateConfig:
    sets = [f"target_path={world.target}", f"prompts_path={prompts}", f"output_path={output}", "build_tiny=false",
            "num_threads=1", *overrides]
    return load_config("tiny-regenerate", sets, kind=RegenerateConfig)


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@torch.no_grad()
def greedy_reply(model, tokenizer, messages: list[dict], max_new_tokens: int) -> str:
    """The target's greedy reply, one argmax at a time, unbatched and unpadded."""
    ids = encode_chat(tokenizer, messages, generation_prompt=True, template_options={"enable_thinking": False})
    reply = []
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids + reply])).logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        reply.append(token)
    return tokenizer.decode(reply)


def test_greedy_replies_are_the_targets_own_turn_by_turn(tiny_world, tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 9)
    output = tmp_path / "out" / "regenerated.jsonl"
    monkeypatch.setenv("GPUCTL_METRICS", str(tmp_path / "metrics.jsonl"))
    config = config_for(tiny_world, tmp_path / "prompts.jsonl", output, "batch_size=4", "max_new_tokens=10")
    assert regenerate(config) == 0

    records = read_output(output)
    ids = [r.get("id") or content_id(r["messages"]) for r in prompts]
    assert sorted(r["id"] for r in records) == sorted(ids)  # each id exactly once
    model = AutoModelForCausalLM.from_pretrained(tiny_world.target).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_world.target)
    by_id = {r["id"]: r for r in records}
    for prompt, record_id in zip(prompts, ids):
        want = []  # the conversation with the reference's own greedy replies in place of the old ones
        for message in prompt["messages"]:
            if message["role"] == "assistant":
                message = {"role": "assistant", "content": greedy_reply(model, tokenizer, want, 10)}
            want.append(message)
        if want[-1]["role"] != "assistant":
            want.append({"role": "assistant", "content": greedy_reply(model, tokenizer, want, 10)})
        assert by_id[record_id]["messages"] == want
    metrics = read_output(tmp_path / "metrics.jsonl")
    assert metrics[-1]["step"] == metrics[-1]["total_steps"] == 9 and metrics[0]["step"] == 0
    assert all(r["tokens_per_s"] > 0 and "eta_s" in r for r in metrics[1:])

    assert regenerate(config) == 0  # a rerun of a finished output adds nothing
    assert len(read_output(output)) == 9


def test_the_static_decode_writes_what_the_eager_one_writes(tiny_world, tmp_path):
    """decode=static (one shape per width, filler rows, training/regenerate/static_decode.py; graphs on CUDA) gives the
    eager decode's replies, record for record, with batches that are full and one that is not."""
    write_prompts(tmp_path / "prompts.jsonl", 7)
    outputs = {}
    for decode in ("dynamic", "static"):
        output = tmp_path / decode / "regenerated.jsonl"
        config = config_for(tiny_world, tmp_path / "prompts.jsonl", output, "batch_size=3", "max_new_tokens=10",
                            f"decode={decode}")
        assert regenerate(config) == 0
        outputs[decode] = sorted(read_output(output), key=lambda r: r["id"])
    assert outputs["static"] == outputs["dynamic"] and len(outputs["static"]) == 7
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_world.target), AutoTokenizer.from_pretrained(
        tiny_world.target)
    auto = config_for(tiny_world, tmp_path / "prompts.jsonl", tmp_path / "auto.jsonl", "decode=auto")
    assert not ReplicaGenerator(model, tokenizer, auto).static  # on the CPU nothing compiles: no filler rows


def test_a_wide_static_batch_decodes_in_fewer_rows_and_writes_the_same(tiny_world, tmp_path, monkeypatch, capsys):
    """With the cache bound small, every batch of the static decode splits into chunks of fewer rows (each its
    own shape): the records are still the dynamic decode's."""
    from training.regenerate import generation

    write_prompts(tmp_path / "prompts.jsonl", 7)
    outputs = {}
    for decode in ("dynamic", "static"):
        if decode == "static":  # rows = 6 * (8 + 10) // (64 + 10) = 1: one record per chunk
            monkeypatch.setattr(generation, "STATIC_MIN_WIDTH", 64)
            monkeypatch.setattr(generation, "STATIC_CACHE_WIDTH", 8)
        output = tmp_path / decode / "regenerated.jsonl"
        config = config_for(tiny_world, tmp_path / "prompts.jsonl", output, "batch_size=6", "max_new_tokens=10",
                            f"decode={decode}")
        assert regenerate(config) == 0
        outputs[decode] = sorted(read_output(output), key=lambda r: r["id"])
    assert outputs["static"] == outputs["dynamic"] and len(outputs["static"]) == 7
    said = capsys.readouterr().out
    assert "cpu: static decode: 0 CUDA graphs captured" in said and "eager steps" in said


def test_continuous_batching_writes_what_the_static_decode_writes(tiny_world, tmp_path, capsys):
    """decode=continuous (rows refilled as replies end, a conversation's next turn queued at once,
    training/regenerate/continuous.py) gives the static decode's records, multi-turn and shortened ones too."""
    write_prompts(tmp_path / "prompts.jsonl", 11)
    outputs = {}
    for decode in ("static", "continuous"):
        output = tmp_path / decode / "regenerated.jsonl"
        config = config_for(tiny_world, tmp_path / "prompts.jsonl", output, "batch_size=3", "max_new_tokens=40",
                            "max_context_tokens=150", f"decode={decode}")
        assert regenerate(config) == 0
        outputs[decode] = sorted(read_output(output), key=lambda r: r["id"])
    assert outputs["continuous"] == outputs["static"] and len(outputs["static"]) == 11
    assert any(r.get("shortened") for r in outputs["static"])
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in outputs["static"])


def test_continuous_rows_refilled_mid_batch_decode_what_a_static_batch_decodes(tiny_world):
    """With a common word as the end token, replies end at different steps, so rows are refilled while others
    decode, over what earlier prompts left in the cache: every reply is still the static decode's."""
    from training.regenerate.continuous import ContinuousDecoder
    from training.regenerate.generation import left_padded, reply_of
    from training.regenerate.static_decode import DecodeCounters, StaticDecoder

    model = AutoModelForCausalLM.from_pretrained(tiny_world.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_world.target)
    rng = random.Random(5)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": words(rng, rng.randint(2, 9))}], True,
                           {"enable_thinking": False}) for _ in range(9)]
    probe = StaticDecoder(model, 1, 64, 30, [-1], DecodeCounters())
    common = max(set(tokens := probe.generate(*left_padded(prompts[:1], 1, 64, 0))[0]), key=tokens.count)
    eos = [common, tokenizer.eos_token_id]
    static = StaticDecoder(model, len(prompts), 64, 30, eos, DecodeCounters())
    expected = [reply_of(row, eos)[0] for row in static.generate(*left_padded(prompts, len(prompts), 64, 0))]
    assert len({len(r) for r in expected}) > 2  # replies of several lengths

    got = {}
    decoder = ContinuousDecoder(model, 3, 128, 30, eos, 0, DecodeCounters())
    decoder.decode(list(enumerate(prompts)), lambda key, tokens: got.__setitem__(key, tokens))
    assert [reply_of(got[i], eos)[0] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_sampling_is_seeded(tiny_world, tmp_path, decode):
    write_prompts(tmp_path / "prompts.jsonl", 6)
    outputs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        config = config_for(tiny_world, tmp_path / "prompts.jsonl", tmp_path / f"{name}.jsonl", "temperature=1.5",
                            "top_p=0.95", f"seed={seed}", "max_new_tokens=8", "batch_size=3", f"decode={decode}")
        assert regenerate(config) == 0
        outputs[name] = {r["id"]: r["messages"] for r in read_output(tmp_path / f"{name}.jsonl")}
    assert outputs["a"] == outputs["b"] and outputs["a"] != outputs["c"]


def test_a_torn_last_line_is_cut_and_complete_records_count(tmp_path):
    output = tmp_path / "out.jsonl"
    output.write_text('{"id": "a", "messages": []}\n{"id": 7, "messages": []}\n{"id": "b", "mess')
    assert recover_output(output) == {'"a"', "7"}
    assert output.read_text() == '{"id": "a", "messages": []}\n{"id": 7, "messages": []}\n'


def regenerate_command(world, prompts: Path, output: Path, *overrides: str) -> list[str]:
    sets = [f"target_path={world.target}", f"prompts_path={prompts}", f"output_path={output}", "build_tiny=false",
            "num_threads=1", "batch_size=1", "max_new_tokens=32", *overrides]
    return [sys.executable, "-m", "training.regenerate", "--config", "tiny-regenerate"] + [
        a for s in sets for a in ("--set", s)]


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def start_and_wait(command: list[str], output: Path, lines: int, timeout: float = 240) -> subprocess.Popen:
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while lines_in(output) < lines:
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.02)
    return process


@pytest.mark.e2e
@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_killed_and_stopped_runs_resume_with_each_id_exactly_once(tiny_world, tmp_path, decode):
    count = 20  # the kill after 3 records, the stop after 3 more: both well short of it
    prompts = write_prompts(tmp_path / "prompts.jsonl", count)
    output = tmp_path / "regenerated.jsonl"
    command = regenerate_command(tiny_world, tmp_path / "prompts.jsonl", output, f"decode={decode}")

    killed = start_and_wait(command, output, 3)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    with open(output, "ab") as file:  # what a kill in the middle of a write leaves
        file.write(b'{"id": "rec-0", "messages": [{"role": "us')
    after_kill = lines_in(output)
    assert 3 <= after_kill < count

    stopped = start_and_wait(command, output, after_kill + 3)
    stopped.send_signal(signal.SIGTERM)
    log = stopped.communicate(timeout=120)[0]
    assert stopped.returncode == 0, log
    assert "torn last line" in log and "stopped:" in log
    assert lines_in(output) < count and output.read_bytes().endswith(b"\n")

    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    records = read_output(output)
    ids = [r.get("id") or content_id(r["messages"]) for r in prompts]
    assert sorted(r["id"] for r in records) == sorted(ids)  # every id, each exactly once

    straight = tmp_path / "straight.jsonl"
    config = config_for(tiny_world, tmp_path / "prompts.jsonl", straight, "batch_size=1", "max_new_tokens=32")
    assert regenerate(config) == 0
    assert {r["id"]: r for r in records} == {r["id"]: r for r in read_output(straight)}


def interrupt_twice(command: list[str]) -> tuple[int, str, str]:
    """Runs `command`, sends Ctrl-C once it generates and again once the first is taken; its code, stdout, stderr."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(process.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not any(line.startswith("step ") for line in seen):  # generating
        assert process.poll() is None and time.monotonic() < deadline, "".join(seen)
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    # An end before the line was read here is the first Ctrl-C's stop ("stopped:"): the caller tries again.
    while not any("received SIGINT" in line for line in seen) and process.poll() is None:
        assert time.monotonic() < deadline, "".join(seen)
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)  # (nothing, to a process that has ended)
    err = process.stderr.read()
    code = process.wait(timeout=60)
    reader.join(timeout=10)
    return code, "".join(seen), err


@pytest.mark.e2e
def test_a_second_ctrl_c_ends_at_once_in_one_line_and_the_next_run_finishes(tiny_world, tmp_path):
    count = 32
    prompts = write_prompts(tmp_path / "prompts.jsonl", count)
    output = tmp_path / "regenerated.jsonl"
    # One batch of every record, 256 tokens each (about 5 s on the CPU; a batch ends when its last row does), so
    # the second Ctrl-C lands while it is in flight. Under CI's load this test process can still be held off the
    # CPU until the batch is written: then the run stops as after one Ctrl-C, which says nothing about the
    # second, and the attempt is made again.
    command = regenerate_command(tiny_world, tmp_path / "prompts.jsonl", output, f"batch_size={count}",
                                 "max_new_tokens=256")
    for _attempt in range(3):
        output.unlink(missing_ok=True)
        code, out, err = interrupt_twice(command)
        if "stopped: " not in out:
            break
        assert code == 130 and "error:" not in err, out + err  # the first Ctrl-C's stop, in order
    assert code == 130, out + err
    assert err == "error: interrupted: the records being generated were not written; run again to continue\n"
    assert lines_in(output) < count

    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    ids = [r.get("id") or content_id(r["messages"]) for r in prompts]
    assert sorted(r["id"] for r in read_output(output)) == sorted(ids)  # every id, each exactly once


def run_main(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("lines,message", [
    (['{"messages": [{"role": "user", "content": "hi"}]}', "nope"], "prompts.jsonl:2: not a"),
    (['{"id": 1, "messages": [{"role": "user", "content": "a"}]}',
      '{"id": 1, "messages": [{"role": "user", "content": "b"}]}'], "prompts.jsonl:2: id 1 is also line 1's"),
    (['{"id": true, "messages": [{"role": "user", "content": "a"}]}'], "id must be a string or an integer"),
    (['{"messages": [{"role": "assistant", "content": "a"}]}'], "nothing before the first reply"),
])
def test_bad_prompts_are_one_line_errors(tiny_world, tmp_path, capsys, lines, message):
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    sets = [f"target_path={tiny_world.target}", f"prompts_path={tmp_path / 'prompts.jsonl'}",
            f"output_path={tmp_path / 'out.jsonl'}", "build_tiny=false"]
    code, err = run_main(["--config", "tiny-regenerate"] + [a for s in sets for a in ("--set", s)], capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("overrides,message", [
    (["nope=1"], "unknown config key 'nope'"),
    (["top_p=0"], "top_p must be in (0, 1]"),
    (["temperature=-1"], "temperature must be >= 0"),
    (["batch_size=0"], "batch_size must be > 0"),
    (["decode=graphs"], "decode must be one of dynamic, static, continuous, auto"),
    (["decode=continuous"], "gives every row max_context_tokens cache slots: set it"),
    (["decode=continuous", "max_context_tokens=512", "temperature=0.7"], "decodes greedily"),
    (["max_context_tokens=-1"], "max_context_tokens must be >= 0"),
    (["prompts_from=['math']"], "say how many (math:COUNT"),
    (["self_temperature=0"], "self_temperature must be > 0"),
    (["backend=sglang"], "backend must be one of transformers, vllm"),
    (["backend=vllm", "target_devices=[0, 1]"], 'backend = "vllm" runs one engine on one GPU'),
    (["target_devices=[-1]"], "neither a GPU index"),
    (["output_path=~/.cache/gpuctl/tiny-v2/train.jsonl"], "output_path must not be prompts_path"),
])
def test_bad_configs_are_one_line_errors(capsys, overrides, message):
    code, err = run_main(["--config", "tiny-regenerate"] + [a for s in overrides for a in ("--set", s)], capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_an_output_line_that_is_not_a_record_is_an_error_not_a_silent_skip(tiny_world, tmp_path, capsys):
    write_prompts(tmp_path / "prompts.jsonl", 2)
    (tmp_path / "out.jsonl").write_text('{"id": "x", "messages": []}\ngarbage\n')
    sets = [f"target_path={tiny_world.target}", f"prompts_path={tmp_path / 'prompts.jsonl'}",
            f"output_path={tmp_path / 'out.jsonl'}", "build_tiny=false"]
    code, err = run_main(["--config", "tiny-regenerate"] + [a for s in sets for a in ("--set", s)], capsys)
    assert code == 2 and "out.jsonl:2: not a complete record" in err


def test_a_target_with_truncated_weights_is_one_line(tiny_world, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(tiny_world.target, target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    write_prompts(tmp_path / "prompts.jsonl", 2)
    sets = [f"target_path={target}", f"prompts_path={tmp_path / 'prompts.jsonl'}",
            f"output_path={tmp_path / 'out.jsonl'}", "build_tiny=false"]
    code, err = run_main(["--config", "tiny-regenerate"] + [a for s in sets for a in ("--set", s)], capsys)
    assert code == 2 and err.startswith(f"error: cannot load the target's weights from {target}: "), err
    assert err.count("\n") == 1 and not (tmp_path / "out.jsonl").exists()


@pytest.fixture
def vllm_standin(monkeypatch):
    """The stand-in importable as vllm for one test, and gone after it."""
    monkeypatch.syspath_prepend(str(REPO / "tests" / "training" / "vllm_standin"))
    import vllm

    yield vllm
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


def test_the_vllm_backend_writes_what_transformers_writes(tiny_world, tmp_path, vllm_standin):
    """backend=vllm, through a stand-in for vLLM's offline API (tests/training/vllm_standin): the engine gets the
    chat-templated token ids, the stop ids and the reply limit, and the records equal transformers' greedy ones,
    multi-turn replies included."""
    vllm = vllm_standin
    write_prompts(tmp_path / "prompts.jsonl", 7)
    outputs = {}
    for backend in ("transformers", "vllm"):
        output = tmp_path / backend / "regenerated.jsonl"
        config = config_for(tiny_world, tmp_path / "prompts.jsonl", output, "batch_size=3", "max_new_tokens=10",
                            f"backend={backend}")
        assert regenerate(config) == 0
        outputs[backend] = sorted(read_output(output), key=lambda r: r["id"])
    assert outputs["vllm"] == outputs["transformers"] and len(outputs["vllm"]) == 7
    assert any(r.get("truncated") for r in outputs["vllm"])  # some replies ran to the limit
    (init,), calls = [c["init"] for c in vllm.CALLS if "init" in c], [c for c in vllm.CALLS if "generate" in c]
    assert init["model"] == str(tiny_world.target) and init["generation_config"] == "vllm"
    tokenizer = AutoTokenizer.from_pretrained(tiny_world.target)
    assert all(p.max_tokens == 10 and tokenizer.convert_tokens_to_ids("<|im_end|>") in p.stop_token_ids
               for c in calls for p in c["params"])
    assert sum(c["generate"] for c in calls) == sum(len(r["messages"]) for r in outputs["vllm"]) - sum(
        m["role"] != "assistant" for r in outputs["vllm"] for m in r["messages"])  # one prompt per reply


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_the_vllm_backend_without_vllm_is_one_line(tiny_world, tmp_path, capsys):
    write_prompts(tmp_path / "prompts.jsonl", 2)
    sets = [f"target_path={tiny_world.target}", f"prompts_path={tmp_path / 'prompts.jsonl'}",
            f"output_path={tmp_path / 'out.jsonl'}", "build_tiny=false", "backend=vllm"]
    assert main(["--config", "tiny-regenerate"] + [a for s in sets for a in ("--set", s)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [('error: backend = "vllm" needs the vllm package where the regeneration runs (pip install '
                   'vllm); it is not installed')], err
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


def test_a_conversation_that_outgrows_the_targets_window_ends_at_its_last_reply(tiny_world, tmp_path):
    """The tiny target's window is 512 positions: with replies of 200 tokens, the third turn's context leaves no
    room for a reply, so the record keeps the first two turns and their replies and says it was shortened."""
    rng = random.Random(3)
    turns = [words(rng, 4) for _ in range(3)]
    messages = [m for turn in turns for m in ({"role": "user", "content": turn}, {"role": "assistant", "content": ""})]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "long", "messages": messages[:-1]}) + "\n"
                       + json.dumps({"id": "short", "messages": messages[:1]}) + "\n")
    output = tmp_path / "out.jsonl"
    assert regenerate(config_for(tiny_world, prompts, output, "max_new_tokens=200")) == 0
    records = {r["id"]: r for r in read_output(output)}
    long, short = records["long"], records["short"]
    assert long["shortened"] and [m["role"] for m in long["messages"]] == ["user", "assistant"] * 2
    assert [m["content"] for m in long["messages"] if m["role"] == "user"] == turns[:2]
    assert "shortened" not in short and [m["role"] for m in short["messages"]] == ["user", "assistant"]
    assert long["messages"][:2] == short["messages"]  # the same first turn, the same greedy reply
