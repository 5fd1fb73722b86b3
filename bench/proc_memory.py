"""This process's resident memory (standard library only: the llama.cpp worker imports it without torch)."""
from __future__ import annotations

_KEYS = {"Rss": "rss", "Pss": "pss", "Pss_Anon": "pss_anon", "Pss_File": "pss_file", "Pss_Shmem": "pss_shmem",
         "Anonymous": "anon"}


def proc_memory() -> dict:
    """Bytes from ``/proc/self/smaps_rollup``: ``rss``, ``pss`` (each shared page divided among the processes that
    map it) and their parts: ``pss_anon``, ``pss_file`` (mapped files, e.g. an mmap'ed GGUF), ``pss_shmem`` (shared
    memory, e.g. the collectives' segments), ``anon``."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            k, _, rest = line.partition(":")
            if k in _KEYS:
                out[_KEYS[k]] = int(rest.split()[0]) * 1024
    return out
