"""`import crossfeed` (and the CLI module) stays framework-neutral: no tensorflow, torch or apache_beam."""

from conftest import run_python


def test_import_crossfeed_pulls_in_no_framework():
    out = run_python("""
        import sys
        import crossfeed, crossfeed.write.adopt.index, crossfeed.read.tools.verify, crossfeed.cli.main
        heavy = sorted(m for m in ("tensorflow", "torch", "apache_beam") if m in sys.modules)
        print(",".join(heavy) or "none")
    """)
    assert out.stdout.strip() == "none"
