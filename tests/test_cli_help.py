"""What `crossfeed --help` shows: flags without a value placeholder, the argument names the errors
use, and the commands in the order of the workflow (convert first)."""

from __future__ import annotations

import re

import typer
from typer.testing import CliRunner

from crossfeed.cli.main import COMMAND_ORDER, app


def help_of(*path: str) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "160", "TERMINAL_WIDTH": "160"})
    assert result.exit_code == 0, result.output
    return result.output


def every_command(cmd, path: tuple[str, ...] = ()):
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from every_command(sub, (*path, name))


def test_flags_show_no_placeholder():
    root = typer.main.get_command(app)
    flags = 0
    for path, cmd in every_command(root):
        text = help_of(*path)
        assert "<bool>" not in text, (path, text)
        flags += sum(bool(getattr(p, "is_flag", False)) for p in cmd.params)
    assert flags > 10  # --overwrite, --verify/--no-verify, --drop-last/--keep-last, … were all looked at
    images = help_of("convert", "images")
    assert re.search(r"--overwrite\s+Replace", images), images
    assert re.search(r"--verify\s+--no-verify\s+Check", images), images


def test_convert_images_usage_names_input_like_its_error(tmp_path):
    usage = next(line for line in help_of("convert", "images").splitlines() if "Usage:" in line)
    assert "INPUT" in usage and "src" not in usage, usage
    missing = CliRunner().invoke(app, ["convert", "images"])
    assert missing.exit_code == 2 and "INPUT" in missing.output and "src" not in missing.output.lower()


def test_commands_are_listed_in_workflow_order():
    root = typer.main.get_command(app)
    names = root.list_commands(typer.Context(root))
    assert names[0] == "convert" and set(names) == set(COMMAND_ORDER), names
    assert names == sorted(names, key=COMMAND_ORDER.index)
    text = help_of()
    shown = [n for n in re.findall(r"^│ (\w+)\s", text, flags=re.M) if n in COMMAND_ORDER]
    assert shown == names, text
