"""python -m training.prompts: a mix of sources (ShareGPT's user turns, CodeI/O's tasks, math generators, the
target's own user turns) becomes training prompts, cleaned of duplicates and of anything overlapping an evaluation
set, beside a held-out chat set that never changes; the packaged sources give what the preset counts on."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from training.config import load_config
from training.data.prompts import main
from training.data.report import main as report_main
from training.data.sources import humaneval_prompts
from training.regenerate.run import RegenerateConfig, load_prompts, regenerate, reply_positions
from training.target.tiny import synthetic_words

WORDS = synthetic_words(400, seed=7)
# The held-out chat set every served τ so far was measured on (../shared/data/smollm2-135m-chat.jsonl): the
# packaged ShareGPT must keep giving exactly it, whatever the training mix becomes.
HELD_OUT_CHAT_SHA256 = "fad08fade687786be0d609ee5c31f68418228a15f38d1ceb3d67fbd839c992a8"


def conversation(number: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"c{number}", "conversations": [{"from": who, "value": text} for who, text in turns]}


def question(number: int) -> str:
    """A distinct question (prompts that differ in one word are near duplicates, and cleaning drops them)."""
    rng = random.Random(number)
    return "Explain " + " ".join(rng.choice(WORDS) for _ in range(12)) + f", with an example ({number})?"


def write_source(path: Path, records: list[dict], cut: bool = True) -> None:
    text = json.dumps(records, indent=2)
    if cut:  # the packaged file ends mid-conversation: everything before the cut is read
        text = text[:-40]
    path.write_text(text)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def test_user_turns_become_prompts_and_a_disjoint_held_out_chat_set(tmp_path, capsys):
    records = [conversation(i, ("human", question(i)), ("gpt", "An answer."), ("human", f"And a follow-up {i}?"),
                            ("gpt", "More."), ("human", f"A third turn {i}.")) for i in range(300)]
    records += [
        conversation(1000, ("gpt", "the end of an earlier chunk"), ("human", "Write a haiku about the sea and the sky")),
        conversation(1001, ("human", "continue"), ("gpt", "...")),  # a bare follow-up, and nothing else
        conversation(1002, ("human", "Continue writing please"), ("gpt", "..."), ("human", question(1002))),
        conversation(1003, ("human", question(0)), ("gpt", "the same first turn again")),  # a copy
        conversation(1004, ("human", "请用中文解释一下量子计算的基本原理和它的应用前景")),  # not an English prompt
        conversation(1005, ("human", "hi")),  # too short to be a prompt
        conversation(1006, ("human", "x" * 6001)),  # longer than any turn kept
        conversation(2000, ("human", question(2000))),  # cut short
    ]
    write_source(tmp_path / "sharegpt.json", records)
    assert main(["--out", str(tmp_path / "out"), "--source", str(tmp_path / "sharegpt.json")]) == 0
    assert "training prompts" in capsys.readouterr().out
    train, chat = read(tmp_path / "out" / "prompts.jsonl"), read(tmp_path / "out" / "chat.jsonl")

    ids = {r["id"] for r in train} | {r["id"] for r in chat}
    assert not {r["id"] for r in train} & {r["id"] for r in chat}
    # The last record is cut off; the refused ones are gone; the chunk that began with the assistant stays, the
    # one that began with a bare follow-up starts at its next turn, and of two with one first turn one stays.
    copies = {"sharegpt:c0", "sharegpt:c1003"}
    assert len(ids & copies) == 1
    assert ids - copies == {f"sharegpt:c{i}" for i in range(1, 300)} | {"sharegpt:c1000", "sharegpt:c1002"}
    assert 0 < len(chat) < len(train)
    first = next(r for r in train + chat if r["id"] == "sharegpt:c7")
    assert first["messages"] == [{"role": "user", "content": question(7)}, {"role": "assistant", "content": ""},
                                 {"role": "user", "content": "And a follow-up 7?"},
                                 {"role": "assistant", "content": ""},
                                 {"role": "user", "content": "A third turn 7."}]  # every user turn
    assert next(r for r in train if r["id"] == "sharegpt:c1002")["messages"] == [
        {"role": "user", "content": question(1002)}]
    assert all(r["set"] == "chat" and [m["role"] for m in r["messages"]] == ["user"] for r in chat)
    assert next(r for r in train + chat if r["id"] == "sharegpt:c1000")["messages"][0]["role"] == "user"

    # What regenerate reads: the target answers the empty slots and the last turn.
    records_in, duplicates = load_prompts(str(tmp_path / "out" / "prompts.jsonl"))
    assert len(records_in) == len(train) and duplicates == 0
    assert reply_positions(first["messages"]) == [1, 3, 5]
    mix = json.loads((tmp_path / "out" / "prompts.mix.json").read_text())
    source = mix["sources"][str(tmp_path / "sharegpt.json")]
    assert source["exact_duplicates"] == 1 and source["kept"] == len(train)

    # The same source and seed give the same files; another seed another order of the same prompts (and perhaps
    # the other of the two copies).
    assert main(["--out", str(tmp_path / "again"), "--source", str(tmp_path / "sharegpt.json")]) == 0
    assert (tmp_path / "again" / "prompts.jsonl").read_bytes() == (tmp_path / "out" / "prompts.jsonl").read_bytes()
    assert main(["--out", str(tmp_path / "seed1"), "--source", str(tmp_path / "sharegpt.json"), "--seed", "1"]) == 0
    shuffled = read(tmp_path / "seed1" / "prompts.jsonl")
    assert shuffled != train and {r["id"] for r in shuffled} - copies == {r["id"] for r in train} - copies


def test_duplicates_near_duplicates_and_evaluation_overlaps_are_dropped_and_counted(tmp_path):
    """A prompt sharing 13 words with a HumanEval problem or a held-out chat prompt never trains; a copy or a
    one-word edit of an earlier prompt neither; prompts that only share a phrase stay."""
    problem = humaneval_prompts()[0][1]  # has_close_elements: a docstring of some 40 words
    records = [conversation(i, ("human", question(i))) for i in range(200)]
    write_source(tmp_path / "plain.json", records, cut=False)
    assert main(["--out", str(tmp_path / "plain"), "--source", str(tmp_path / "plain.json")]) == 0
    chat = read(tmp_path / "plain" / "chat.jsonl")
    held_out = chat[0]["messages"][0]["content"]
    span = " ".join(held_out.split()[1:15])  # 14 of its words, in the middle of another prompt
    long = question(4) + " " + question(6)  # some 35 words
    tricky = [
        conversation(500, ("human", "Please solve this for me:\n" + problem)),  # HumanEval, pasted
        conversation(501, ("human", f"My friend asked '{span}' and I did not know what to say.")),
        conversation(502, ("human", question(3))),  # an exact copy of an earlier prompt
        conversation(503, ("human", long)),
        conversation(504, ("human", long.replace("Explain", "Describe", 1))),  # one word changed
        conversation(505, ("human", "Explain " + " ".join(question(5).split()[1:4]) + " in plain words.")),
    ]
    write_source(tmp_path / "tricky.json", records + tricky, cut=False)
    assert main(["--out", str(tmp_path / "out"), "--source", str(tmp_path / "tricky.json")]) == 0
    train = {r["id"] for r in read(tmp_path / "out" / "prompts.jsonl")}
    assert read(tmp_path / "out" / "chat.jsonl") == chat  # the held-out set does not depend on the rest
    assert {"sharegpt:c500", "sharegpt:c501"}.isdisjoint(train)
    # of a copy and its original, and of a prompt and its one-word edit, one stays (the first in the shuffle)
    assert len({"sharegpt:c3", "sharegpt:c502"} & train) == len({"sharegpt:c503", "sharegpt:c504"} & train) == 1
    assert "sharegpt:c505" in train  # three shared words are a phrase, not a copy
    counts = json.loads((tmp_path / "out" / "prompts.mix.json").read_text())["sources"][str(tmp_path / "tricky.json")]
    assert counts["contaminated"] == {"humaneval": 1, "chat": 1}
    assert counts["exact_duplicates"] == 1 and counts["near_duplicates"] == 1
    assert counts["offered"] == len(records) - len(chat) + len(tricky)
    assert counts["kept"] == len(train) == counts["offered"] - 4


def test_the_packaged_sources_give_the_mix_and_the_same_held_out_chat_set(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--mix", "sharegpt", "codeio", "math:400"]) == 0
    train, chat = read(tmp_path / "prompts.jsonl"), read(tmp_path / "chat.jsonl")
    assert hashlib.sha256((tmp_path / "chat.jsonl").read_bytes()).hexdigest() == HELD_OUT_CHAT_SHA256
    assert len(chat) == 256 and not {r["id"] for r in train} & {r["id"] for r in chat}
    by_source = {name: [r for r in train if r["id"].startswith(name + ":")] for name in ("sharegpt", "codeio", "math")}
    assert len(by_source["sharegpt"]) > 13_000 and len(by_source["codeio"]) > 3_000 and len(by_source["math"]) == 400
    assert sum(r["id"].startswith(("sharegpt:", "codeio:", "math:")) for r in train) == len(train)
    multi_turn = sum(len(r["messages"]) > 3 for r in by_source["sharegpt"])
    assert multi_turn > len(by_source["sharegpt"]) // 4  # three user turns and more are kept
    assert all("Python" in r["messages"][0]["content"] for r in by_source["codeio"])
    kinds = {r["id"].split(":")[1] for r in by_source["math"]}
    assert {"gsm_symbolic", "simple_equations", "fraction_simplification"} <= kinds
    firsts = [r["messages"][0]["content"] for r in train]
    assert len(set(firsts)) == len(firsts)
    mix = json.loads((tmp_path / "prompts.mix.json").read_text())
    assert mix["sources"]["sharegpt"]["contaminated"]["chat"] > 100  # ShareGPT's chunks of the held-out chats
    assert mix["held_out"] == {"chat": 256, "humaneval": 164}
    # The math source is seeded: the same seed, the same problems; another seed, others.
    problems = {}
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        assert main(["--out", str(tmp_path / name), "--mix", "math:50", "--seed", seed]) == 0
        problems[name] = sorted(r["messages"][0]["content"] for r in read(tmp_path / name / "prompts.jsonl"))
    assert len(problems["a"]) == 50 and problems["a"] == problems["b"] != problems["c"]


@pytest.mark.parametrize(("args", "message"), [
    (["--source", "{tmp}/missing.json"], "no ShareGPT file"),
    (["--source", "{tmp}/plain.txt"], "not a ShareGPT file"),
    (["--source", "{tmp}/empty.json"], "no usable prompt"),
    (["--max-turns", "-1"], "--max-turns must be >= 0"),
    (["--max-turns", "two"], "invalid int value"),
    (["--mix", "math"], "say how many (math:COUNT"),
    (["--mix", "math:0"], "must be a whole number > 0"),
    (["--mix", "self:10"], "make it with python -m training.regenerate"),
    (["--mix", "codeio", "codeio"], "names a source twice"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    (tmp_path / "plain.txt").write_text("not json at all")
    (tmp_path / "empty.json").write_text("[]")
    argv = ["--out", str(tmp_path / "out"), *[a.format(tmp=tmp_path) for a in args]]
    try:
        code = main(argv)
    except SystemExit as exit_:  # the argument parser's own refusals
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out" / "prompts.jsonl").exists()


def test_regeneration_writes_its_prompts_from_sharegpt_on_first_use(tiny_world, tmp_path):
    """prompts_from: a regeneration whose prompts_path does not exist yet writes it (and chat.jsonl beside it)
    from the source, then answers every training prompt; a second run finds them and writes nothing twice."""
    write_source(tmp_path / "sharegpt.json", [conversation(i, ("human", question(i))) for i in range(200)], cut=False)
    prompts, output = tmp_path / "data" / "prompts.jsonl", tmp_path / "data" / "regenerated.jsonl"
    sets = [f"target_path={tiny_world.target}", f"prompts_path={prompts}", f"output_path={output}",
            f"prompts_from={tmp_path / 'sharegpt.json'}", "build_tiny=false", "num_threads=1", "max_new_tokens=4"]
    assert regenerate(load_config("tiny-regenerate", sets, kind=RegenerateConfig)) == 0
    train, chat = read(prompts), read(tmp_path / "data" / "chat.jsonl")
    assert len(train) + len(chat) == 200 and chat
    assert sorted(r["id"] for r in read(output)) == sorted(r["id"] for r in train)
    before = prompts.read_bytes()
    assert regenerate(load_config("tiny-regenerate", sets, kind=RegenerateConfig)) == 0
    assert prompts.read_bytes() == before and len(read(output)) == len(train)


def test_a_regeneration_mixes_in_the_targets_own_user_turns_and_reports_its_data(tiny_world, tmp_path, capsys):
    """The self source: the target writes user turns (sampled, seeded), they join the mix, the target answers
    them; the report after the run, and `python -m training.data_report`, count every source's conversations."""
    write_source(tmp_path / "sharegpt.json", [conversation(i, ("human", question(i))) for i in range(40)], cut=False)
    # A random target rarely ends a turn: a high temperature lets it reach its end-of-turn token within 96.
    common = [f"target_path={tiny_world.target}", f"prompts_from=['{tmp_path / 'sharegpt.json'}', 'self:6']",
              "build_tiny=false", "num_threads=1", "max_new_tokens=4", "self_temperature=8", "self_top_p=1",
              "self_max_tokens=96"]
    written = {}
    for name in ("a", "b"):
        sets = [*common, f"prompts_path={tmp_path / name / 'prompts.jsonl'}",
                f"output_path={tmp_path / name / 'regenerated.jsonl'}"]
        assert regenerate(load_config("tiny-regenerate", sets, kind=RegenerateConfig)) == 0
        written[name] = read(tmp_path / name / "prompts.jsonl")
    own = [r for r in written["a"] if r["id"].startswith("self:")]
    assert len(own) == 6 and all(len(r["messages"][0]["content"]) >= 16 for r in own)
    assert written["a"] == written["b"]  # seeded
    output = read(tmp_path / "a" / "regenerated.jsonl")
    assert sorted(r["id"] for r in output) == sorted(r["id"] for r in written["a"])
    out = capsys.readouterr().out
    assert "self " in out and "prompts (mix" in out  # the report, at the end of the run

    assert report_main([str(tmp_path / "a" / "regenerated.jsonl"), "--tokenizer", str(tiny_world.target),
                        "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["unit"] == "tokens" and result["sources"]["self"]["conversations"] == 6
    assert sum(row["conversations"] for row in result["sources"].values()) == len(output)
    assert result["mix"]["sources"]["self"]["kept"] == 6
    assert report_main([str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"error: data file not found: {tmp_path / 'missing.jsonl'}"
