"""A quiet, fast start: ``rota --help`` lists every command from its stand-in (grpc, protobuf, yaml, aetcd,
torch and every command module stay unimported), ``rota status`` imports no plugin at all; ``--log-level``
works after a subcommand; one spelling of the Tinker command is listed. What is imported is checked here (in
a fresh interpreter, the real ``rota`` entry point); how long it takes is measured, not asserted (see the
README's start-up figures)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from click.testing import CliRunner

from rota.cli.main import cli

PROBE = """
import json, sys
from rota.cli.main import main
sys.argv = ["rota", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit:
    pass
heavy = ("torch", "tinker", "rota_tinker._http.service", "rota._orchestrator.turns", "kubernetes_validate", "grpc",
         "google.protobuf", "yaml", "aetcd", "rota.cli.status", "rota_k8s.cli", "rota_slurm.cli", "rota_tinker.cli",
         "rota_agent.cli")
print(json.dumps({"heavy": [m for m in heavy if m in sys.modules],
                  "plugins": sorted(m for m in sys.modules if m.endswith(".plugin") and m.startswith("rota_"))}))
"""


def _imported(args: list[str], tmp_path) -> dict:
    env = {"PATH": "/usr/bin:/bin", "ROTA_RUNTIME_DIR": str(tmp_path / "rt"), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True,
                         timeout=120, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_help_lists_every_command_without_importing_one(tmp_path):
    seen = _imported(["--help"], tmp_path)
    assert seen["heavy"] == [] and "rota_tinker.plugin" in seen["plugins"]


def test_status_imports_no_plugin_and_no_orchestrator(tmp_path):
    seen = _imported(["status"], tmp_path)
    assert seen["plugins"] == [] and set(seen["heavy"]) == {"grpc", "google.protobuf", "rota.cli.status"}


def test_every_stand_in_says_what_its_command_says():
    """The one-line help ``rota --help`` shows (written in the plugin, so that listing imports nothing) is the
    command's own, and so is whether it is hidden: checked for core's commands and every installed plugin's."""
    from click import Context

    from rota.cli.lazy import LazyCommand
    from rota.cli.main import RotaGroup

    group = RotaGroup("rota")
    group.list_commands(Context(group))
    stand_ins = {n: c for n, c in group.commands.items() if isinstance(c, LazyCommand)}
    assert {"status", "orchestrator", "token", "plugins"} <= set(stand_ins)
    for name, stand_in in stand_ins.items():
        real = stand_in.load()
        assert (stand_in.get_short_help_str(10_000), stand_in.hidden) == (real.get_short_help_str(10_000),
                                                                          real.hidden), name


def test_a_command_that_cannot_be_imported_names_itself_and_leaves_the_others_working():
    from rota.cli.lazy import LazyCommand
    from rota.cli.main import RotaGroup

    group = RotaGroup("rota")
    group.add_command(LazyCommand("broken", "rota_no_such_module.cli:broken", "Never loads."))
    listed = CliRunner().invoke(group, ["--help"])
    assert listed.exit_code == 0 and "broken" in listed.output and "Never loads." in listed.output
    run = CliRunner().invoke(group, ["broken"])
    assert run.exit_code == 1 and "the command 'broken' could not be loaded" in run.output
    assert "rota_no_such_module" in run.output
    assert CliRunner().invoke(group, ["plugins"]).exit_code == 0


def test_a_stand_in_needs_module_and_attribute():
    from rota.cli.lazy import LazyCommand

    with pytest.raises(ValueError, match=r"'rota\.cli\.status' is not 'package\.module:attribute'"):
        LazyCommand("status", "rota.cli.status", "Show.")


@pytest.mark.parametrize("args", [["--log-level", "debug", "plugins"], ["plugins", "--log-level", "debug"],
                                  ["token", "issue", "--log-level", "debug", "--help"]])
def test_log_level_is_accepted_anywhere(args):
    root = logging.getLogger()
    before = root.level
    try:
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        assert root.level == logging.DEBUG
    finally:
        root.setLevel(before)


def test_a_bad_log_level_after_the_subcommand_is_refused_naming_it():
    result = CliRunner().invoke(cli, ["plugins", "--log-level", "loud"])
    assert result.exit_code == 2 and "'loud' is not one of 'debug', 'info', 'warning', 'error'" in result.output


def test_one_spelling_of_the_tinker_command_is_listed():
    pytest.importorskip("rota_tinker")
    listed = CliRunner().invoke(cli, ["--help"]).output
    assert "  tinker " in listed and "  serve " not in listed
    alias = CliRunner().invoke(cli, ["serve", "tinker", "--help"])  # the hidden alias still runs
    assert alias.exit_code == 0 and "--capacity" in alias.output


def test_commands_that_take_another_programs_arguments_leave_its_log_level_alone():
    """`rota slurm submit -- ... --log-level x` and `rota k8s tenant -- python train.py --log-level x`: that
    --log-level is sbatch's or the tenant's, so these commands get no --log-level of their own."""
    pytest.importorskip("rota_slurm")
    pytest.importorskip("rota_k8s")
    from click import Context

    ctx = Context(cli)
    submit = cli.get_command(ctx, "slurm").get_command(ctx, "submit")
    tenant = cli.get_command(ctx, "k8s").get_command(ctx, "tenant")
    status = cli.get_command(ctx, "slurm").get_command(ctx, "status")
    assert "log_level_anywhere" not in {p.name for p in submit.params} | {p.name for p in tenant.params}
    assert "log_level_anywhere" in {p.name for p in status.params}
    shown = CliRunner().invoke(cli, ["k8s", "tenant", "--group", "g", "--image", "img:1", "--", "python",
                                     "train.py", "--log-level", "debug"])
    assert shown.exit_code == 0 and "--log-level" in shown.stdout, shown.output
