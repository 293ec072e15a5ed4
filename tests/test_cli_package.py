"""The CLI package's house order (imports point one way, nothing heavy before a command runs), the entry points,
`futx --version` and help that shows defaults."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from futx import gpus

REPO = Path(__file__).resolve().parents[1]
CLI = REPO / "futx" / "cli"
SHARED = {"registry", "parser", "validators", "options", "models", "version", "ppl_results"}
COMMAND_MODULES = {"generate", "ppl", "pack", "serve", "build", "bench", "train_draft"}


def cli_imports(path: Path) -> set[str]:
    """The futx.cli modules `path` imports (relative or absolute, at any depth)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:          # from . import x / from .x import y
                names |= {base} if base else {a.name for a in node.names}
            elif base == "futx.cli":
                names |= {a.name for a in node.names}
            elif base.startswith("futx.cli."):
                names.add(base.split(".")[2])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[2] for a in node.names if a.name.startswith("futx.cli.")}
    return names


def python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout


def test_imports_point_down():
    modules = {p.stem for p in CLI.glob("*.py")} - {"__init__", "__main__"}
    assert COMMAND_MODULES | SHARED | {"app"} == modules, "a new module: place it in this test's layers"
    for name in SHARED:
        assert not cli_imports(CLI / f"{name}.py") & (COMMAND_MODULES | {"app"}), f"{name} imports upward"
    for name in COMMAND_MODULES:
        assert not cli_imports(CLI / f"{name}.py") & (COMMAND_MODULES | {"app"}), f"{name} imports a command"
    assert not cli_imports(CLI / "__init__.py") - {"registry", "app"}
    # outside the CLI, futx's library code does not import the command line
    for path in (REPO / "futx").rglob("*.py"):
        if CLI not in path.parents and path != REPO / "futx" / "__main__.py":   # `python -m futx`
            text = path.read_text()
            assert "futx.cli" not in text and "from futx import cli" not in text, path


@pytest.mark.skipif(gpus.hopper_visible(), reason="on a Hopper machine --backend auto asks torch")
def test_help_and_validation_load_no_torch():
    out = python("import sys\n"
                 "from futx.cli import app\n"
                 "p = app.build_parser()\n"
                 "for cmd in app.COMMANDS.values():\n"
                 "    extra = {'bench': ['decode'], 'pack': ['--out', '.'], 'build': ['--out', '.'], "
                 "'train-draft': ['--out', '.']}.get(cmd.name, [])\n"
                 "    args = p.parse_args([cmd.name] + extra)\n"
                 "    try:\n"
                 "        cmd.validate and cmd.validate(args)\n"
                 "    except ValueError:\n"
                 "        pass   # e.g. no default text beside the repo: checked all the same\n"
                 "print('torch' in sys.modules, 'cutlass' in sys.modules)")
    assert out.split() == ["False", "False"]


def test_entry_points():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"futx": "futx.cli:main"}
    from futx import cli

    assert callable(cli.main)
    for module in ("futx", "futx.cli"):
        r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert r.returncode == 0 and "generate" in r.stdout and "bench" in r.stdout


def test_version_names_futx_torch_the_dsl_and_the_gpu():
    from importlib import metadata

    r = subprocess.run([sys.executable, "-m", "futx", "--version"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 4, r.stdout + r.stderr
    assert lines[0] == f"futx {metadata.version('futx')}" and lines[1] == f"torch {metadata.version('torch')}"
    assert lines[2].startswith("CUTLASS DSL ") and "Hopper GPU" in lines[3]


def test_version_of_a_missing_package():
    from futx.cli.version import package_version

    assert package_version("surely-not-a-futx-dependency") == "not installed"


@pytest.mark.parametrize("command", sorted(COMMAND_MODULES))
def test_help_shows_defaults(command, capsys):
    """Every option with a default names it (argparse's "(default: X)" or the help's own words)."""
    from futx.cli import app

    command = command.replace("_", "-")   # the module train_draft is the command train-draft
    parser = app.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.option_strings and action.default not in (None, False, "", [], "==SUPPRESS=="):
            assert "default" in sub.formatter_class(command)._get_help_string(action), action.option_strings
    with pytest.raises(SystemExit) as e:
        app.main([command, "--help"] if command != "bench" else ["bench", "decode", "--help"])
    assert e.value.code == 0 and "(default: " in capsys.readouterr().out


@pytest.mark.gpu
def test_version_sees_the_hopper_gpu():
    r = subprocess.run([sys.executable, "-m", "futx", "--version"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("Hopper GPU present: ")
