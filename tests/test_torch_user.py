"""The PyTorch adapter on a new user's data gives the Loader's shapes and samples: dense digits of
one size, photos of different sizes as lists, the partial last batch kept. Imports torch, never TF
(the TF side is compared against the same Loader in test_tf_user.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import lazy_import
from user_data import crossfeed as run_cli
from user_data import digits_folder, photos_folder

import crossfeed

torch = lazy_import("torch")
cftorch = lazy_import("crossfeed.adapters.torch")
pytestmark = pytest.mark.slow  # torch imported: the user walkthrough


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    digits_folder(root / "png")
    photos_folder(root / "jpg")
    for name in ("png", "jpg"):
        proc = run_cli("convert", "images", root / name, root / f"{name}-ds")
        assert proc.returncode == 0, proc.stderr
    return str(root / "png-ds"), str(root / "jpg-ds")


def test_digits_and_photos_match_the_loader(images):
    for path in images:
        with crossfeed.Loader(path, batch_size=4, shuffle="none") as ld:
            want = list(ld)
        with cftorch.StatefulLoader(
            cftorch.TorchDataset(path, batch_size=4, shuffle="none", rank=0, world_size=1), num_workers=0
        ) as loader:
            got = list(loader)
        assert len(got) == len(want) and len(want[-1]["label"]) < 4  # the partial last batch is kept
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g["label"].numpy(), w["label"])
            if isinstance(g["image"], torch.Tensor):  # digits: all 32×32×1, dense in both
                assert path == images[0] and tuple(g["image"].shape) == w["image"].shape
                np.testing.assert_array_equal(g["image"].numpy(), w["image"])
            else:  # photos: a list of H×W×3 tensors, as the Loader's list of arrays
                assert path == images[1]
                for a, b in zip(g["image"], list(w["image"])):
                    np.testing.assert_array_equal(a.numpy(), b)
