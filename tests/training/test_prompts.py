"""python -m training.prompts: ShareGPT's user turns become training prompts and a held-out chat set that never
overlap, with what a small English target cannot use left out; the packaged file gives at least 10,000."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.config import load_config
from training.data.prompts import main
from training.regenerate.run import RegenerateConfig, load_prompts, regenerate, reply_positions


def conversation(number: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"c{number}", "conversations": [{"from": who, "value": text} for who, text in turns]}


def question(number: int) -> str:
    return f"Question {number}: how would you explain recursion to a new programmer, with an example?"


def write_source(path: Path, records: list[dict], cut: bool = True) -> None:
    text = json.dumps(records, indent=2)
    if cut:  # the packaged file ends mid-conversation: everything before the cut is read
        text = text[:-40]
    path.write_text(text)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def test_user_turns_become_prompts_and_a_disjoint_held_out_chat_set(tmp_path, capsys):
    records = [conversation(i, ("human", question(i)), ("gpt", "An answer."), ("human", f"And a follow-up {i}?"),
                            ("gpt", "More."), ("human", "A third turn.")) for i in range(300)]
    records += [
        conversation(1000, ("gpt", "the end of an earlier chunk"), ("human", "Write a haiku about the sea and the sky")),
        conversation(1001, ("human", "continue"), ("gpt", "...")),  # a bare follow-up
        conversation(1002, ("human", "Continue writing please, in the same style as before")),
        conversation(1003, ("human", question(0)), ("gpt", "the same first turn again")),  # a copy
        conversation(1004, ("human", "请用中文解释一下量子计算的基本原理和它的应用前景")),  # not an English prompt
        conversation(1005, ("human", "hi")),  # too short to be a prompt
        conversation(1006, ("human", "x" * 2001)),
        conversation(2000, ("human", question(2000))),  # cut short
    ]
    write_source(tmp_path / "sharegpt.json", records)
    assert main(["--out", str(tmp_path / "out"), "--source", str(tmp_path / "sharegpt.json")]) == 0
    assert "training conversations" in capsys.readouterr().out
    train, chat = read(tmp_path / "out" / "prompts.jsonl"), read(tmp_path / "out" / "chat.jsonl")

    ids = {r["id"] for r in train} | {r["id"] for r in chat}
    assert not {r["id"] for r in train} & {r["id"] for r in chat}
    # The last record is cut off; the refused ones are gone; the chunk that began with the assistant stays.
    assert ids == {f"sharegpt:c{i}" for i in range(300)} | {"sharegpt:c1000"}
    assert 0 < len(chat) < len(train)
    first = next(r for r in train if r["id"] == "sharegpt:c7")
    assert first["messages"] == [{"role": "user", "content": question(7)}, {"role": "assistant", "content": ""},
                                 {"role": "user", "content": "And a follow-up 7?"}]  # two user turns at most
    assert all(r["set"] == "chat" and [m["role"] for m in r["messages"]] == ["user"] for r in chat)
    assert next(r for r in train + chat if r["id"] == "sharegpt:c1000")["messages"][0]["role"] == "user"

    # What regenerate reads: the target answers the empty slot and the last turn.
    records_in, duplicates = load_prompts(str(tmp_path / "out" / "prompts.jsonl"))
    assert len(records_in) == len(train) and duplicates == 0
    assert reply_positions(first["messages"]) == [1, 3]

    # The same source and seed give the same files; another seed another order of the same prompts.
    assert main(["--out", str(tmp_path / "again"), "--source", str(tmp_path / "sharegpt.json")]) == 0
    assert (tmp_path / "again" / "prompts.jsonl").read_bytes() == (tmp_path / "out" / "prompts.jsonl").read_bytes()
    assert main(["--out", str(tmp_path / "seed1"), "--source", str(tmp_path / "sharegpt.json"), "--seed", "1"]) == 0
    shuffled = read(tmp_path / "seed1" / "prompts.jsonl")
    assert shuffled != train and sorted(r["id"] for r in shuffled) == sorted(r["id"] for r in train)


def test_the_packaged_sharegpt_gives_over_ten_thousand_prompts(tmp_path):
    assert main(["--out", str(tmp_path)]) == 0
    train, chat = read(tmp_path / "prompts.jsonl"), read(tmp_path / "chat.jsonl")
    assert len(train) >= 10_000 and len(chat) == 256
    assert not {r["id"] for r in train} & {r["id"] for r in chat}
    multi_turn = sum(len(r["messages"]) > 1 for r in train)
    assert multi_turn > len(train) // 2
    firsts = [r["messages"][0]["content"] for r in train]
    assert len(set(firsts)) == len(firsts)
    code = sum(any(word in text.lower() for word in ("python", "javascript", "```", "function", "sql"))
               for text in firsts)
    assert code > 1000  # code is one of the kinds of prompt the drafter must learn


@pytest.mark.parametrize(("args", "message"), [
    (["--source", "{tmp}/missing.json"], "no ShareGPT file"),
    (["--source", "{tmp}/plain.txt"], "not a ShareGPT file"),
    (["--source", "{tmp}/empty.json"], "no conversation with a usable first user turn"),
    (["--max-turns", "0"], "--max-turns and --chat-prompts must be >= 1"),
    (["--max-turns", "two"], "invalid int value"),
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
