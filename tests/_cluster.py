"""A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``), for slice tests that
need real nodes: one raylet per node, a slice placed one host per node (``Slice.connect``,
STRICT_SPREAD), nodes removed and added while the slice works.

A cluster is a Ray instance of its own, so it runs in a process of its own, its driver, and the
session's Ray runtime (``conftest.ray_runtime``) is left alone. A test writes its body as a
module-level function ``body(cluster: LocalCluster, *args: str)`` and runs it there with the
``ray_cluster`` fixture (a :class:`ClusterProcess`, one per test module), which fails the test
with the process's output if the body fails or runs out of time::

    def _body(cluster: LocalCluster, tmp: str) -> None:
        with cluster.slice(devices_per_host=2) as s:  # one host per node
            ...

    def test_it(ray_cluster: ClusterProcess, tmp_path: Path) -> None:
        ray_cluster.run(_body, str(tmp_path))

The cluster's Ray files (sockets, logs, its address) go to a temporary folder of its own
(``RAY_TMPDIR``): a ``ray.init()`` elsewhere on the machine never finds and joins it.

:class:`HeldWrites` holds a slice's background writes on its hosts until the test releases them,
to act (remove a node, say) while a save is in flight, decided by an event and not a sleep.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests import _subproc

NODE_CPUS = 1
"""Ray CPUs per node: a slice host reserves 0.5 (``SliceOptions.cpus_per_host``)."""
NODE_OBJECT_STORE_BYTES = 96 << 20
"""Each node's object store (only ``Slice.put``/``fetch`` use it); Ray's minimum is 75 MiB."""
START_TIMEOUT_SECS = 60.0
"""How long a node may take to register with the cluster (2 busy cores: a few seconds each)."""

_REPORT = "reported: "


def report(**facts: Any) -> None:
    """Print, from a body run in the cluster's process, what it found (as JSON): the test that
    ran it asserts that (:func:`reported`)."""
    print(_REPORT + json.dumps(facts, sort_keys=True), flush=True)


def reported(output: str) -> dict[str, Any]:
    """What a body's last :func:`report` said, from its output (``ClusterProcess.run``)."""
    lines = [line for line in output.splitlines() if line.startswith(_REPORT)]
    assert lines, f"the body reported nothing; its output:\n{output[-6000:]}"
    found: dict[str, Any] = json.loads(lines[-1][len(_REPORT) :])
    return found


class LocalCluster:
    """A running ``ray.cluster_utils.Cluster`` and this process connected to it as its driver.

    ``nodes`` lists the live nodes, the head (where this driver runs) first. Each node has a
    custom resource ``node<k>`` of 1 (k: its order of creation), to place an actor on it."""

    def __init__(self, cluster: Any, nodes: list[Any]) -> None:
        self.cluster = cluster
        self.nodes = nodes
        self._added = len(nodes)

    @property
    def head(self) -> Any:
        return self.nodes[0]

    @property
    def node_ids(self) -> list[str]:
        """The live nodes' Ray ids (hex), the head first."""
        return [n.node_id for n in self.nodes]

    def add_node(self) -> Any:
        """Start one more node (a raylet), registered before this returns."""
        with _forks_then_execs():
            node = self.cluster.add_node(**_node_args(self._added), wait=False)
        self._added += 1
        _wait_registered(self.cluster, node)
        self.nodes.append(node)
        return node

    def remove_node(self, node: Any, *, graceful: bool = False) -> None:
        """Stop a node's raylet and everything on it (its actors die with it): killed at once
        (SIGKILL), as when its machine fails, or ``graceful``: asked to stop first (SIGTERM)."""
        if node is self.head:
            raise ValueError("the head node runs this driver; remove another node")
        self.cluster.remove_node(node, allow_graceful=graceful)
        self.nodes.remove(node)

    def resize(self, nodes: int) -> None:
        """Add nodes, or remove the newest worker nodes, until ``nodes`` are live."""
        while len(self.nodes) < nodes:
            self.add_node()
        while len(self.nodes) > max(nodes, 1):
            self.remove_node(self.nodes[-1], graceful=True)

    def node_of(self, node_id: str) -> Any:
        """The live node whose Ray id is ``node_id`` (a host's ``identity()['node']``)."""
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no live node {node_id[:12]} (live: {[n[:12] for n in self.node_ids]})")

    def slice(self, *, devices_per_host: int, hosts: int | None = None, **options: Any) -> Any:
        """``Slice.connect`` on this cluster: one host per node (all nodes unless ``hosts``),
        each with ``devices_per_host`` fake CPU devices; ``options``: ``SliceOptions`` fields."""
        import milepost as mp

        options.setdefault("start_timeout_secs", 120.0)
        options.setdefault("timeout_secs", 120.0)
        return mp.Slice.connect(
            address=self.cluster.address,
            hosts=len(self.nodes) if hosts is None else hosts,
            devices_per_host=devices_per_host,
            options=mp.SliceOptions(**options),
        )


@contextlib.contextmanager
def _forks_then_execs() -> Iterator[None]:
    """Ray starts a node's processes with subprocess (fork, then exec at once: no Python runs
    in the child), which JAX's warning about forking a process that runs JAX does not tell
    apart: silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        yield


def _node_args(k: int) -> dict[str, Any]:
    return {
        "num_cpus": NODE_CPUS,
        "object_store_memory": NODE_OBJECT_STORE_BYTES,
        "resources": {f"node{k}": 1},
    }


def _wait_registered(cluster: Any, node: Any) -> None:
    """Until ``node`` is in the cluster's node table (bounded, with a clear error)."""
    try:
        cluster._wait_for_node(node, timeout=START_TIMEOUT_SECS)
    except TimeoutError:
        raise TimeoutError(
            f"Ray node {node.node_id[:12]} did not register within {START_TIMEOUT_SECS:g}s; the "
            f"machine may be overloaded (its logs under {node.get_session_dir_path()} say why)"
        ) from None


@contextlib.contextmanager
def local_cluster(nodes: int = 4) -> Iterator[LocalCluster]:
    """A cluster of ``nodes`` nodes, this process its driver; everything stopped on exit.

    Needs a process without a Ray runtime: tests run their bodies in one with
    :class:`ClusterProcess` (the ``ray_cluster`` fixture)."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        raise RuntimeError(
            "local_cluster needs a process without a Ray runtime (a cluster is a Ray instance "
            "of its own); run the test's body in a process of its own with the ray_cluster "
            "fixture (tests._cluster.ClusterProcess)"
        )
    own_tmp = None
    if not os.environ.get("RAY_TMPDIR"):  # keep the cluster's address file to ourselves
        own_tmp = tempfile.mkdtemp(prefix="mpc-", dir="/tmp")  # short: Ray's socket paths
        os.environ["RAY_TMPDIR"] = own_tmp
    with _forks_then_execs():
        cluster = Cluster(
            initialize_head=True, head_node_args={**_node_args(0), "include_dashboard": False}
        )
    try:
        members = [cluster.head_node]
        with _forks_then_execs():
            for k in range(1, nodes):
                members.append(cluster.add_node(**_node_args(k), wait=False))
        for node in members[1:]:
            _wait_registered(cluster, node)
        ray.init(address=cluster.address, log_to_driver=False)
        live = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert live == {n.node_id for n in members}, (live, [n.node_id for n in members])
        yield LocalCluster(cluster, members)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if own_tmp is not None:
            del os.environ["RAY_TMPDIR"]
            shutil.rmtree(own_tmp, ignore_errors=True)


# -- running test bodies in a process of its own ----------------------------------------------
_MARK = "@@milepost-cluster@@"
"""Starts the lines by which the cluster's process tells the tests that a body ended."""


class ClusterProcess:
    """A process that runs a cluster of ``nodes`` nodes and, in turn, the test bodies it is
    given (started at the first, kept for the next: a module's tests pay for one cluster).

    Each body finds the cluster with ``nodes`` live nodes (nodes a body removed or added are
    replaced or removed first). A body that fails gets the next one a new cluster; one that
    runs out of time gets the process killed, and the next body a new process."""

    def __init__(self, nodes: int = 4) -> None:
        self.nodes = nodes
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._tmp = ""

    def __enter__(self) -> ClusterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, body: Callable[..., None], *args: str, timeout_secs: float = 240.0) -> str:
        """``body(cluster, *args)`` in the cluster's process (``body``: a module-level function);
        its output. Fails the test with the output if the body fails, or if it has not ended
        within ``timeout_secs`` (which includes starting the cluster when there is none)."""
        target = f"{body.__module__}:{body.__qualname__}"
        proc = self._start()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps([target, list(args)]) + "\n")
        proc.stdin.flush()
        deadline = time.monotonic() + timeout_secs
        out: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close(timeout_secs=0)
                raise AssertionError(
                    f"{target} on the {self.nodes}-node cluster did not end within "
                    f"{timeout_secs:g}s (its process is killed); its output:\n"
                    + "".join(out)[-12000:]
                ) from None
            if line is None:
                self.close()
                raise AssertionError(
                    f"the cluster's process ended during {target} (exit status "
                    f"{proc.returncode}); its output:\n" + "".join(out)[-12000:]
                )
            if line.startswith(_MARK):
                status = line[len(_MARK) :].strip()
                if status != "ok":
                    raise AssertionError(
                        f"{target} failed on the {self.nodes}-node cluster; its output:\n"
                        + "".join(out)[-12000:]
                    )
                return "".join(out)
            out.append(line)

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self.close()
        self._tmp = tempfile.mkdtemp(prefix="mpc-", dir="/tmp")  # short: Ray's socket paths
        env = _subproc.env(8)
        env["RAY_TMPDIR"] = self._tmp
        env.pop("RAY_ADDRESS", None)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests._cluster", str(self.nodes)],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a process group of its own: killed with its cluster
        )
        self._lines = queue.Queue()
        threading.Thread(target=_pump, args=(self._proc.stdout, self._lines), daemon=True).start()
        return self._proc

    def close(self, timeout_secs: float = 60.0) -> None:
        """Stop the process and its cluster; killed if it has not ended within ``timeout_secs``
        (0: at once)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # the process stops its cluster and ends
            try:
                proc.wait(timeout_secs)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        if self._tmp:
            _reap_leftovers(self._tmp)
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = ""


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _reap_leftovers(ray_tmp: str) -> None:
    """Kill what still runs from the cluster's folder (its processes name it on their command
    lines): a process killed at a timeout may leave some."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if any(ray_tmp in arg for arg in p.info["cmdline"] or ()):
                p.kill()


def _serve(nodes: int) -> None:
    """The cluster's process: runs the bodies named on stdin (one JSON ``[target, args]`` a
    line), each followed by a status line; stops the cluster when stdin closes."""
    requests = iter(sys.stdin.readline, "")
    while True:
        started = time.monotonic()
        with local_cluster(nodes) as cluster:
            print(f"[cluster] {nodes} nodes up in {time.monotonic() - started:.1f}s", flush=True)
            for request in requests:
                target, args = json.loads(request)
                ok = _run_body(cluster, nodes, target, args)
                print(f"{_MARK} {'ok' if ok else 'failed'}", flush=True)
                if not ok:
                    break  # the cluster may be broken: the next body gets a new one
            else:
                return  # stdin closed: stop the cluster


def _run_body(cluster: LocalCluster, nodes: int, target: str, args: list[str]) -> bool:
    t0 = time.monotonic()
    try:
        cluster.resize(nodes)
        module, _, name = target.partition(":")
        getattr(importlib.import_module(module), name)(cluster, *args)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        return False
    finally:
        print(f"[cluster] {target} took {time.monotonic() - t0:.1f}s", flush=True)
    return True


# -- holding a slice's writes on its hosts ----------------------------------------------------
class HeldWrites:
    """Holds the background writes of the next saves on every host of ``slice`` until
    :meth:`release`: each host's writes are issued off its staging thread (the writer job that
    ``workers.save._stage`` hands to the copy pool), and that job waits here first. A save
    then returns from its blocking part (``save_async``) with no host's data written.

    >>> held = HeldWrites(s)
    >>> handle = mp.save_async(path, tree)
    >>> held.wait_held()  # every host's writes are waiting: act now
    >>> held.release()
    """

    def __init__(self, slice_: Any, timeout_secs: float = 120.0) -> None:
        import ray

        self._actors = list(slice_.group._actors)
        self._timeout = timeout_secs
        ray.get(
            [a.__ray_call__.remote(_hold_on_host, timeout_secs) for a in self._actors],
            timeout=timeout_secs,
        )

    def wait_held(self, hosts: Any = None, timeout: float = 30.0) -> None:
        """Until every host's writes (or those of ``hosts``) are waiting at the gate; an error
        if not: the save path changed under the gate (update ``_hold_on_host``)."""
        import ray

        chosen = range(len(self._actors)) if hosts is None else hosts
        held = ray.get(
            [self._actors[i].__ray_call__.remote(_held_on_host, timeout) for i in chosen],
            timeout=timeout + 30,
        )
        missing = [i for i, h in zip(chosen, held, strict=True) if not h]
        assert not missing, (
            f"hosts {missing}: no write reached the gate within {timeout:g}s (does "
            "workers.save._stage still issue the staged writes through on_copy_pool?)"
        )

    def release(self, hosts: Any = None) -> None:
        """Let the held writes (of every host, or of ``hosts``) go, and later ones pass."""
        import ray

        chosen = range(len(self._actors)) if hosts is None else hosts
        ray.get(
            [self._actors[i].__ray_call__.remote(_release_on_host) for i in chosen],
            timeout=self._timeout,
        )


def _hold_on_host(host: Any, timeout_secs: float) -> None:
    """On a host: the writer jobs of its saves wait for the gate (see ``HeldWrites``)."""
    from milepost.workers.save import _stage

    real = getattr(host, "_test_real_on_copy_pool", _stage.on_copy_pool)
    gate, reached = threading.Event(), threading.Event()

    def gated(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def held() -> Any:
            reached.set()
            if not gate.wait(timeout_secs):
                raise TimeoutError(f"the test's gate on host {host.index}'s writes never opened")
            return fn(*args, **kwargs)

        return real(held)

    host._test_real_on_copy_pool = real
    host._test_gate = (gate, reached)
    _stage.on_copy_pool = gated


def _held_on_host(host: Any, timeout_secs: float) -> bool:
    return bool(host._test_gate[1].wait(timeout_secs))


def _release_on_host(host: Any) -> None:
    from milepost.workers.save import _stage

    _stage.on_copy_pool = host._test_real_on_copy_pool
    host._test_gate[0].set()


if __name__ == "__main__":  # (through the module's import: one copy of it, not two)
    from tests._cluster import _serve as serve

    serve(int(sys.argv[1]))
