"""A second SGLang process: attaches the backend to a host pool of its own and reads pages another wrote.

Usage: ``python -m support.sglang_second_process '{"topology": ..., "layout": ..., "mla": ..., "keys": [...]}'``;
prints a JSON object: the matching prefix ``batch_exists`` reports, the per-page results of ``batch_get_v1`` and the
sha256 of every page read (SGLang's ``get_data_page``).
"""

from __future__ import annotations

import json
import sys

from tiercache.testing.sglang_parts import alloc, attach, digests, host_pool, page_bytes, scramble


def main(request: dict) -> dict:
    pool = host_pool(request["layout"], mla=request["mla"])
    scramble(pool, seed=99)  # different bytes from the writer's pool, so a page that is not read cannot match
    backend = attach(pool, request["topology"], mla=request["mla"])
    try:
        keys = request["keys"]
        indices = alloc(pool, len(keys))
        held = backend.batch_exists(keys)
        filled = backend.batch_get_v1(keys, indices)
        return {"held": held, "filled": filled, "digests": digests(page_bytes(pool, indices))}
    finally:
        backend.close()


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
