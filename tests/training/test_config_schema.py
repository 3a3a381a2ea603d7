"""training/config_schema.json, which gpuctl checks launches against on the workstation, is what the config
dataclasses and presets say now."""

import json

from training import config_schema


def test_the_committed_schema_is_the_generated_one():
    committed = config_schema.SCHEMA_FILE.read_text()
    assert committed == config_schema.render(), (
        f"{config_schema.SCHEMA_FILE.name} is out of date with training/config.py, training/regenerate/run.py or "
        f"training/presets/: regenerate it with `{config_schema.COMMAND}` and commit it")


def test_the_schema_mirrors_the_type_check():
    doc = json.loads(config_schema.render())
    train, regenerate = doc["tasks"]["train"], doc["tasks"]["regenerate"]
    assert train["keys"]["lr"] == {"type": "float", "name": "float"}
    assert train["keys"]["devices"]["type"] == {"union": [{"list": {"union": ["int", "str"]}}, "str"]}
    assert train["keys"]["length_buckets"]["type"] == {"list": "int"}
    assert "tiny" in train["presets"] and "tiny-regenerate" in regenerate["presets"]
    assert "prompts_path" in regenerate["keys"] and "prompts_path" not in train["keys"]
