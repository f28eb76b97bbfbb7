"""tinker-cookbook 0.6.1's RL recipes, unmodified, against the service: ``recipes/rl_loop`` and ``recipes/math_rl``
(``train``) with their defaults (``loss_fn='stable_reinforce'``: samples recorded with ``record_stability_info``,
data with provenance), each run in its own process as a user runs it, offline, on a tiny Qwen3.

Only what a tiny CPU run needs is passed on their command lines: ``base_url``, ``model_name`` (a tiny Qwen3 under
a hub name the cookbook knows), ``log_path``, and smaller batches and step counts. The model is warmed up to answer
the prompts the runs sample right half the time (``cookbook_world.py``), so the rewards vary and the training steps
run: the test checks the metrics each recipe logs (rewards not all 0, training steps taken, stable_reinforce's
records used) and the service's own account of the trained tokens.

The cookbook lives in its own venv (``ROTA_COOKBOOK_VENV``, default /tmp/rota-cookbook-venv) that sees the main
venv's packages (torch, transformers, tinker stay the pinned ones) and adds the cookbook's other requirements from
PyPI. tinker-cookbook 0.6.1 asks for tml-renderers>=0.4.1, which PyPI does not serve (0.2.1 is its latest); the
cookbook imports it only for the Inkling and Kimi models, so the cookbook is installed without its dependencies and
they are installed by name, tml-renderers left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
from tinker_testlib import KEYS, serving_hf_models

from rota_tinker import TinkerService

VENV = Path(os.environ.get("ROTA_COOKBOOK_VENV", "/tmp/rota-cookbook-venv"))
COOKBOOK = "tinker-cookbook==0.6.1"
REQUIREMENTS = ["aiohttp>=3.9", "blobfile>=3", "chz>=0.4", "cloudpickle>=3", "datasets>=2.14", "pillow>=10",
                "pyrage>=1.4", "termcolor>=2", "tiktoken>=0.12", "math-verify>=0.5", "pylatexenc>=2"]
MODEL = "Qwen/Qwen3-4B-Instruct-2507"
RUN_TIMEOUT_S = 600  # a hang guard, not a threshold
# the first test also makes the venv (a pip install from PyPI, a few minutes at most) and the world (about 30 s)
pytestmark = pytest.mark.timeout(1800)


def _cookbook_python() -> Path:
    """The venv's python, made (once per stamp) with the cookbook installed."""
    python = VENV / "bin" / "python"
    stamp = VENV / ".rota-cookbook"
    want = " ".join([COOKBOOK, *REQUIREMENTS, sys.prefix])
    if stamp.exists() and stamp.read_text() == want and python.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "rota_main_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", COOKBOOK], check=True, timeout=600)
    subprocess.run([*pip, *REQUIREMENTS], check=True, timeout=900)
    stamp.write_text(want)
    return python


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    python = _cookbook_python()
    root = tmp_path_factory.mktemp("cookbook")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_CACHE": str(root / "hub"),
           "HF_DATASETS_CACHE": str(root / "datasets"), "TINKER_API_KEY": KEYS["alice"], "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ""}
    subprocess.run([str(python), str(Path(__file__).with_name("cookbook_world.py")), env["HF_HUB_CACHE"],
                    env["HF_DATASETS_CACHE"]], check=True, env=env, timeout=RUN_TIMEOUT_S)
    yield python, env


@pytest.fixture(scope="module")
def service(world: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    with serving_hf_models([world[1]["HF_HUB_CACHE"]], str(tmp_path_factory.mktemp("cookbook-data")),
                           "tinker-cookbook") as svc:
        yield svc


def _run(world: tuple[Path, dict[str, str]], module: str, *args: str) -> None:
    python, env = world
    proc = subprocess.run([str(python), "-m", module, *args], env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _trained(service: TinkerService) -> int:
    return sum(1 for u in service.unit_timings() if u["tenant"] == "alice" and u["kind"] == "ForwardBackward")


def test_rl_loop_runs_with_its_defaults(world: tuple[Path, dict[str, str]], service: TinkerService,
                                        tmp_path: Path) -> None:
    """rl_loop: GSM8K-style questions (the datasets cache), stable_reinforce, its final checkpoint."""
    before, used = _trained(service), service.state.stability.trained["alice"]
    _run(world, "tinker_cookbook.recipes.rl_loop", f"base_url={service.url}", f"model_name={MODEL}",
         f"log_path={tmp_path / 'rl'}", "batch_size=8", "group_size=4")
    rows = _metrics(tmp_path / "rl")
    rewards = [r["reward/total"] for r in rows]
    assert rows and 0 < max(rewards), rewards  # some answers were right
    assert _trained(service) > before  # a training step ran (a batch whose rewards were all equal is skipped)
    assert service.state.stability.trained["alice"] > used  # on data with provenance, against recorded samples
    assert (tmp_path / "rl" / "checkpoints.jsonl").exists()


def test_math_rl_runs_with_its_defaults(world: tuple[Path, dict[str, str]], service: TinkerService,
                                        tmp_path: Path) -> None:
    """math_rl's train: the arithmetic env (its default), stable_reinforce, two steps."""
    before, used = _trained(service), service.state.stability.trained["alice"]
    _run(world, "tinker_cookbook.recipes.math_rl.train", f"base_url={service.url}", f"model_name={MODEL}",
         f"log_path={tmp_path / 'math'}", "groups_per_batch=4", "max_steps=2")
    rows = [r for r in _metrics(tmp_path / "math") if "env/all/reward/total" in r]
    assert len(rows) == 2, rows
    correct = [r["env/all/correct"] for r in rows if "env/all/correct" in r]
    assert any(c > 0 for c in correct), rows  # some answers were right
    assert _trained(service) >= before + 2  # both steps trained
    assert service.state.stability.trained["alice"] > used  # stable_reinforce, on recorded samples
