"""WebDataset tar shards read in place: tars written by the ``webdataset`` package (from real
photos of scikit-image's data), by Python's ``tarfile`` and by GNU tar are adopted with
``crossfeed index`` and read back by the Loader — compared sample for sample, byte for byte and
pixel for pixel, with webdataset's own reader."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from conftest import lazy_import
from loader_helpers import assert_resumes_identically, epoch_batches
from net_helpers import FAST_HB, child, read_endpoint, stop
from PIL import Image

import crossfeed
from crossfeed.errors import CorruptRecordError, ManifestError, SchemaError
from crossfeed.format.manifest import MANIFEST
from crossfeed.net import connect
from crossfeed.read.loader import INDEX_KEY, Loader
from crossfeed.write.adopt.index import index_dataset

wds = lazy_import("webdataset")
skdata = lazy_import("skimage.data")

N = 23  # samples; 4 per shard → 6 shards, the last one short


def _photos() -> list[np.ndarray]:
    """Real photos, shrunk (every other pixel) so the test stays fast; two are grayscale."""
    rgb = [skdata.astronaut(), skdata.coffee(), skdata.chelsea(), skdata.rocket()]
    gray = [skdata.camera(), skdata.coins()]
    return [im[::4, ::4] for im in rgb] + [im[::3, ::3] for im in gray]


def _encode(im: np.ndarray, fmt: str) -> bytes:
    b = io.BytesIO()
    Image.fromarray(im).save(b, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return b.getvalue()


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crossfeed.cli.main", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def wds_dir(tmp_path_factory):
    """Tars written by ``webdataset.ShardWriter``: jpg (RGB photos), png (RGB and gray), cls,
    txt, npy (shapes vary in one dimension) and json members; then ``crossfeed index`` (CLI)."""
    root = tmp_path_factory.mktemp("wds")
    photos = _photos()
    with wds.ShardWriter(str(root / "shard-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(N):
            im = photos[i % len(photos)]
            rgb = im if im.ndim == 3 else np.repeat(im[:, :, None], 3, axis=2)
            sink.write(
                {
                    "__key__": f"sample{i:05d}",
                    "jpg": _encode(rgb, "JPEG"),
                    "png": _encode(im, "PNG"),
                    "cls": i % 7,
                    "txt": f"photo {i} ünïcode",
                    "npy": np.arange(i, i + 4 * (1 + i % 3), dtype=np.float32).reshape(-1, 4),
                    "json": json.dumps({"i": i}).encode(),
                }
            )
    before = {n: _sha(root / n) for n in os.listdir(root)}
    out = _cli("index", root)
    assert out.returncode == 0, out.stderr
    assert {n: _sha(root / n) for n in before} == before  # adoption never modifies the tars
    return root


def _urls(root) -> list[str]:
    return sorted(str(root / n) for n in os.listdir(root) if n.endswith(".tar"))


def test_schema_from_extensions(wds_dir):
    ds = crossfeed.open_dataset(wds_dir)
    assert ds.splits["train"].format == "tar" and len(ds["train"]) == N
    s = {f.name: (f.encoding.value, f.dtype, f.shape) for f in ds.schema}
    assert s == {
        "cls": ("int64", "int64", ()),
        "jpg": ("image", "uint8", (None, None, 3)),
        "png": ("image", "uint8", (None, None, None)),  # RGB and gray photos
        "txt": ("bytes", "string", ()),
        "npy": ("tensor", "float32", (None, 4)),
        "json": ("bytes", "bytes", ()),
    }


def test_every_sample_matches_webdatasets_reader_byte_for_byte(wds_dir):
    """Undecoded: image bytes, labels, text, arrays and json equal webdataset's raw samples, in order."""
    theirs = list(wds.WebDataset(_urls(wds_dir), shardshuffle=False))
    ours = []
    with Loader(wds_dir, batch_size=5, shuffle="none", decode_images=False, return_index=True) as loader:
        for b in loader:
            for j in range(len(b[INDEX_KEY])):
                ours.append({k: b[k][j] for k in b if k != INDEX_KEY})
    assert len(ours) == len(theirs) == N
    for i, (a, t) in enumerate(zip(ours, theirs)):
        assert t["__key__"] == f"sample{i:05d}"
        assert a["jpg"] == t["jpg"] and a["png"] == t["png"] and a["json"] == t["json"]
        assert int(a["cls"]) == int(t["cls"]) == i % 7
        assert a["txt"] == t["txt"].decode("utf-8")
        np.testing.assert_array_equal(a["npy"], np.load(io.BytesIO(t["npy"])))


def test_decoded_pixels_match_webdatasets_decoder(wds_dir):
    theirs = list(wds.WebDataset(_urls(wds_dir), shardshuffle=False).decode("rgb8"))
    with Loader(wds_dir, batch_size=4, shuffle="none", features=["jpg", "png"]) as loader:
        batches = list(loader)
    jpgs = [im for b in batches for im in b["jpg"]]
    pngs = [im for b in batches for im in b["png"]]
    for i, t in enumerate(theirs):
        np.testing.assert_array_equal(jpgs[i], t["jpg"], err_msg=f"sample {i} jpg")
        png = pngs[i] if pngs[i].shape[2] == 3 else np.repeat(pngs[i], 3, axis=2)  # rgb8 makes gray RGB
        np.testing.assert_array_equal(png, t["png"], err_msg=f"sample {i} png")


def test_same_size_jpegs_batch_into_one_array(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    im = skdata.astronaut()[::4, ::4]
    with wds.TarWriter(str(root / "a.tar")) as sink:
        for i in range(6):
            sink.write({"__key__": f"k{i}", "jpg": _encode(np.roll(im, i, axis=0), "JPEG"), "cls": i})
    index_dataset(root)
    with Loader(root, batch_size=3, shuffle="none") as loader:
        b = next(iter(loader))
    assert b["jpg"].shape == (3, 128, 128, 3) and b["jpg"].dtype == np.uint8
    assert b["cls"].tolist() == [0, 1, 2]


def test_global_shuffle_is_a_permutation_and_ranks_split_it(wds_dir):
    ids = np.concatenate(epoch_batches(wds_dir, batch_size=4, shuffle="global", seed=3))
    assert sorted(ids.tolist()) == list(range(N)) and ids.tolist() != list(range(N))
    per_rank = [
        np.concatenate(epoch_batches(wds_dir, batch_size=4, shuffle="global", seed=3, rank=r, world_size=2))
        for r in range(2)
    ]
    assert len(per_rank[0]) == len(per_rank[1])
    assert set(per_rank[0].tolist()) | set(per_rank[1].tolist()) == set(range(N))


@pytest.mark.parametrize("shuffle", ["global", "block"])
def test_exact_resume(wds_dir, shuffle):
    assert_resumes_identically(wds_dir, batch_size=3, shuffle=shuffle, seed=5, features=["cls", "npy"])


def test_loader_samples_are_the_samples_at_their_indices(wds_dir):
    split = crossfeed.open_dataset(wds_dir)["train"]
    with Loader(wds_dir, batch_size=6, shuffle="global", seed=1, return_index=True, features=["cls", "txt"]) as ld:
        for b in ld:
            for i, c, t in zip(b[INDEX_KEY].tolist(), b["cls"].tolist(), b["txt"]):
                assert (c, t) == (i % 7, f"photo {i} ünïcode") == (int(split[i]["cls"]), split[i]["txt"])


def test_torch_dataset_with_two_workers(wds_dir):
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from crossfeed.adapters.torch import TorchDataset

    kw = dict(batch_size=4, seed=2, shuffle="global", features=["cls", "npy", "txt"], return_index=True)
    expected = [b[INDEX_KEY].tolist() for b in Loader(wds_dir, **kw)]
    ds = TorchDataset(wds_dir, rank=0, world_size=1, **kw)
    got = []
    for b in DataLoader(ds, batch_size=None, num_workers=2):
        got.append(b[INDEX_KEY].tolist())
        assert [int(c) for c in b["cls"]] == [i % 7 for i in got[-1]]
    ds.close()
    assert got == expected


@pytest.mark.slow
def test_cli_info_verify_head(wds_dir):
    info = _cli("info", wds_dir)
    assert info.returncode == 0, info.stderr
    assert "npy" in info.stdout and "(?, 4)" in info.stdout and f"{N:>12,} records" in info.stdout
    ver = _cli("verify", wds_dir)
    assert ver.returncode == 0, ver.stderr
    assert f"ok: {N} records in 6 shards" in ver.stdout and "no payload checksums" in ver.stderr
    head = _cli("head", wds_dir, "-n", "2")
    assert head.returncode == 0, head.stderr
    assert "[train 1]" in head.stdout and "'photo 1 ünïcode'" in head.stdout and "cls: int64[] 1" in head.stdout


def _write_plain_tar(root, members: list[tuple[str, bytes]], *, fmt=tarfile.PAX_FORMAT) -> None:
    with tarfile.open(root / "data.tar", "w", format=fmt) as t:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            t.addfile(info, io.BytesIO(payload))


def _tree_members() -> list[tuple[str, bytes]]:
    """Keys with directories, one longer than a ustar name field (100 bytes), an ``__info__`` file."""
    im = skdata.chelsea()[::8, ::8]
    out = [("__info__", b"{}")]  # webdataset skips __…__ names
    for i in range(5):
        d = "a/" + ("deep" * 30 if i == 3 else "b") + "/"
        out += [(f"{d}{i:03d}.input.png", _encode(im[:, i:], "PNG")), (f"{d}{i:03d}.cls", str(i).encode())]
    return out


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_python_tarfile_tars_match_webdataset(tmp_path, fmt):
    root = tmp_path / "d"
    root.mkdir()
    _write_plain_tar(root, _tree_members(), fmt=fmt)
    index_dataset(root)
    ds = crossfeed.open_dataset(root)
    assert ds.schema.names == ["cls", "input.png"]  # webdataset's key rule: key up to the first dot
    theirs = list(wds.WebDataset([str(root / "data.tar")], shardshuffle=False))
    split = ds["train"]
    assert len(split) == len(theirs) == 5
    for i, t in enumerate(theirs):
        ours = split.decode(*split.locate(i), decode_images=False)
        assert ours["input.png"] == t["input.png"] and int(ours["cls"]) == int(t["cls"]) == i


def test_gnu_tar_with_directory_entries(tmp_path):
    if shutil.which("tar") is None:
        pytest.skip("no tar program")
    src, root = tmp_path / "src", tmp_path / "d"
    for name, payload in _tree_members():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(payload)
    root.mkdir()
    files = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    subprocess.run(
        ["tar", "--sort=name", "-cf", str(root / "train-00000-of-00001.tar"), "-C", str(src), "a", *files[:1]],
        check=True,
    )
    index_dataset(root)
    theirs = list(wds.WebDataset([str(root / "train-00000-of-00001.tar")], shardshuffle=False))
    with Loader(root, batch_size=2, shuffle="none", decode_images=False) as loader:
        ours = [(bytes(p), int(c)) for b in loader for p, c in zip(b["input.png"], b["cls"])]
    assert ours == [(t["input.png"], int(t["cls"])) for t in theirs] and len(ours) == 5


def _corrupt_copy(wds_dir, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(wds_dir, root)
    shard = sorted(n for n in os.listdir(root) if n.endswith(".tar"))[1]
    offset = int(open(root / (shard + ".idx")).read().split("\n")[2].split()[0])  # the shard's third sample
    return root, root / shard, offset


def test_a_damaged_header_names_tar_and_offset(wds_dir, tmp_path):
    root, shard, offset = _corrupt_copy(wds_dir, tmp_path)
    with open(shard, "r+b") as f:
        f.seek(offset + 3)
        f.write(b"X")  # inside the member name: only the header checksum can tell
    with Loader(root, batch_size=N, shuffle="none", features=["cls"]) as loader, pytest.raises(CorruptRecordError) as e:
        next(iter(loader))
    assert e.value.path == str(shard) and e.value.offset == offset and "checksum" in e.value.reason
    ver = _cli("verify", root)
    assert ver.returncode == 1
    assert f"BAD {shard}: byte offset {offset}: tar header checksum mismatch" in ver.stderr
    assert "sha256 differs" in ver.stderr
    # under on_error="skip", the one bad sample is dropped and counted; the rest are read
    with Loader(root, batch_size=N, shuffle="none", features=["cls"], on_error="skip", return_index=True) as loader:
        ids = [i for b in loader for i in b[INDEX_KEY].tolist()]
    assert len(ids) == N - 1 and 6 not in ids


def test_a_truncated_tar_is_detected(wds_dir, tmp_path):
    root, shard, offset = _corrupt_copy(wds_dir, tmp_path)
    with open(shard, "r+b") as f:
        f.truncate(offset + 700)
    with pytest.raises(crossfeed.CrossfeedError, match="truncated|ends at byte"):
        with Loader(root, batch_size=N, shuffle="none", features=["cls"]) as loader:
            list(loader)
    ver = _cli("verify", root)
    assert ver.returncode == 1 and f"BAD {shard}: file is {offset + 700} bytes" in ver.stderr


def test_samples_with_different_members_are_refused_naming_tar_and_member(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    _write_plain_tar(root, [("k0.cls", b"0"), ("k0.txt", b"a"), ("k1.cls", b"1"), ("k2.cls", b"2"), ("k2.txt", b"c")])
    with pytest.raises(
        SchemaError, match=r"data\.tar: member 'k1\.cls' at byte offset 2048 .*\['cls'\].*\['cls', 'txt'\]"
    ):
        index_dataset(root)
    assert not (root / MANIFEST).exists()
    _write_plain_tar(root, [("k0.cls", b"0"), ("k1.cls", b"one")])
    with pytest.raises(SchemaError, match=r"data\.tar: member 'k1\.cls' at byte offset 1024: .*not an integer"):
        index_dataset(root)


def test_declared_features_override_inference(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    im = _encode(skdata.coffee()[::8, ::8], "JPEG")
    _write_plain_tar(root, [(f"k{i}.{ext}", im if ext == "jpg" else b"7") for i in range(3) for ext in ("jpg", "cls")])
    index_dataset(root, features=["jpg=bytes"])
    ds = crossfeed.open_dataset(root)
    assert ds.schema["jpg"].encoding.value == "bytes"
    assert ds["train"][2]["jpg"] == im


def test_manifest_split_format_is_validated(wds_dir, tmp_path):
    root = tmp_path / "m"
    shutil.copytree(wds_dir, root)
    d = json.loads((root / MANIFEST).read_text())
    assert d["splits"]["train"]["format"] == "tar"
    d["splits"]["train"]["format"] = "zip"
    (root / MANIFEST).write_text(json.dumps(d))
    with pytest.raises(ManifestError, match=r"splits\.train\.format: unknown shard format 'zip'"):
        crossfeed.open_dataset(root)


def test_mixtures_of_tar_sources_and_of_tar_with_tfrecord(wds_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    _write_plain_tar(other, [(f"k{i}.cls", str(100 + i).encode()) for i in range(5)])
    index_dataset(other)
    mix = [crossfeed.Source(wds_dir), crossfeed.Source(other)]
    with Loader(mix, batch_size=4, shuffle="global", seed=0, features=["cls"], samples_per_epoch=28) as loader:
        labels = [c for b in loader for c in b["cls"].tolist()]
    assert len(labels) == 28 and any(c >= 100 for c in labels) and any(c < 7 for c in labels)
    tf = tmp_path / "tf"
    crossfeed.write_dataset(tf, [{"cls": 100 + i} for i in range(5)])
    mix = [crossfeed.Source(wds_dir), crossfeed.Source(tf)]  # each format its own reader (test_mixture_formats.py)
    with Loader(mix, batch_size=4, features=["cls"], samples_per_epoch=8, return_index=True) as loader:
        got = [(s, c) for b in loader for s, c in zip(b["__source__"].tolist(), b["cls"].tolist())]
    assert len(got) == 8 and all((c >= 100) == (s == 1) for s, c in got) and {s for s, _ in got} == {0, 1}


def test_remote_tars_by_range_reads_and_whole_shards(wds_dir):
    """The same tars behind an fsspec URL: global shuffle reads samples by range, block shuffle
    loads shards whole; both give the local Loader's batches."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for n in os.listdir(wds_dir):
        fs.pipe(f"/wds-remote/{n}", (wds_dir / n).read_bytes())
    kw = dict(batch_size=5, seed=4, features=["cls", "npy", "txt"], return_index=True)
    for shuffle in ("global", "block"):
        with Loader(wds_dir, shuffle=shuffle, **kw) as a, Loader("memory://wds-remote", shuffle=shuffle, **kw) as b:
            for x, y in zip(a, b, strict=True):
                assert x[INDEX_KEY].tolist() == y[INDEX_KEY].tolist() and list(x["txt"]) == list(y["txt"])
                np.testing.assert_array_equal(x["cls"], y["cls"])


@pytest.mark.timeout(90)
def test_serve_streams_tar_samples(wds_dir, tmp_path):
    ep = tmp_path / "ep"
    proc = child(
        "cli", "serve", str(wds_dir), "tcp://127.0.0.1:0", "--batch-size", "5", "--epochs", "1",
        "--heartbeat-interval", "0.1", "--heartbeat-timeout", "2", "--endpoint-file", str(ep),
        log=tmp_path / "serve.log",
    )  # fmt: skip
    try:
        with connect(read_endpoint(ep, procs=[proc]), with_meta=True, **FAST_HB) as client:
            got = [(m.sample_ids.tolist(), b["cls"].tolist(), list(b["txt"])) for m, b in client]
        assert proc.wait(30) == 0, (tmp_path / "serve.log").read_text()
    finally:
        stop(proc)
    assert sorted(i for ids, _, _ in got for i in ids) == list(range(N))
    for ids, cls, txt in got:
        assert cls == [i % 7 for i in ids] and txt == [f"photo {i} ünïcode" for i in ids]


def test_npy_members_of_any_byte_order_and_memory_order(tmp_path):
    """Arrays saved big-endian or Fortran-ordered come back equal to ``np.load`` of the member."""
    root = tmp_path / "d"
    root.mkdir()
    arrays = [np.arange(12, dtype=">f4").reshape(3, 4) * i for i in range(3)]
    arrays[1] = np.asfortranarray(arrays[1])

    def npy(a):
        b = io.BytesIO()
        np.save(b, a)
        return b.getvalue()

    _write_plain_tar(root, [(f"k{i}.npy", npy(a)) for i, a in enumerate(arrays)])
    index_dataset(root)
    assert crossfeed.open_dataset(root).schema["npy"].dtype == "float32"
    with Loader(root, batch_size=3, shuffle="none") as loader:
        got = next(iter(loader))["npy"]
    assert got.dtype == np.float32 and got.shape == (3, 3, 4)
    for a, g in zip(arrays, got):
        np.testing.assert_array_equal(g, np.load(io.BytesIO(npy(a))))
