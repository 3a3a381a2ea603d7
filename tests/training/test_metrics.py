"""The run info for gpuctl: where a run's output goes, absolute, written whole into $GPUCTL_RUN_INFO."""

from __future__ import annotations

import json

from training.output.metrics import announce_output


def test_announce_output_writes_the_absolute_path_only_when_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    info = tmp_path / "tl3.info.json"
    monkeypatch.delenv("GPUCTL_RUN_INFO", raising=False)
    announce_output("output_dir", "runs/x")
    assert not info.exists()

    monkeypatch.setenv("GPUCTL_RUN_INFO", str(info))
    announce_output("output_dir", "runs/ŝ")
    assert json.loads(info.read_text()) == {"output_dir": str(tmp_path / "runs" / "ŝ")}
    assert '"runs/ŝ"' in info.read_text().replace(str(tmp_path) + "/", "")  # unescaped: pull.sh reads it as is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tl3.info.json"]  # no temporary file left

    monkeypatch.setenv("GPUCTL_RUN_INFO", str(tmp_path / "missing" / "tl3.info.json"))
    announce_output("output_dir", "runs/x")  # cannot write: a warning, the run goes on
    assert "warning: cannot write" in capsys.readouterr().out
