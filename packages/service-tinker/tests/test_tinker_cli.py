"""``rota tinker serve`` is wired through the rota entry point and refuses bad flags with one clear line."""

from __future__ import annotations

from click.testing import CliRunner

from rota.cli.main import _add_plugin_commands, cli


def setup_module() -> None:
    _add_plugin_commands()  # what the `rota` executable does first: plugins add their subcommands


def test_rota_tinker_serve_is_a_subcommand() -> None:
    r = CliRunner().invoke(cli, ["tinker", "serve", "--help"])
    assert r.exit_code == 0 and "--tenant" in r.output


def test_bad_flags_are_refused() -> None:
    runner = CliRunner(env={"ROTA_TINKER_KEYS": None})
    r = runner.invoke(cli, ["tinker", "serve"])
    assert r.exit_code == 2 and "no tenants configured" in r.output
    r = runner.invoke(cli, ["tinker", "serve", "--tenant", "alice=sk-wrong"])
    assert r.exit_code == 2 and "must start with 'tml-'" in r.output
    r = runner.invoke(cli, ["tinker", "serve", "--tenant", "alice=tml-aaaaaaaaaa", "--device", "tpu"])
    assert r.exit_code == 2 and "device 'tpu'" in r.output
    r = runner.invoke(cli, ["tinker", "serve", "--tenant", "alice=tml-aaaaaaaaaa", "--listen", "nowhere"])
    assert r.exit_code == 2 and "HOST:PORT" in r.output
