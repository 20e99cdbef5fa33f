"""With the core installed alone (pyproject's ``dependencies``, none of the extras), every command
and import path that needs an extra says which in one line — ``pip install 'crossfeed[beam]'`` —
with no traceback (`crossfeed.errors.MissingExtraError`, the CLI's boundary).

The environment is a fresh venv in a temporary folder with crossfeed (editable, ``--no-deps``)
and the core dependencies only; where pip cannot install them (no package index), the dev
environment's Python runs with a `sys.meta_path` finder that makes every extra's modules
unimportable instead (`_BLOCKER`)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import crossfeed
from crossfeed.errors import EXTRAS, MissingExtraError, missing_extra, require

ROOT = Path(__file__).resolve().parents[1]

_BLOCKER = """
import sys
BLOCKED = {blocked!r}
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Blocker())
"""


def _core_env(tmp: Path) -> list[str]:
    """The command prefix of a Python with the core alone: a fresh venv, else the blocker."""
    venv = tmp / "core"
    deps = [r.split(";")[0] for r in importlib.metadata.requires("crossfeed") if "extra ==" not in r]
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
        py = str(venv / "bin" / "python")
        pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, *deps], check=True, capture_output=True, timeout=400)
        subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True, capture_output=True, timeout=300)
        return [py]
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        site = tmp / "blocker"
        site.mkdir(exist_ok=True)
        blocked = sorted(m for m in EXTRAS if m != "rich")  # rich comes with typer, a core dependency
        (site / "sitecustomize.py").write_text(_BLOCKER.format(blocked=blocked))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
        return [sys.executable]


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("extras")
    saved = os.environ.get("PYTHONPATH")
    py = _core_env(tmp)
    ok = subprocess.run([*py, "-c", "import apache_beam"], capture_output=True)
    assert ok.returncode != 0, "the core environment must not have the extras"
    yield py, tmp
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved


def _cli(core, *args, cwd):
    py, _ = core
    return subprocess.run(
        [*py, "-c", "from crossfeed.cli.main import main; main()", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def _one_line(r, extra: str) -> str:
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"pip install 'crossfeed[{extra}]'" in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def inputs(core):
    _, tmp = core
    (tmp / "photos" / "cat").mkdir(parents=True, exist_ok=True)
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp / "photos" / "cat" / "0.png")
    (tmp / "docs.txt").write_text("one document\nanother\n")
    (tmp / "rows.csv").write_text("a,b\n1,2\n")
    pq = tmp / "pq"
    pq.mkdir(exist_ok=True)
    import pyarrow as pa
    import pyarrow.parquet as papq

    papq.write_table(pa.table({"a": [1, 2]}), pq / "part.parquet")
    crossfeed.write_dataset(tmp / "ds", [{"x": np.float32(i)} for i in range(4)]).close()
    return tmp


@pytest.mark.slow  # a fresh core-only environment
@pytest.mark.parametrize(
    ("args", "extra", "named"),
    [
        (["convert", "images", "photos", "out_images"], "beam", "crossfeed convert images needs apache_beam"),
        (["convert", "parquet", "pq", "out_pq"], "beam", "crossfeed convert parquet needs apache_beam"),
        (["convert", "csv", "rows.csv", "out_csv"], "beam", "crossfeed convert csv needs apache_beam"),
        (["convert", "text", "docs.txt", "out_text", "--tokenizer", "t.json"], "beam", "convert text needs"),
        (["index", "pq"], "beam", "reading Parquet needs pyarrow"),
        (["info", "http://127.0.0.1:9/ds"], "http", "reading over HTTP needs aiohttp"),
        (["serve", "ds", "tcp://127.0.0.1:0", "--batch-size", "2", "--metrics", "127.0.0.1:0"], "metrics", "Prom"),
    ],
)
def test_every_command_that_needs_an_extra_names_it_in_one_line(core, inputs, args, extra, named):
    r = _cli(core, *args, cwd=inputs)
    assert named in _one_line(r, extra)
    assert not (inputs / args[-1]).exists() or args[0] != "convert"  # nothing written


@pytest.mark.parametrize(
    ("module", "extra"),
    [
        ("crossfeed.adapters.torch", "torch"),
        ("crossfeed.adapters.tf", "tf"),
        ("crossfeed.adapters.jax", "jax"),
        ("crossfeed.adapters.grain", "grain"),
        ("crossfeed.beam_jobs.job", "beam"),
    ],
)
@pytest.mark.slow  # a fresh core-only environment
def test_importing_an_adapter_names_its_extra_and_is_an_import_error(core, module, extra):
    py, _ = core
    code = f"try:\n    import {module}\nexcept ImportError as e:\n    print(type(e).__name__ + ': ' + str(e))"
    r = subprocess.run([*py, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    if module.endswith(".job"):  # Beam's own modules: an ImportError naming the module, no extra (the CLI names it)
        assert "apache_beam" in r.stdout
        return
    assert r.stdout.strip().startswith(f"MissingExtraError: {module} needs ")
    assert r.stdout.strip().endswith(f"pip install 'crossfeed[{extra}]'")


@pytest.mark.slow  # a fresh core-only environment
def test_the_core_alone_still_reads_and_writes(core, inputs):
    py, _ = core
    r = _cli(core, "head", "ds", "-n", "2", cwd=inputs)
    assert r.returncode == 0 and "x: float32" in r.stdout, r.stderr
    code = "import crossfeed\nwith crossfeed.Loader('ds', batch_size=2) as ld:\n    print(sum(len(b['x']) for b in ld))"
    r = subprocess.run([*py, "-c", code], capture_output=True, text=True, cwd=inputs, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "4", r.stderr


def test_the_helpers():
    with pytest.raises(MissingExtraError, match=r"^a thing needs no_such_module_x, .*: pip install no_such_module_x$"):
        require("no_such_module_x", "a thing")
    e = MissingExtraError("convert", "apache_beam")
    assert isinstance(e, ImportError) and isinstance(e, crossfeed.CrossfeedError) and e.extra == "beam"
    other = ModuleNotFoundError("No module named 'zzz'", name="zzz")
    assert missing_extra(other, "x") is other  # not an extra's module: its own story
    assert "crossfeed[torch]" in str(missing_extra(ModuleNotFoundError("t", name="torch.utils"), "x"))
