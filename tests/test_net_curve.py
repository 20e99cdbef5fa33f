"""CURVE: only clients whose public key the server holds get anything, and the stream is encrypted."""

from __future__ import annotations

import shutil

import pytest
from net_helpers import Synthetic

from crossfeed.errors import ConfigError, ServerLostError
from crossfeed.net import ClientKeys, Heartbeat, Server, ServerKeys, ServerOptions, connect, keygen

pytestmark = pytest.mark.timeout(60)
QUICK = {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "connect_timeout": 1.5}


@pytest.fixture
def keys(tmp_path):
    made = tmp_path / "made"
    for name in ("server", "client", "intruder"):
        keygen(made, name)
    server_dir, client_dir = tmp_path / "server", tmp_path / "client"
    server_dir.mkdir()
    client_dir.mkdir()
    shutil.copy(made / "server.key_secret", server_dir)
    shutil.copy(made / "client.key", server_dir)  # the only client the server accepts
    shutil.copy(made / "client.key_secret", client_dir)
    shutil.copy(made / "server.key", client_dir)
    return made, server_dir, client_dir


def test_only_authorised_clients_get_data(keys):
    made, server_dir, client_dir = keys
    opts = ServerOptions(("tcp://127.0.0.1:0",), epochs=1, heartbeat=Heartbeat(0.1, 2.0))
    with Server(Synthetic(num_samples=20, batch_size=5), opts, keys=ServerKeys.from_dir(server_dir)) as server:
        address = server.endpoints[0]
        intruder = ClientKeys.from_files(made / "intruder.key_secret", made / "server.key")
        for bad_keys in (None, intruder):
            with connect(address, keys=bad_keys, **QUICK) as client:
                with pytest.raises(ServerLostError, match="no answer"):
                    next(client)  # refused in the handshake: the server never answers
                assert [lost.address for lost in client.lost] == [address]
        assert server.stats["sent"] == 0
        with connect(address, keys=client_dir, with_meta=True, **QUICK) as client:
            ids = sorted(i for meta, _ in client for i in meta.sample_ids.tolist())
            assert client.lost == []
    assert ids == list(range(20))


def test_a_key_directory_without_clients_or_secret_is_refused(tmp_path):
    keygen(tmp_path, "server")
    with pytest.raises(ConfigError, match="no client public keys"):
        ServerKeys.from_dir(tmp_path)
    with pytest.raises(ConfigError, match="secret"):
        ServerKeys.from_dir(tmp_path, tmp_path / "server.key")
    with pytest.raises(ConfigError):
        keygen(tmp_path, "server")
