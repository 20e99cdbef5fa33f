"""Real tf.distribute training on CPU, each in a fresh interpreter (logical devices and in-process
servers must be set up before TensorFlow's runtime starts): MirroredStrategy over 2 logical CPUs
with Keras ``model.fit``, ParameterServerStrategy with an in-process cluster, and the promise
that the TensorFlow adapter never imports torch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import (
    requires,
    run_python,
)

import crossfeed

pytestmark = [pytest.mark.slow, requires("tensorflow")]  # slow: Keras under tf.distribute strategies


def _separable(n: int, seed: int = 0) -> list[dict]:
    """8 features, 3 classes, a linear rule: a tiny model learns it in a few dozen steps."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((8, 3))
    xs = rng.standard_normal((n, 8)).astype(np.float32)
    return [{"id": i, "x": xs[i], "label": int(np.argmax(xs[i] @ w))} for i in range(n)]


@pytest.fixture(scope="module")
def separable(tmp_path_factory):
    root = tmp_path_factory.mktemp("separable")
    crossfeed.write_dataset(root, _separable(1000), num_shards=4).close()
    return str(root)


def _result(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_keras_fit_under_mirrored_strategy(separable):
    proc = run_python(
        """
        import json, sys
        from crossfeed.adapters.tf_demo import logical_cpus, train_keras_demo
        devices = logical_cpus(2)  # before anything starts TensorFlow's runtime
        import tensorflow as tf
        import crossfeed.adapters.tf as cftf

        path = sys.argv[1]
        strategy = tf.distribute.MirroredStrategy(devices)
        dist = strategy.distribute_datasets_from_function(cftf.input_fn(path, global_batch_size=64, seed=1))
        sizes, ids = [], []
        for batch in dist:  # what each replica receives, step by step
            local = strategy.experimental_local_results(batch)
            sizes.append([int(t["x"].shape[0]) for t in local])
            ids += [int(i) for t in local for i in t["id"].numpy()]
        demo = train_keras_demo(path, steps=15, batch_size=64, epochs=3, num_devices=2)
        print(json.dumps({"devices": devices, "sizes": sizes, "ids": ids, "demo": demo,
                          "torch": "torch" in sys.modules}))
    """,
        separable,
        timeout=240,
    )
    out = _result(proc)
    assert len(out["devices"]) == 2
    assert out["sizes"] == [[32, 32]] * (1000 // 64)  # per-replica batch, same steps for both replicas
    assert len(out["ids"]) == len(set(out["ids"])) == 1000 // 64 * 64
    demo = out["demo"]
    assert demo["replicas"] == 2
    assert demo["loss"][1] < 0.7 * demo["loss"][0]  # it learns
    assert demo["accuracy"] > 0.6 and demo["samples_per_s"] > 0
    assert out["torch"] is False


def test_parameter_server_strategy_in_process_cluster(separable):
    proc = run_python(
        """
        import json, socket, sys
        import tensorflow as tf
        import crossfeed.adapters.tf as cftf

        def free_port():
            with socket.socket() as s:
                s.bind(("localhost", 0))
                return s.getsockname()[1]

        # TF's "in-process cluster" (multi_worker_test_base / the PS training tutorial)
        spec = tf.train.ClusterSpec({"worker": [f"localhost:{free_port()}" for _ in range(2)],
                                     "ps": [f"localhost:{free_port()}"]})
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=3)
        servers = [tf.distribute.Server(spec, job_name="worker", task_index=i, config=config, protocol="grpc")
                   for i in range(2)]
        servers.append(tf.distribute.Server(spec, job_name="ps", task_index=0, protocol="grpc"))
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

        fn = cftf.input_fn(sys.argv[1], global_batch_size=32, repeat=True, seed=None, engine="native")
        per_worker = coordinator.create_per_worker_dataset(lambda: strategy.distribute_datasets_from_function(fn))
        it = iter(per_worker)
        with strategy.scope():
            w = tf.Variable(tf.zeros([8, 3]))
            b = tf.Variable(tf.zeros([3]))

        @tf.function
        def train_step(iterator):
            def replica_fn(batch):
                with tf.GradientTape() as tape:
                    logits = tf.matmul(batch["x"], w) + b
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(batch["label"], logits))
                gw, gb = tape.gradient(loss, [w, b])
                w.assign_sub(0.5 * gw)
                b.assign_sub(0.5 * gb)
                return loss, tf.shape(batch["x"])[0]
            return strategy.run(replica_fn, args=(next(iterator),))

        results = [coordinator.schedule(train_step, args=(it,)) for _ in range(40)]
        coordinator.join()
        out = [r.fetch() for r in results]
        losses = [float(l) for l, _ in out]
        print(json.dumps({"first": sum(losses[:5]) / 5, "last": sum(losses[-5:]) / 5,
                          "sizes": sorted({int(n) for _, n in out}), "workers": len(spec.job_tasks("worker"))}))
    """,
        separable,
        timeout=240,
    )
    out = _result(proc)
    assert out["workers"] == 2
    assert out["sizes"] == [32]
    assert out["last"] < 0.7 * out["first"]


def test_the_tf_adapter_never_imports_torch(separable):
    proc = run_python(
        """
        import json, sys
        import crossfeed.adapters.tf as cftf
        native = next(iter(cftf.dataset(sys.argv[1], batch_size=8, engine="native")))
        plan = next(iter(cftf.dataset(sys.argv[1], batch_size=8, engine="plan")))
        print(json.dumps({"torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
                          "tf": "tensorflow" in sys.modules, "shapes": [native["x"].shape.as_list(),
                                                                       plan["x"].shape.as_list()]}))
    """,
        separable,
    )
    out = _result(proc)
    assert out == {"torch": [], "tf": True, "shapes": [[8, 8], [8, 8]]}
