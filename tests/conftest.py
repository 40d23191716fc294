"""Test set-up: 8 fake CPU devices before JAX starts."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="session")
def mesh24() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("data", "model"))


@pytest.fixture(scope="session")
def ray_runtime():  # type: ignore[no-untyped-def]
    """One local Ray runtime for the whole session (slice tests)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(
            num_cpus=16, include_dashboard=False, log_to_driver=False, object_store_memory=1 << 30
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():  # type: ignore[no-untyped-def]
    """A 4-node Ray cluster on this machine, in a process of its own (the session's Ray runtime
    is untouched), started at a module's first use: ``ray_cluster.run(body, *args)`` runs a test
    body there (``tests/_cluster.py``)."""
    pytest.importorskip("ray")
    from tests._cluster import ClusterProcess

    with ClusterProcess(nodes=4) as cluster:
        yield cluster


from tests._object_stores import bucket_url, gcs_endpoint, s3_endpoint  # noqa: E402, F401  (fixtures)
