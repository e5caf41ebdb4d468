"""The CPU tier's region at start: room made sure of before anything is mapped, nothing left behind by a failed or
killed start, stale files of dead processes removed, a shared_dir that is not shared memory said in the log.

The file systems are real: this machine's ``/tmp`` (a disk's), ``/dev/shm`` and a
1 MiB tmpfs mounted in a private mount namespace (``unshare``), where a region
that does not fit is refused with a clear error instead of a SIGBUS. The killed
starts are real processes (a worker that mapped the region, then SIGKILLed,
SIGTERMed as vLLM's executor does, or ending on an exception).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.vllm_connector import Instances
from support.vllm_parts import LAYERS, cpu_topology, kv_cache_config, kv_tensors, vllm_config
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager

from tiercache.integrations.vllm.connector.geometry import GroupGeometry, GroupKind, SlotGeometry
from tiercache.integrations.vllm.connector.region import RegionError, SharedRegion
from tiercache.integrations.vllm.connector.shmfile import filesystem
from tiercache.integrations.vllm.connector.worker import ConnectorWorker

TMPFS_BYTES = 1 << 20
"""The private tmpfs's size."""
WORKER = """
import signal, sys
from tiercache.integrations.vllm.connector.region import SharedRegion
def stop(signum, frame):  # vLLM's WorkerProc: SIGTERM raises SystemExit, its finally shuts the worker down
    raise SystemExit()
signal.signal(signal.SIGTERM, stop)
region = SharedRegion.for_worker({path!r}, 64, 8192, 0)  # what a worker's register_kv_caches maps
try:
    print("mapped", flush=True)
    sys.stdin.readline()  # the test says when to go on
    if {end!r} == "raise":
        raise RuntimeError("vLLM's start failed after the KV caches were registered")
finally:
    if {end!r} == "term":
        region.close()  # ConnectorWorker.close, from the connector's shutdown
"""


PAGE = 1024
"""Bytes of a page of ``support.vllm_connector``'s KV tensors."""


def geometry(world: int = 1) -> SlotGeometry:
    return SlotGeometry((GroupGeometry(GroupKind.FULL, tuple(LAYERS), PAGE),), world, 16)


def run_in_tmpfs(code: str, tmp_path: Path) -> dict:
    """``code`` (printing a JSON line) in a process of its own mount namespace, with a 1 MiB tmpfs at ``mount``."""
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "script.py"
    script.write_text(code.replace("MOUNT", str(mount)))
    tests = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(["unshare", "-rm", "sh", "-c",
                           f"mount -t tmpfs -o size={TMPFS_BYTES} tmpfs {mount} && {sys.executable} {script}"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"unshare and mount (a private tmpfs) must work here: {done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


SMALL_TMPFS = """
import json, os, signal
from pathlib import Path
from tiercache.integrations.vllm.connector.region import SharedRegion, RegionSpaceError
from tiercache.integrations.vllm.connector.shmfile import filesystem
directory, out = Path("MOUNT"), {}
out["filesystem"] = filesystem(directory)
for name, probe in (("checked", None), ("raced", lambda d: 1 << 40)):  # raced: the room went after the check
    try:
        region = SharedRegion.for_worker(directory / f"tiercache-{name}-dp0", 2, 1 << 20, 0,
                                         **({"free_space": probe} if probe else {}))
        region.slots.fill_(1)  # without the reservation: a SIGBUS here
        out[name] = "mapped"
    except RegionSpaceError as error:
        out[name] = str(error)
    out[name + "_left"] = sorted(os.listdir(directory))
fits = SharedRegion.for_worker(directory / "tiercache-fits-dp0", 2, 256 << 10, 0)
fits.slots.fill_(7)
out["fits"] = int(fits.slots.sum())
print(json.dumps(out))
"""


VLLM_START = """
import json, os
from pathlib import Path
from support.vllm_connector import Instance, model_dir, vllm_config
from tiercache.integrations.vllm.connector.region import RegionSpaceError
directory = Path("MOUNT")
topology = {"tiers": [{"type": "cpu", "capacity_bytes": 4 << 20}]}
config = vllm_config(model_dir(directory.parent), "small", {"topology": topology, "shared_dir": str(directory)})
try:
    Instance(config)
    print(json.dumps({"error": None}))
except RegionSpaceError as error:
    print(json.dumps({"error": str(error), "left": sorted(os.listdir(directory))}))
"""


def test_a_cpu_tier_larger_than_its_shared_dir_stops_vllm_at_start_with_a_clear_error_leaving_nothing(
    tmp_path: Path,
) -> None:
    out = run_in_tmpfs(VLLM_START, tmp_path)
    error = out["error"]
    assert error is not None and "tiercache-small-dp0" in error and "needs 4 MiB" in error
    assert "has 1 MiB (1048576 bytes) free" in error
    assert "capacity_bytes" in error and "shared_dir" in error and "--shm-size" in error
    assert out["left"] == [], "nothing left behind"


def test_a_region_too_big_for_a_small_tmpfs_is_refused_and_a_raced_one_fails_cleanly_not_with_sigbus(
    tmp_path: Path,
) -> None:
    out = run_in_tmpfs(SMALL_TMPFS, tmp_path)
    assert out["filesystem"] == "tmpfs"
    assert "needs 2 MiB" in out["checked"] and "bytes) free" in out["checked"], "the free-space check"
    assert "needs 2 MiB" in out["raced"], "posix_fallocate's ENOSPC, the process alive (no SIGBUS)"
    assert out["checked_left"] == [] and out["raced_left"] == [], "nothing left behind"
    assert out["fits"] == 7 * 2 * (256 << 10), "a region that fits maps and is written"


def test_a_shared_dir_on_a_disk_is_said_in_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert filesystem(Path("/dev/shm")) == "tmpfs"
    kind = filesystem(tmp_path)
    assert kind not in (None, "tmpfs"), "this machine's /tmp is a disk's file system"
    SharedRegion.for_worker(tmp_path / "tiercache-disk-dp0", 2, 4096, 0).close()
    assert f"is on {kind}, not shared memory" in caplog.text and str(tmp_path) in caplog.text


def start_worker(path: Path, end: str) -> subprocess.Popen:
    """A worker process that maps the region at ``path`` and then ends as ``end`` says."""
    code = WORKER.format(path=str(path), end=end)
    worker = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None and worker.stdout.readline().strip() == "mapped"
    assert path.exists()
    return worker


@pytest.mark.parametrize("end", ["term", "raise"])
def test_a_start_failing_after_the_workers_mapped_the_region_leaves_no_file(tmp_path: Path, end: str) -> None:
    path = tmp_path / "tiercache-failed-dp0"
    worker = start_worker(path, end)
    if end == "term":
        worker.send_signal(signal.SIGTERM)  # vLLM's executor shutting its workers down
    else:
        worker.communicate("go\n", timeout=60)
    worker.wait(timeout=60)
    assert not path.exists(), "the worker removed the name the scheduler side never took"


def test_a_start_killed_after_the_workers_mapped_the_region_is_swept_by_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stale = tmp_path / "tiercache-killed-dp0"
    worker = start_worker(stale, "sleep")
    live = tmp_path / "tiercache-live-dp0"
    alive = start_worker(live, "sleep")
    try:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=60)
        assert stale.exists(), "nothing could remove it: its process was killed outright"
        again = ConnectorWorker(geometry(), 8, tmp_path / "tiercache-next-dp0", 0)
        again.register_kv_caches(kv_tensors(kv_cache_config()))
        assert not stale.exists(), "the next start removed the file no process holds"
        assert live.exists(), "a running instance's region stays"
        assert f"removed {stale}" in caplog.text
        again.close()
        assert not (tmp_path / "tiercache-next-dp0").exists()
    finally:
        alive.kill()
        alive.wait(timeout=60)


def test_a_scheduler_side_that_refuses_the_region_removes_its_name(vllm: Instances) -> None:
    config = vllm_config(vllm.model, "tp2", vllm.extra(cpu_topology()), tensor_parallel_size=2)
    worker = ConnectorWorker(geometry(world=2), 48, vllm.root / "tiercache-tp2-dp0", 0)
    worker.register_kv_caches(kv_tensors(kv_cache_config()))
    with pytest.raises(RegionError, match=r"ranks \[1\] of 2"):
        Scheduler(vllm_config=config, kv_cache_config=kv_cache_config(), block_size=16,
                  structured_output_manager=StructuredOutputManager(config))
    assert not (vllm.root / "tiercache-tp2-dp0").exists()
    worker.close()


def test_two_instances_of_one_engine_id_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "tiercache-same-dp0"
    first = SharedRegion.for_worker(path, 4, 4096, 0)
    with pytest.raises(RegionError, match="another running vLLM instance"):
        SharedRegion.for_worker(path, 4, 4096, 0)
    assert path.exists(), "the first instance's region stays"
    with pytest.raises(RegionError, match="same engine_id"):
        SharedRegion.for_worker(path, 2, 4096, 1)
    first.close()
    assert not path.exists() and os.listdir(tmp_path) == []
