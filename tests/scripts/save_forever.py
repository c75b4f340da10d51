"""Saves a large checkpoint atomically in a loop until killed; each version's payload is filled with its number."""

import sys

import torch

from fabriclite.checkpoint import atomic_save

path = sys.argv[1]
payload = torch.empty(16 * 1024 * 1024)  # 64 MB, so a write takes long enough to be interrupted
version = 0
while True:
    version += 1
    payload.fill_(float(version))
    atomic_save({"version": version, "payload": payload}, path)
    if version == 1:
        print("saved", flush=True)
