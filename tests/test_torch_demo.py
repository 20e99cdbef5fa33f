"""The PyTorch demo: a tiny CNN learns synthetic class-coloured JPEG/PNG images of mixed sizes,
read from a dataset and from a `crossfeed.connect` stream."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import lazy_import

import crossfeed
from crossfeed.errors import ConfigError
from crossfeed.format.schema import Encoding, Feature, Schema

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # slow: torch training demo
SCHEMA = Schema(
    [Feature("image", "uint8", (None, None, 3), Encoding.IMAGE), Feature("label", "int64", (), Encoding.INT64)]
)

torch_demo = lazy_import("crossfeed.adapters.torch_demo")


def _images(n: int, seed: int):
    """Class k's images are tinted towards channel k; sizes 20-40 px; JPEG and PNG mixed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        label = int(rng.integers(0, 3))
        h, w = (int(v) for v in rng.integers(20, 41, 2))
        img = rng.integers(0, 120, (h, w, 3), dtype=np.uint8)
        img[:, :, label] += 120
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG" if i % 3 == 0 else "JPEG", quality=90)
        yield {"image": buf.getvalue(), "label": label}


@pytest.fixture(scope="module")
def demo_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo") / "images"
    crossfeed.write_dataset(root, _images(256, 0), schema=SCHEMA, num_shards=2).close()
    crossfeed.write_dataset(root, _images(96, 1), split="test", schema=SCHEMA, num_shards=1, add_split=True).close()
    return root


def test_demo_trains_and_reports_held_out_accuracy(demo_dataset):
    result = torch_demo.train(demo_dataset, steps=60, batch_size=16, image_size=16)
    assert result["steps"] == 60 and result["accuracy_on"] == "test"
    assert result["accuracy"] > 0.8  # chance is 1/3
    assert result["samples_per_s"] > 0 and np.isfinite(result["final_loss"])


def test_demo_trains_from_a_crossfeed_connect_stream(demo_dataset):
    from net_helpers import FAST_HB

    from crossfeed.net import Heartbeat, Server, ServerOptions, connect
    from crossfeed.read.loader import Loader

    loader = Loader(
        demo_dataset, batch_size=16, seed=0, rank=0, world_size=1, transform=torch_demo.ResizeImage("image", 16)
    )

    def epochs(epoch):
        loader.set_epoch(epoch)
        return iter(loader)

    hb = Heartbeat(FAST_HB["heartbeat_interval"], FAST_HB["heartbeat_timeout"])
    with Server(epochs, ServerOptions(("tcp://127.0.0.1:0",), epochs=4, heartbeat=hb)) as server:
        with connect(server.endpoints, **FAST_HB) as client:
            with pytest.raises(ConfigError, match="num_classes"):
                torch_demo.train(client, steps=5)
            result = torch_demo.train(client, steps=50, batch_size=16, image_size=16, num_classes=3)
    loader.close()
    assert result["steps"] == 50 and result["accuracy"] > 0.6  # on the last training batches
