"""Loaded by a test's ``vllm serve`` (this folder on ``PYTHONPATH``): vLLM 0.32's CPU build serves Mamba-2 hybrids
with prefix caching on only without in-forward prefill checkpoints.

With prefix caching on, vLLM runs Mamba state in ``mamba_cache_mode="align"`` and ``MambaMixer2.get_kv_cache_spec``
asks for one prefill checkpoint block (``num_prefill_checkpoint_blocks=1``): the metadata builder then adds a chunk
boundary at the prompt's last block boundary and ``conv_ssm_forward`` expects a state per chunk
(``varlen_states[last_chunk_indices_p]``, ``mamba_mixer2.py``), which the CPU kernel
(``ops/cpu/mamba_ssm.py: _mamba_chunk_scan_combined_fwd_cpu``) does not return: ``IndexError`` on the first prompt
longer than a block, and the engine dies. Without checkpoint blocks vLLM's scheduler splits a prefill at that
boundary itself, the kernel gets one chunk per step, and the engine serves. A vLLM bug on CPU, not tiercache's:
this hook is the tests' only change to vLLM.
"""

import importlib.abc
import importlib.util
import sys

TARGET = "vllm.model_executor.layers.mamba.mamba_mixer2"


def _patch(module) -> None:
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import MambaSpec

    original = module.MambaMixer2.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        if isinstance(spec, MambaSpec):
            spec = replace(spec, num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None)
        return spec

    module.MambaMixer2.get_kv_cache_spec = get_kv_cache_spec


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``TARGET`` right after its first import, in every vLLM process."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def patched_exec(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = patched_exec
        return spec


sys.meta_path.insert(0, _PatchOnImport())
