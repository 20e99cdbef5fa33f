"""Do the fast-path tests bite? Break each fast path on purpose and check that a test fails.

Each mutation is one exact text replacement in one source file. For each, the package and the
tests are copied into a temporary directory, the replacement is applied to the copy (the working
tree is never touched), and the mutation's test files are run against the copy (``PYTHONPATH``
puts it first, ahead of the editable install). A mutation is *caught* when pytest reports a
failing test, *missed* when every test passes, *stale* when its old text no longer occurs exactly
once in the source (re-point it after a refactor: the table below is plain data).

    .venv/bin/python benchmarks/mutate_fast_paths.py            # all mutations
    .venv/bin/python benchmarks/mutate_fast_paths.py --no-tf    # skip tests/test_fast_paths_tf.py
    .venv/bin/python benchmarks/mutate_fast_paths.py --only copy_big,recycler
    .venv/bin/python benchmarks/mutate_fast_paths.py --no-tf --only "cached remote"

Exit status 1 if any mutation is missed or stale (or the unmutated copy fails its tests).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = "tests/test_fast_paths.py"
FAST_TF = "tests/test_fast_paths_tf.py"
CACHED = "tests/test_cached_epochs.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...] = (FAST, FAST_TF)


MUTATIONS = [
    Mutation(
        "copy_big: zero big values",
        "crossfeed/read/stages/layout.py",
        "rows[i] = np.frombuffer(p, np.uint8, width, sl.start)",
        "rows[i] = 0",
    ),
    Mutation(
        "copy_big_rows: zero big values",
        "crossfeed/read/stages/layout.py",
        "dst.reshape(len(dst), -1).view(np.uint8)[pos] = rows[:, sl.start : sl.stop]",
        "dst.reshape(len(dst), -1).view(np.uint8)[pos] = 0",
    ),
    Mutation("recycler: ignore refcount", "crossfeed/read/stages/decode.py", "sys.getrefcount(a) == 3", "True"),
    Mutation(
        "_varints: no continuation check",
        "crossfeed/read/stages/layout.py",
        "if not np.array_equal(cont, np.broadcast_to(expect, cont.shape)):\n            return None",
        "if False:\n            return None",
    ),
    Mutation(
        "payload CRC check: always passes",
        "crossfeed/format/frames.py",
        "return mask(crcs) != stored",
        "return np.zeros(len(stored), dtype=bool)",
    ),
    Mutation(
        "header check: length field ignored",
        "crossfeed/format/frames.py",
        "bad = stored_len != (lengths - FRAMING).astype(np.uint64)",
        "bad = np.zeros(len(lengths), dtype=bool)",
    ),
    # beyond the list
    Mutation(
        "rows form: no payload CRC check",
        "crossfeed/read/stages/frames.py",
        'if bad_payload_rows(payload, framed[:, k - FOOTER : k].copy().view("<u4").ravel()).any():',
        "if False:",
    ),
    Mutation(
        "views form: no payload CRC check",
        "crossfeed/read/stages/frames.py",
        "if bad_payloads(payloads, foot).any():",
        "if False:",
    ),
    Mutation(
        "deferred CRC (big records, checked at the copy): always passes",
        "crossfeed/read/stages/frames.py",
        "bad = mask(crcs) != stored",
        "bad = np.zeros(len(stored), dtype=bool)",
        (FAST,),
    ),
    Mutation(
        "span: every row from the first shard's bytes",
        "crossfeed/read/stages/frames.py",
        "return self.at(self.base[shard] + offsets, width)",
        "return self.at(self.base[shard[:1]] + offsets, width)",
        (FAST,),
    ),
    Mutation(
        "whole split: span offsets without their shard's base",
        "crossfeed/read/stages/frames.py",
        'table["at"] = span.base[shard] + offs',
        'table["at"] = offs',
        (FAST,),
    ),
    Mutation(
        "whole split: a record near its shard's end read unclamped",
        "crossfeed/read/stages/frames.py",
        "if lo > FRAMING and int(room.min()) >= hi:",
        "if lo > FRAMING:",
        (FAST,),
    ),
    Mutation("_varints: 6-bit shift", "crossfeed/read/stages/layout.py", "<< np.uint64(7 * j)", "<< np.uint64(6 * j)"),
    Mutation(
        "JPEG into batch: BGR",
        "crossfeed/read/stages/decode.py",
        '_simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=out)',
        '_simplejpeg.decode_jpeg(data, colorspace="BGR", buffer=out)',
        (FAST,),
    ),
    Mutation(
        "cached remote shards: never kept for good (no span, no whole split)",
        "crossfeed/read/stages/frames.py",
        "return self.cache is not None and self.keep_loaded is None and s in self._cached",
        "return False",
        (CACHED,),
    ),
    Mutation(
        "cached remote records: never rows",
        "crossfeed/read/stages/frames.py",
        "(self.split.file(0).storage.remote and self.cache is None)",
        "self.split.file(0).storage.remote",
        (CACHED,),
    ),
]


def _copy(dst: str) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for d in ("crossfeed", "tests"):
        shutil.copytree(os.path.join(REPO, d), os.path.join(dst, d), ignore=ignore)
    shutil.copy(os.path.join(REPO, "pyproject.toml"), dst)


def _pytest(root: str, test: str, timeout: float) -> tuple[str, str]:
    """``(verdict, detail)`` of running one test file against the copy at ``root``."""
    env = {
        **os.environ,
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    where = subprocess.run(
        [sys.executable, "-c", "import crossfeed; print(crossfeed.__file__)"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if not where.stdout.startswith(root):
        return "error", f"the copy is not what imports: {where.stdout.strip() or where.stderr[-300:]}"
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--timeout", str(int(timeout)), test]
    try:
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout + 60, check=False)
    except subprocess.TimeoutExpired:
        return "error", "timed out"
    last = (p.stdout.strip().splitlines() or [""])[-1]
    if p.returncode == 0:
        return "passed", last
    if p.returncode == 1:
        failed = [ln.split(" ", 1)[1].split(" - ")[0] for ln in p.stdout.splitlines() if ln.startswith("FAILED ")]
        return "failed", failed[0] if failed else last
    if p.returncode == 5:
        return "error", "no tests collected"
    return "error", f"pytest exit {p.returncode}: {last or p.stderr[-300:]}"


def run(mutations, tests_wanted, timeout: float) -> list[tuple]:
    rows = []
    for m in [None, *mutations]:
        name = "(none: baseline)" if m is None else m.name
        tests = [t for t in (tests_wanted if m is None else m.tests) if t in tests_wanted]
        with tempfile.TemporaryDirectory(prefix="cf-mutant-") as root:
            _copy(root)
            if m is not None:
                path = os.path.join(root, m.file)
                with open(path) as f:
                    text = f.read()
                if text.count(m.old) != 1:
                    rows.append((name, m.file, "-", "STALE", f"old text occurs {text.count(m.old)} times"))
                    print(f"{name}: stale", flush=True)
                    continue
                with open(path, "w") as f:
                    f.write(text.replace(m.old, m.new))
            for t in tests:
                t0 = time.perf_counter()
                verdict, detail = _pytest(root, t, timeout)
                if m is None:
                    status = "ok" if verdict == "passed" else "BASELINE FAILS"
                else:
                    status = {"failed": "caught", "passed": "MISSED"}.get(verdict, "ERROR")
                rows.append((name, m.file if m else "-", os.path.basename(t), status, detail))
                print(
                    f"{name} / {os.path.basename(t)}: {status} ({time.perf_counter() - t0:.0f}s) {detail}", flush=True
                )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-tf", action="store_true", help=f"do not run {FAST_TF}")
    ap.add_argument("--only", default="", help="comma-separated substrings of mutation names")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    a = ap.parse_args(argv)
    muts = [m for m in MUTATIONS if not a.only or any(s in m.name for s in a.only.split(","))]
    tests = [FAST] if a.no_tf else [FAST, FAST_TF]
    tests += sorted({t for m in muts for t in m.tests} - {FAST, FAST_TF})  # (the baseline runs them too)
    rows = run(muts, tests, a.timeout)
    w = max(len(r[0]) for r in rows)
    print(f"\n{'mutation':{w}s}  {'file':28s} {'test file':24s} result   first failing test / note")
    for name, file, test, status, detail in rows:
        print(f"{name:{w}s}  {file:28s} {test:24s} {status:8s} {detail}")
    bad = [r for r in rows if r[3] not in ("ok", "caught")]
    # a mutation is caught if any of its test files catches it
    by_mut: dict[str, bool] = {}
    for name, _, _, status, _ in rows:
        by_mut[name] = by_mut.get(name, False) or status in ("caught", "ok")
    missed = [n for n, ok in by_mut.items() if not ok]
    print(
        f"\n{len(by_mut) - 1 - len([n for n in missed if n != '(none: baseline)'])}/{len(by_mut) - 1} mutations caught"
        + (f"; not caught: {', '.join(missed)}" if missed else "")
    )
    return 1 if missed or any(r[3] in ("BASELINE FAILS", "STALE") for r in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
