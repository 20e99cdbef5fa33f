"""`import crossfeed` (and the CLI module) stays framework-neutral: no tensorflow, torch or apache_beam."""

from pathlib import Path

import pytest
from conftest import run_python


def test_import_crossfeed_pulls_in_no_framework():
    out = run_python("""
        import sys
        import crossfeed, crossfeed.write.adopt.index, crossfeed.read.tools.verify, crossfeed.cli.main
        heavy = sorted(m for m in ("tensorflow", "torch", "apache_beam") if m in sys.modules)
        print(",".join(heavy) or "none")
    """)
    assert out.stdout.strip() == "none"


def test_import_crossfeed_errors_loads_only_the_errors_module():
    """`import crossfeed.errors` (what a worker process, the CLI and every test interpreter pays)
    loads the package and its errors module, not the Loader, writer and network plane behind the
    package's other public names; bare `import crossfeed` loads no framework and no pyzmq."""
    out = run_python("""
        import sys
        import crossfeed.errors
        print(",".join(sorted(m for m in sys.modules if m.split(".")[0] == "crossfeed")))
        heavy = ("tensorflow", "torch", "apache_beam", "jax", "zmq", "numpy")
        print(",".join(sorted(m for m in heavy if m in sys.modules)) or "none")
    """)
    loaded, heavy = out.stdout.split()
    assert loaded.split(",") == ["crossfeed", "crossfeed.errors"]
    assert heavy == "none"


def test_public_names_resolve_on_first_use_and_stay_listed():
    """Every name in `crossfeed.__all__` resolves (lazily) to the object its defining module holds,
    `from crossfeed import *` and `dir()` see them all, and a name used loads only its own side:
    the Loader pulls in no pyzmq, `connect` does."""
    out = run_python("""
        import sys, importlib
        import crossfeed
        assert crossfeed.__all__ == sorted(crossfeed.__all__), "keep __all__ sorted"
        assert set(crossfeed.__all__) <= set(dir(crossfeed))
        from crossfeed import Loader
        print("zmq-after-Loader", "zmq" in sys.modules)
        for name in crossfeed.__all__:
            value = getattr(crossfeed, name)
            home = crossfeed._LAZY.get(name)
            if home is not None:
                assert value is getattr(importlib.import_module(home), name), name
        print("zmq-after-all", "zmq" in sys.modules)
        namespace = {}
        exec("from crossfeed import *", namespace)
        print(sorted(set(crossfeed.__all__) - set(namespace)) or "all")
        try:
            crossfeed.NoSuchName
        except AttributeError as e:
            print("missing:", e)
    """)
    assert out.stdout.splitlines() == [
        "zmq-after-Loader False",
        "zmq-after-all True",
        "all",
        "missing: module 'crossfeed' has no attribute 'NoSuchName'",
    ]


@pytest.mark.slow
def test_collecting_the_suite_imports_no_framework():
    """Collecting every test (what each `pytest` run pays before its first test) imports no
    framework: test modules reach TensorFlow, torch, Beam, JAX and Grain through
    `conftest.lazy_import` and `requires`, in the tests that use them."""
    tests = str(Path(__file__).parent)
    out = run_python(
        """
        import sys, pytest
        code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", sys.argv[1]])
        heavy = ("tensorflow", "torch", "apache_beam", "jax", "grain", "pandas", "distributed")
        print("exit", int(code), ",".join(sorted(m for m in heavy if m in sys.modules)) or "none")
        """,
        tests,
        timeout=600,
    )
    assert out.stdout.splitlines()[-1] == "exit 0 none", out.stdout[-2000:]
