"""An S3 test environment shared by the tests against moto's real S3 server: fixed credentials,
and no endpoint, credentials file or config anywhere but where a test puts it."""

from __future__ import annotations

import os

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def isolated_aws(monkeypatch, tmp_path):
    """For an autouse fixture (``yield from isolated_aws(monkeypatch, tmp_path)``): not fsspec's
    config or environment, not AWS's, no ~/.aws of the machine's; credentials from the standard
    AWS environment; s3fs's cached filesystems cleared before and after."""
    import fsspec
    import s3fs

    for k in list(os.environ):
        if k.startswith(("FSSPEC_", "AWS_")):
            monkeypatch.delenv(k)
    monkeypatch.delitem(fsspec.config.conf, "s3", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()
