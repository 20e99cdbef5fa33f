"""Every fenced block of the README and docs/ either runs here or says why not.

A block is labelled by its fence:

* ```` ```python ````: executed, the blocks of one page in order in one namespace (as a reader
  pastes them into one session), in a fresh copy of a small workspace (`WORKSPACE`) that holds the
  paths the docs use (``data/``, ``web/``, ``books/``, ``photos/``, ``tokens/`` …), with the names
  the docs leave to the reader (`GIVEN`: ``step``, ``epochs`` …) defined;
* ```` ```sh ````: every ``crossfeed …`` command in it (``\\`` continuations joined, ``&&`` split,
  ``#`` comments dropped, unquoted globs expanded) run through the real CLI, in a fresh copy of the
  workspace, and must exit 0 (a ``convert`` writes a new output directory, as on a first run);
* ```` ```text ````: output, a file tree or a diagram — not code, counted and not run;
* any block right after ``<!-- not run: REASON -->`` is skipped, and the reason is listed;
  a block with no label, or a skip with no reason, fails `test_every_block_is_labelled`.

Of the blocks not run, every Python block must still compile, and every ``crossfeed`` command
in any ``sh`` block must name a command and options the CLI has. The labelling test prints the
counts and every skipped block with its reason (``pytest -s -k labelled``).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "recipes").glob("*.md"))]
RUN, TEXT = {"python", "sh"}, {"text"}
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")
_SKIP = re.compile(r"^\s*<!--\s*not run:(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    skip: str | None  # the reason given in <!-- not run: … -->, "" when it is empty

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        body, j = [], i + 1
        while j < len(lines) and lines[j].strip() != fence:
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        skip = _SKIP.match(lines[k]) if k >= 0 else None
        out.append(
            Block(
                path.relative_to(ROOT).as_posix(),
                i + 1,
                lang,
                "\n".join(body) + "\n",
                skip.group(1).strip() if skip else None,
            )
        )
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def _runs(lang: str) -> list[Block]:
    return [b for b in ALL if b.lang == lang and b.skip is None]


# ---------------------------------------------------------------- the workspace the docs assume


def _write_workspace(ws: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds
    from PIL import Image

    import crossfeed
    from crossfeed.format.schema import Encoding, Feature, Schema

    rng = np.random.default_rng(0)
    # photos/: a class folder of JPEGs of different sizes
    for c in ("cat", "dog"):
        (ws / "photos" / c).mkdir(parents=True)
        for i in range(6):
            h, w = (int(v) for v in rng.integers(20, 48, 2))
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(ws / "photos" / c / f"{i}.jpg")
    # wine.csv, Parquet parts (part-*.parquet, raw/part-*.parquet), arrays.npz
    names = ["barolo", "grignolino", "barbera"]
    rows = [f"{rng.uniform(11, 15):.2f},{rng.uniform(0.7, 5):.2f},{names[i % 3]}" for i in range(24)]
    (ws / "wine.csv").write_text("alcohol,malic_acid,cultivar\n" + "\n".join(rows) + "\n")
    (ws / "raw").mkdir()
    for p in range(2):
        t = pa.table({"x": np.arange(p * 8, p * 8 + 8, dtype=np.float64), "y": np.arange(8) % 2})
        pq.write_table(t, ws / f"part-{p}.parquet")
        pq.write_table(t, ws / "raw" / f"part-{p}.parquet")
    np.savez(ws / "arrays.npz", x=rng.normal(size=(16, 3)).astype(np.float32), y=np.arange(16) % 2)
    # data/: a dataset (8×8×3 images as raw uint8 tensors, labels; train + validation)
    schema = _image_schema()
    crossfeed.write_dataset(ws / "data", _samples(96, 1), schema=schema, num_shards=2).close()
    crossfeed.write_dataset(ws / "data", _samples(32, 2), schema=schema, split="validation", add_split=True).close()
    # shards/: bare TFRecords (no manifest) of 224×224×3 raw images and labels
    tmp = ws / ".shards"
    big = Schema(
        [
            Feature("image", "uint8", (224, 224, 3), Encoding.TENSOR),
            Feature("label", "int64", (), "int64"),
            Feature("ids", "int64", (None,), "int64"),  # token ids as an int64 list
        ]
    )
    rows = [
        {
            "image": np.full((224, 224, 3), i, np.uint8),
            "label": i,
            "ids": list(range(i + 2)),
        }
        for i in range(4)
    ]
    crossfeed.write_dataset(tmp, rows, schema=big, num_shards=2).close()
    (ws / "shards").mkdir()
    for f in tmp.glob("*.tfrecord"):
        shutil.copy(f, ws / "shards" / f.name)
    shutil.rmtree(tmp)
    # packed/: bare TFRecords of uint16 token tensors (crossfeed's tensor encoding: bytes + tokens/shape)
    tokens = Schema([Feature("tokens", "uint16", (None,), Encoding.TENSOR)])
    crossfeed.write_dataset(tmp, [{"tokens": np.arange(n, dtype=np.uint16)} for n in (3, 9, 5)], schema=tokens).close()
    (ws / "packed").mkdir()
    for f in tmp.glob("*.tfrecord"):
        shutil.copy(f, ws / "packed" / f.name)
    shutil.rmtree(tmp)
    # tars/: WebDataset shards (not indexed); parquet/: Parquet files (not indexed)
    (ws / "tars").mkdir()
    with wds.TarWriter(str(ws / "tars" / "photos-000000.tar")) as sink:
        for i in range(6):
            sink.write({"__key__": f"p{i:04d}", "cls": i % 2, "txt": f"photo {i}"})
    (ws / "parquet").mkdir()
    pq.write_table(pa.table({"x": np.arange(10.0), "y": np.arange(10) % 2}), ws / "parquet" / "p.parquet")


def _write_python_workspace(ws: Path) -> None:
    """What the Python blocks read: datasets (web/ and books/ to mix; tokens/ and corpus/ with lengths)."""
    from token_data import write_language

    import crossfeed

    # web/ and books/ to mix: texts and labels, the text under another name in books/
    web = [{"text": f"page {i}", "label": i % 4} for i in range(48)]
    crossfeed.write_dataset(ws / "web", web, num_shards=2).close()
    crossfeed.write_dataset(ws / "books", [{"body": f"book {i}", "label": i % 4} for i in range(16)]).close()
    write_language(ws / "tokens", docs=1200)
    write_language(ws / "corpus", docs=1200, seed=1)


def _write_shell_workspace(ws: Path) -> None:
    """What the shell blocks read: text to tokenize and a tokenizer; Parquet token lists in tokens/."""
    import gzip
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the a cat dog sat on mat and ran far".split()
    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ws / "tokenizer.json"))
    tok.save(str(ws / "tok.json"))
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(words, int(rng.integers(3, 12)))) for _ in range(200)]  # 1% is 2
    (ws / "corpus").mkdir()
    for k in range(2):
        (ws / "corpus" / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[k::2]))
    with gzip.open(ws / "dump.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in docs)
    (ws / "books").mkdir()
    for k, d in enumerate(docs[:4]):
        (ws / "books" / f"{k}.txt").write_text(d + "\n")
    (ws / "lines.txt").write_text("\n".join(docs) + "\n")
    (ws / "wiki").mkdir()
    pq.write_table(pa.table({"content": docs}), ws / "wiki" / "0.parquet")
    (ws / "tokens").mkdir()
    ids = [rng.integers(0, 100, int(rng.integers(2, 20))).tolist() for _ in range(20)]
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))}), ws / "tokens" / "t.parquet")
    _write_lm_mix(ws)


def _write_lm_mix(ws: Path) -> None:
    """docs/recipes/lm-run.md's two token sources (lm/web, lm/books, with lengths files) and its
    scheduled mixture's spec file (lm-mix.json), as its Python blocks write them."""
    import json

    import crossfeed

    rng = np.random.default_rng(0)
    for path, n, first in (("lm/web", 400, 1), ("lm/books", 100, 1000)):
        docs = [{"tokens": (first + rng.integers(0, 999, int(rng.integers(8, 120)))).tolist()} for _ in range(n)]
        crossfeed.write_dataset(ws / path, docs, num_shards=2, lengths=("tokens",)).close()
    weights = [[[0, 3], [300, 1]], [[0, 1], [300, 4]]]
    spec = {"sources": [{"path": p, "weight": {"constant": w}} for p, w in zip(("lm/web", "lm/books"), weights)]}
    (ws / "lm-mix.json").write_text(json.dumps(spec))


def _image_schema():
    from crossfeed.format.schema import Encoding, Feature, Schema

    return Schema([Feature("image", "uint8", (8, 8, 3), Encoding.TENSOR), Feature("label", "int64", (), "int64")])


def _samples(n, seed):
    r = np.random.default_rng(seed)
    return [{"image": r.integers(0, 255, (8, 8, 3), dtype=np.uint8), "label": i % 4} for i in range(n)]


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    """``{"python": DIR, "sh": DIR}``: the common files, and what each kind of block reads."""
    sys.path.insert(0, str(ROOT / "tests"))
    common = tmp_path_factory.mktemp("docs-common")
    _write_workspace(common)
    out = {}
    for kind, extra in (("python", _write_python_workspace), ("sh", _write_shell_workspace)):
        out[kind] = tmp_path_factory.mktemp(f"docs-{kind}")
        shutil.copytree(common, out[kind], dirs_exist_ok=True)
        extra(out[kind])
    return out


@pytest.fixture
def fresh(workspaces, tmp_path, monkeypatch):
    """``fresh(kind)``: a new copy of that workspace, made the working directory."""
    (tmp_path / "cache").mkdir()  # the shard cache, as reading remote data leaves it
    monkeypatch.setenv("CROSSFEED_CACHE_DIR", str(tmp_path / "cache"))
    made = []

    def make(kind: str) -> Path:
        box = tmp_path / f"ws{len(made)}"
        shutil.copytree(workspaces[kind], box, symlinks=True)
        monkeypatch.chdir(box)
        made.append(box)
        return box

    return make


# ---------------------------------------------------------------- python blocks


def _given() -> dict:
    """Names the docs leave to the reader (no-ops): a training step, a transform, epochs, a checkpoint."""
    return {
        "step": lambda batch: None,  # a training step
        "train_step": lambda *a: (a[0] if a else None, 0.0),
        "augment": lambda sample: sample,  # a per-sample transform
        "epochs": 1,
        "ckpt": {},
    }


PY_PAGES = sorted({b.page for b in _runs("python")})


@pytest.mark.parametrize("page", PY_PAGES)
def test_python_blocks_run(page, fresh):
    fresh("python")
    namespace = {"__name__": "__docs__", **_given()}
    for b in (b for b in _runs("python") if b.page == page):
        try:
            exec(compile(textwrap.dedent(b.code), b.where, "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{b.where}: the block fails: {type(e).__name__}: {e}\n{b.code}") from e


# ---------------------------------------------------------------- shell blocks


def commands(code: str) -> list[list[list[str]]]:
    """The ``crossfeed`` commands of a shell block, a list per line (``&&`` chains them), each
    as its argument list; ``[…]`` (what a synopsis marks optional) is left out."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        chain = []
        line = re.sub(r"\s\[[^\]]*\]", "", line)
        for part in line.split("&&"):
            part = part.strip()
            if not part or part.startswith("#"):
                continue
            args = []
            for tok in shlex.split(part, comments=True):
                quoted = f"'{tok}'" in part or f'"{tok}"' in part
                matched = sorted(glob.glob(tok)) if re.search(r"[*?]", tok) and not quoted else []
                args.extend(matched or [tok])
            assert args[0] == "crossfeed", f"not a crossfeed command: {part!r} (label the block text, or skip it)"
            chain.append(args[1:])
        if chain:
            out.append(chain)
    return out


def _fresh_output(args: list[str]) -> None:
    """A ``convert`` writes a new directory (a first run): one the workspace holds is removed
    (not for ``--append``, which adds to the one there).
    The docs write ``convert KIND INPUT... OUT`` before any option, so OUT is the last of those."""
    if args[:1] == ["convert"] and "--overwrite" not in args and "--append" not in args:
        positional = []
        for a in args[2:]:
            if a.startswith("-"):
                break
            positional.append(a)
        if positional and os.path.isdir(positional[-1]):
            shutil.rmtree(positional[-1])


SH = _runs("sh")


@pytest.mark.parametrize("block", SH, ids=[b.where for b in SH])
def test_shell_blocks_run(block, fresh):
    """Each line in a fresh workspace (a block lists alternatives); a line's ``&&`` chain in order."""
    from typer.testing import CliRunner

    from crossfeed.cli.main import app

    for chain in commands(block.code):
        fresh("sh")
        for args in chain:
            _fresh_output(args)
            r = CliRunner().invoke(app, args)
            assert r.exit_code == 0, f"{block.where}: crossfeed {shlex.join(args)} exited {r.exit_code}:\n{r.output}"
            assert "Traceback" not in r.output


# ---------------------------------------------------------------- labels, skips, the report


def test_every_block_is_labelled_and_every_skip_says_why(capsys):
    skipped = [b for b in ALL if b.skip is not None]
    run = [b for b in ALL if b.skip is None and b.lang in RUN]
    text = [b for b in ALL if b.skip is None and b.lang in TEXT]
    with capsys.disabled():  # the report: pytest -s tests/test_docs_blocks.py -k labelled
        print(
            f"\ndocs blocks: {len(ALL)} in {len(PAGES)} pages: {len(run)} run "
            f"({sum(b.lang == 'python' for b in run)} python, {sum(b.lang == 'sh' for b in run)} sh), "
            f"{len(text)} text (output, trees, diagrams), {len(skipped)} not run:"
        )
        for b in skipped:
            print(f"  {b.where} [{b.lang or 'no label'}] {b.skip}")
    bad = [
        f"{b.where}: fence labelled {b.lang!r}: use python, sh or text, or put <!-- not run: REASON --> before it"
        for b in ALL
        if b.skip is None and b.lang not in RUN | TEXT
    ]
    bad += [f"{b.where}: <!-- not run: --> with no reason" for b in ALL if b.skip == ""]
    assert bad == []


def test_the_parser_sees_labels_skips_and_indented_fences(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "# t\n\n```python\nx = 1\n```\n\n<!-- not run: needs a GPU -->\n\n```sh\ncrossfeed info d/\n```\n"
        "* item\n\n  ```text\n  out\n  ```\n"
    )
    old = ROOT
    try:
        globals()["ROOT"] = tmp_path
        got = [(b.line, b.lang, b.code, b.skip) for b in blocks(page)]
    finally:
        globals()["ROOT"] = old
    assert got == [
        (3, "python", "x = 1\n", None),
        (9, "sh", "crossfeed info d/\n", "needs a GPU"),
        (14, "text", "out\n", None),
    ]
    assert commands("crossfeed info d/ && crossfeed verify d/  # both\ncrossfeed x [--z Z] \\\n  --y 1\n") == [
        [["info", "d/"], ["verify", "d/"]],
        [["x", "--y", "1"]],
    ]


# ---------------------------------------------------------------- what is checked of the blocks not run


def test_every_python_block_compiles_run_or_not():
    bad = []
    for b in ALL:
        if b.lang == "python":
            try:
                compile(textwrap.dedent(b.code), b.where, "exec")
            except SyntaxError as e:
                bad.append(f"{b.where}: {e}")
    assert bad == []


def _unknown_options(argv: list[str]) -> list[str]:
    """The ``--options`` of ``crossfeed ARGV`` that its command does not take ([] if all known)."""
    import typer.main

    from crossfeed.cli.main import app

    cmd, rest = typer.main.get_command(app), list(argv)
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    while rest and hasattr(cmd, "commands"):
        while rest and rest[0].startswith("-"):  # the group's own options (--verbose)
            rest.pop(0)
        if not rest or rest[0] not in cmd.commands:
            return [f"no command {rest[0]!r}"] if rest else []
        cmd = cmd.commands[rest.pop(0)]
        known |= {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    if "--" in rest:
        rest = rest[: rest.index("--")]  # Beam's options after --
    return [a.split("=")[0] for a in rest if a.startswith("-") and a.split("=")[0] not in known]


def test_every_crossfeed_command_in_the_docs_names_options_it_takes_run_or_not():
    bad, checked = [], 0
    for b in ALL:
        if b.lang != "sh":
            continue
        for line in b.code.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                part = re.sub(r"^\s*(\w+=\S+\s+)*", "", part)  # ENV=value before the command
                if not part.startswith("crossfeed "):
                    continue
                argv = shlex.split(re.sub(r"[\[\]]", " ", part.replace("...", " ")), comments=True)[1:]
                unknown, checked = _unknown_options(argv), checked + 1
                if unknown:
                    bad.append(f"{b.where}: crossfeed {' '.join(argv[:2])}: {unknown}")
    assert bad == [] and checked >= 40, checked
    assert _unknown_options(["info", "--jsn", "d/"]) == ["--jsn"]  # the check sees a wrong one
    assert _unknown_options(["cache", "lss"]) == ["no command 'lss'"]
