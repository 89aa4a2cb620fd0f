"""The README's Python example runs as written: extracted from README.md and run in a directory
holding what the tour before it creates (the gpt-tiny checkpoint and target.json)."""

from __future__ import annotations

import json
import re
import runpy
import subprocess

import ml_dtypes
import numpy as np
import pytest

from conftest import REPO, TESSERA_BIN


def readme_python_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Python package (python/)", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README.md's Python section has no ```python block"
    return blocks[0]


def tessera(*args: str, cwd) -> bytes:
    if not TESSERA_BIN.exists():
        pytest.fail(f"{TESSERA_BIN} is missing: build it with `cargo build --bin tessera`")
    return subprocess.run([str(TESSERA_BIN), *args], cwd=cwd, check=True, capture_output=True).stdout


def test_readme_python_example_runs_as_written(tmp_path, monkeypatch):
    # The tour's commands the example says it follows.
    (tmp_path / "saved.json").write_bytes(
        tessera("layout", "megatron-gpt", "--tp", "2", "--pp", "2", "--dp", "1", "--num-layers", "4", cwd=tmp_path)
    )
    (tmp_path / "target.json").write_bytes(tessera("layout", "fsdp", "--dp", "3", cwd=tmp_path))
    tessera("synth", "--model", "gpt-tiny", "--layout", "saved.json", "--out", "ckpts/tiny/step-000100", cwd=tmp_path)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "readme_example.py"
    script.write_text(readme_python_example())

    # Every name the example uses is defined by the example itself.
    env = runpy.run_path(str(script), run_name="__main__")

    state = env["state"]
    emb = state["model.embed_tokens.weight"]
    assert emb.dtype == ml_dtypes.bfloat16 and emb.shape == (1000, 64)
    # The example's arrays hold the checkpoint's values: the CLI's dump of the same tensor, which
    # `--check` compared with the synthetic value formula.
    (tmp_path / "req.json").write_text(
        '{"ranks": [[{"fqn": "model.embed_tokens.weight", "offsets": [0, 0], "lengths": [1000, 64]}]]}'
    )
    tessera("load", "ckpts/tiny/step-000100", "--requests", "req.json", "--check", "--dump", "dump", cwd=tmp_path)
    raw = (tmp_path / "dump" / "rank-0.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    begin, end = header["model.embed_tokens.weight"]["data_offsets"]
    assert emb.tobytes() == raw[8 + n + begin : 8 + n + end]
    assert np.any(emb.view(np.uint16) != 0)
    report = env["report"]
    assert report["read_amplification"] == 1.0 and report["io_amplification"] >= 1.0
    assert env["plan"]["world"] == 3 and env["plan"]["rank_plan"]["rank"] == 0
    assert any(t_["fqn"] == "model.embed_tokens.weight" for t_ in env["info"]["tensors"])
    assert (tmp_path / "ckpts/run2/step-10/manifest.json").is_file()
