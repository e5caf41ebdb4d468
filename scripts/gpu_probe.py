"""Print what a CUDA machine offers the swap paths: versions, the device, mapped pinned memory, batched DMA.

Run first on a GPU machine (``scripts/gpu_check.sh probe``); every line is a fact
the swap paths rely on, so a failure here explains a skipped path later.
"""

from __future__ import annotations

import ctypes
import importlib

import torch

from tiercache.movement.swap.dma import BATCH_API_VERSION, DRIVER_LIBRARY


def main() -> None:
    print(f"torch {torch.__version__} cuda {torch.version.cuda} available {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"device {props.name} sms {props.multi_processor_count} memory {props.total_memory >> 30} GiB")
    for name in ("cupy", "cuda.bindings", "triton"):
        try:
            print(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
        except ImportError as error:
            print(f"{name} missing: {error}")
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    try:
        import cupy

        attributes = cupy.cuda.runtime.pointerGetAttributes(host.data_ptr())
        print(f"pinned {host.data_ptr():#x} -> device {attributes.devicePointer:#x} type {attributes.type}")
    except Exception as error:
        print(f"cupy pointer attributes failed: {error!r}")
    driver = ctypes.CDLL(DRIVER_LIBRARY)
    version = ctypes.c_int()
    driver.cuDriverGetVersion(ctypes.byref(version))
    print(f"driver API version {version.value}")
    for api in (BATCH_API_VERSION, 13000):
        function, status = ctypes.c_void_p(), ctypes.c_int()
        result = driver.cuGetProcAddress_v2(
            b"cuMemcpyBatchAsync", ctypes.byref(function), ctypes.c_int(api), ctypes.c_uint64(0), ctypes.byref(status)
        )
        print(f"cuGetProcAddress(cuMemcpyBatchAsync, {api}) -> {result} status {status.value} at {function.value}")


if __name__ == "__main__":
    main()
