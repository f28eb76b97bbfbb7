"""``rota tinker serve`` is wired through the rota entry point and refuses bad flags with one clear line."""

from __future__ import annotations

from click.testing import CliRunner

from rota.testing import cli_with_plugins

cli = cli_with_plugins()  # the `rota` group with every plugin's subcommands, as the executable lists them
KEY = "tml-yxVc8LhBs2Bsf8X2hYZL9ihbDcY8cZTT2bhRaVjPF54"  # 128 random bits and more: weaker keys are refused


def test_rota_tinker_serve_is_a_subcommand() -> None:
    r = CliRunner().invoke(cli, ["tinker", "serve", "--help"])
    assert r.exit_code == 0 and "--tenant" in r.output


def test_bad_flags_are_refused() -> None:
    runner = CliRunner(env={"ROTA_TINKER_KEYS": None})
    r = runner.invoke(cli, ["tinker", "serve"])
    assert r.exit_code == 2 and "no tenants configured" in r.output
    r = runner.invoke(cli, ["tinker", "serve", "--tenant", "alice=sk-wrong"])
    assert r.exit_code == 2 and "must start with 'tml-'" in r.output
    r = runner.invoke(cli, ["tinker", "serve", "--tenant", "alice=" + KEY, "--device", "tpu"])
    assert r.exit_code == 2 and "device 'tpu'" in r.output
    r = runner.invoke(cli, ["tinker", "serve", "--tenant", "alice=" + KEY, "--listen", "nowhere"])
    assert r.exit_code == 2 and "HOST:PORT" in r.output


def test_rota_serve_tinker_is_the_same_command() -> None:
    r = CliRunner().invoke(cli, ["serve", "tinker", "--help"])
    assert r.exit_code == 0 and "--capacity" in r.output and "--base-model" in r.output


def test_bad_base_models_and_capacity_are_refused_naming_the_value(tmp_path: object) -> None:
    runner = CliRunner(env={"ROTA_TINKER_KEYS": None, "ROTA_ORCHESTRATOR": None, "ROTA_TINKER_BASE_MODELS": None})
    ok = ["serve", "tinker", "--tenant", "alice=" + KEY]
    cases = {
        ("--base-model", "acme/lm"): "is not NAME:key=value",
        ("--base-model", "acme/lm:vocab=ten"): "vocab='ten' must be an integer",
        ("--base-model", "acme/lm:width=3"): "'width=3' is not one of",
        ("--base-model", "acme/lm:dim=30,heads=4"): "dim=30 must be a multiple of heads=4",
        ("--base-model", "acme/lm:path=/no/such/file.pt"): "path='/no/such/file.pt' is not a file",
        ("--base-model", "bad name:vocab=3"): "base model name 'bad name' is malformed",
        ("--capacity", "lots"): "--capacity 'lots' is not a size",
        ("--capacity", "1GiB", "--orchestrator", "127.0.0.1:9"): "names an external one",
        ("--units-per-turn", "0"): "0 is not in the range x>=1",
        ("--lora-concurrency", "0"): "0 is not in the range 1<=x<=64",
        ("--lora-concurrency", "65"): "65 is not in the range 1<=x<=64",
        ("--lora-concurrency", "2", "--no-share-base"): "lora_concurrency=2 runs LoRA units together on a shared base",
    }
    for flags, message in cases.items():
        r = runner.invoke(cli, [*ok, *flags])
        assert r.exit_code == 2 and message in r.output, (flags, r.output)
    r = runner.invoke(cli, [*ok, "--base-model", "a:vocab=3", "--base-model", "a:vocab=4"])
    assert r.exit_code == 2 and "base model names repeat" in r.output


def test_model_dirs_are_checked_and_listed_in_help(tmp_path: object) -> None:
    runner = CliRunner(env={"ROTA_TINKER_KEYS": None, "ROTA_TINKER_MODEL_DIRS": None})
    r = runner.invoke(cli, ["serve", "tinker", "--tenant", "alice=" + KEY, "--model-dir", "/no/such/dir"])
    assert r.exit_code == 2 and "'/no/such/dir' does not exist" in r.output, r.output
    r = runner.invoke(cli, ["serve", "tinker", "--help"])
    assert r.exit_code == 0 and "--model-dir" in r.output and "--deterministic" in r.output
