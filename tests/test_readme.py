"""The READMEs' commands as written: README.md's first screen shows the demo and the tests, its install line
names extras that exist; server/README.md's curl examples run, in order in one shell, against a server
started as README.md says (`python -m rollplex.server --format-warmup-steps 30`, on a free port instead of
30000, which the examples' URLs are moved to), and every answer is a success. The demo's own command, as
written, is the slow tier's (it trains until the target: minutes)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import free_port, wait_for_health

ROOT = Path(__file__).resolve().parents[1]
FIRST_SCREEN = 40  # lines


def bash_blocks(path: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)


def commands(block: str) -> list[str]:
    """The block's commands without comments (a trailing `# ...` after two spaces), continuations joined."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s{2,}#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def readme_command(prefix: str) -> str:
    found = [c for b in bash_blocks(ROOT / "README.md") for c in commands(b) for c in c.split(" && ")
             if c.startswith(prefix)]
    assert found, f"README.md shows no `{prefix}` command"
    return found[0]


def test_first_screen_shows_the_demo_and_the_tests():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN])
    assert "python -m rollplex.demo" in head and "python -m pytest -q" in head
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = re.findall(r"^([a-z]+) = \[", section, re.M)
    assert "dev" in extras and "plot" in extras
    for install in re.findall(r'pip install -e "\.\[([a-z,]+)\]"', head):
        assert set(install.split(",")) <= set(extras), install
    assert readme_command("python -m rollplex.demo") == "python -m rollplex.demo"


def test_ci_runs_the_readme_test_command():
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("python -m pytest")]
    assert ci == [readme_command("python -m pytest")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python -m rollplex.server --format-warmup-steps 30` as README.md shows it, on a free port."""
    cwd = tmp_path_factory.mktemp("readme-server")
    port = free_port()
    cmd = readme_command("python -m rollplex.server")
    proc = subprocess.Popen([sys.executable, *cmd.split()[1:], "--port", str(port)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                                 "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc, timeout=300)
        yield port, cwd
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_server_readme_curl_examples_run_as_written(server):
    port, cwd = server
    from PIL import Image

    Image.new("RGB", (56, 56), (220, 40, 40)).save(cwd / "cat.png")  # the examples' image
    blocks = [b for b in bash_blocks(ROOT / "server" / "README.md") if "curl " in b]
    assert len(blocks) >= 4  # /generate, /rollout -> /train_step, /save /load, SGLang's utility endpoints
    script = "set -euo pipefail\n" + "\n".join(
        b.replace("localhost:30000", f"localhost:{port}") + "\necho '<<end of block>>'" for b in blocks)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # `python` of this venv
    run = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert out.count("<<end of block>>") == len(blocks)
    assert '"error"' not in out, out  # every answer a success: the error shape is {"error": {...}, "detail"}
    # what the examples answered (curl prints no newline after a JSON answer): a generation and a stream,
    # two train steps, a save and a load, the utilities
    answers = _json_objects(out)
    assert sum("meta_info" in a for a in answers) >= 1 and "data: [DONE]" in out
    assert sum("actor/pg_loss" in a for a in answers) == 2
    saved = [a for a in answers if str(a.get("path", "")).endswith("run1/global_step_100")]
    assert len(saved) == 2 and saved[1]["data_state"] == {"step": 100}  # the save, then the load
    assert any(a.get("object") == "list" for a in answers) and "Cache flushed." in out
    assert any(a.get("is_generation") is True for a in answers) and any("internal_states" in a for a in answers)
    assert "health_generate: 200" in out


def _json_objects(text: str) -> list[dict]:
    """Every top-level JSON object in `text`, where objects may follow each other on one line."""
    dec, out, i = json.JSONDecoder(), [], 0
    while (i := text.find("{", i)) >= 0:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        out.append(obj)
        i = end
    return out


@pytest.mark.slow
def test_the_demo_command_as_written(tmp_path):
    cmd = readme_command("python -m rollplex.demo")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the demo picks its own threads
    run = subprocess.run([sys.executable, *cmd.split()[1:]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=1800, env={**env, "ROLLPLEX_CACHE": str(tmp_path / "cache"),
                                            "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "CPU threads: 1 (the tiny model's default" in run.stdout
    [folder] = (tmp_path / "runs" / "rollplex").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["stopped"] == "target" and summary["reached_at"] == summary["steps"]
    assert "reached the target 0.8 at step" in run.stdout and "\r" not in run.stdout
    history = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert history[0]["critic/score/mean"] < 0.5, "the warmed-up model starts near chance (0.25)"
    assert sum(h["critic/score/mean"] for h in history[-3:]) / 3 >= 0.8
    if importlib.util.find_spec("matplotlib") is not None:
        assert (folder / "reward.png").stat().st_size > 1000
